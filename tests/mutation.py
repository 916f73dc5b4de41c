"""Mutation testing (issue 26): mutmut changes one thing at a time in the modules where a silent
error costs users most (a comparison flipped, a constant moved, a call's argument dropped) and
runs the tests that cover the changed function; a mutant no test notices is a gap.

    python tests/mutation.py [--modules costmodel,search.auto] [--children 2] [--survivors]

Per module (`MODULES`: the file and the tests run against its mutants), in a copy of the
repository's tracked files (mutmut writes its `mutants/` beside the code; the copy keeps the
checkout clean and lets each module have its own settings): `mutmut run`, then `mutmut results
--all true`. Printed: one row per module, the mutants killed (a test failed, or the mutant hung
past mutmut's timeout), survived (the tests passed), not covered (no selected test runs the
function), listed as equivalent (`EQUIVALENT_FILE`: a mutant that cannot change what the code
does, one line each saying why, with the digest of its diff: a listed name that now means
another mutant, after an edit renumbered them, is judged by its status and reported stale) and
the score, killed over all but the equivalent ones. `--pin-equivalents` prints the listed
mutants of the modules beside their reasons, for review, and writes their digests.
`--survivors` prints each surviving or uncovered mutant's diff (`mutmut show`), and each one killed
by mutmut's timeout alone (on a loaded machine a mutant may only have been slow: judge those).
A module whose entry names functions (the third item of `MODULES`: `pipeline.plan`) has only
those functions' mutants made, run and counted (`mutmut run` takes their names as patterns).

mutmut is in the test extra (`pip install -e '.[test]'`).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EQUIVALENT_FILE = os.path.join(ROOT, "tests", "mutation_equivalent.txt")

# module -> (its file, the tests mutmut runs against its mutants[, the functions mutated]): with the
# third, only the mutants of those functions (mutmut's names for them: "x_name" for a function,
# "xǁClassǁmethod" for a method; fnmatch patterns) are made and counted
MODULES = {
    "service.status": ("service/status.py", ["tests/test_status_mapping.py"]),
    "costmodel": ("graphopt/costmodel.py", ["tests/test_costmodel.py"]),
    "costgraph": ("graphopt/costgraph.py", ["tests/test_costgraph.py", "tests/test_costmodel.py"]),
    "search.registry": ("graphopt/search/registry.py", ["tests/test_strategy_registry.py"]),
    "search.auto": ("graphopt/search/auto.py", ["tests/test_auto_rules.py"]),
    "rewrite": ("graphopt/rewrite.py", ["tests/test_rewrite_rules.py", "tests/test_rewrite.py"]),
    "builder.file_order": ("graphopt/builder/file_order.py",
                           ["tests/test_file_order_rules.py", "tests/test_file_order.py"]),
    "builder.optimizer": ("graphopt/builder/optimizer.py", ["tests/test_optimizer_step.py"]),
    "builder.rules": ("graphopt/builder/rules.py", ["tests/test_builder_rules.py"]),
    "delivery": ("graphopt/delivery.py", ["tests/test_delivery_rules.py"]),
    "verify": ("graphopt/verify.py", ["tests/test_verify_rules.py", "tests/test_verify.py", "tests/test_order_at_load.py"]),
    "runtime.profile": ("graphopt/runtime/profile.py",
                        ["tests/test_profile_rules.py",
                         "tests/test_runtime.py::test_the_kernel_events_read_are_the_last_runs_alone",
                         "tests/test_annotate.py::test_profile_events_read_one_line_at_a_time_equal_the_profile_read_whole"]),
    "reduced": ("graphopt/reduced.py", ["tests/test_reduced_rules.py", "tests/test_reduced.py", "-m", "not slow"]),
    # reduced's mutants in three parts, each function in one, each against the module's own tests
    # (the part rows add up to the module's)
    "reduced.tracking": ("graphopt/reduced.py", ["tests/test_reduced_rules.py", "tests/test_reduced.py", "-m", "not slow"],
                         ["x__forward", "x__backward", "x__contraction", "x__reduced_axes", "x__linear",
                          "x__ints_input", "x_track"]),
    "reduced.twin": ("graphopt/reduced.py", ["tests/test_reduced_rules.py", "tests/test_reduced.py", "-m", "not slow"],
                     ["x_batch_inputs", "x__scaled", "x_make_twin", "x__learn", "x__twin_once", "x_constants_rewritten",
                      "x__cut", "x__replace_constant", "x__producers", "x__check_inferred"]),
    "reduced.shapes": ("graphopt/reduced.py", ["tests/test_reduced_rules.py", "tests/test_reduced.py", "-m", "not slow"],
                       ["x__static", "x__inferred", "x__fold", "x_full_shapes", "x__graph_only", "x_extrapolate",
                        "x_scale_up", "x_full_size_annotations"]),
    "runtime.limit": ("graphopt/runtime/limit.py", ["tests/test_limit_rules.py"]),
    "runtime._limit_worker": ("graphopt/runtime/_limit_worker.py", ["tests/test_limit_rules.py"]),
    "annotate": ("graphopt/annotate.py",
                 ["tests/test_annotate_rules.py", "tests/test_annotate.py",
                  "tests/test_runtime.py::test_annotate_training_graph",
                  "tests/test_runtime.py::test_annotate_records_optimized_names_and_disabled_optimizers",
                  "tests/test_runtime.py::test_annotations_bad_json",
                  "-k", "not real_training_graphs"]),
    # the base-order and plan parts of the pipeline alone (its annotation, verification and
    # measuring parts run ONNX Runtime in children for seconds a mutant)
    "pipeline.plan": ("graphopt/pipeline.py",
                      ["tests/test_plan_rules.py",
                       "tests/test_base_order.py::test_the_least_peak_plan_is_the_best_over_every_base_order"],
                      ["x_base_order_graphs", "x_plan", "x_search_plan", "x__within_limit", "x__within_budget",
                       "x_options_budget_bytes", "x__best_over_orders", "x__remembered", "x_solver_exact",
                       "x_planned_order"]),
}
# what CI runs (tests/test_mutation.py): the cost model against its own step-by-step references
# and hand-worked small graphs alone (its whole selection), about two minutes on one core
FAST = {"costmodel": ("graphopt/costmodel.py", ["tests/test_costmodel.py"])}
# a mutant whose tests crashed (mutmut's "segfault": ONNX Runtime handed a None name) was noticed
KILLED = {"killed", "timeout", "segfault"}


def _copy_tracked(destination: str) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for relative in filter(None, files.decode().split("\0")):
        source = os.path.join(ROOT, relative)
        if not os.path.isfile(source):
            continue
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)


def _import_names() -> dict[str, str]:
    """folder -> import name, for the packages installed under another name than their folder's
    (pyproject's [tool.setuptools.package-dir]: service/ is `graphopt_service`)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_dirs = tomllib.load(f).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {folder: name for name, folder in package_dirs.items() if name and folder != name}


def _as_imported(folder: str, path: str) -> str:
    """Lay the copy out as the tests import it: each renamed package also under its import name
    (mutmut names a mutant after its file's path, and a mutant is only switched on in the module
    of that name: service/status.py must be mutated as graphopt_service/status.py). Returns the
    path to mutate in that layout."""
    renamed = _import_names()
    for source, name in renamed.items():
        if os.path.isdir(os.path.join(folder, source)):
            shutil.copytree(os.path.join(folder, source), os.path.join(folder, name))
    top, _, rest = path.partition("/")
    return f"{renamed[top]}/{rest}" if top in renamed else path


def _configure(folder: str, path: str, tests: list[str]) -> None:
    """The copy's pyproject with its [tool.mutmut] section for this module alone: the package of
    `path` is mutmut's source, every other package is copied beside it unchanged (so the tests
    import this copy's code, not the installed checkout's)."""
    pyproject = os.path.join(folder, "pyproject.toml")
    with open(pyproject) as f:
        text = f.read()
    head, _, rest = text.partition("[tool.mutmut]")
    tail = rest[rest.find("\n["):] if "\n[" in rest else ""
    source = path.split("/")[0]
    others = ["graphopt", *_import_names().values(), "benchmarks", "service", "clients", "proto", "zoo"]
    section = ("[tool.mutmut]\n"
               f"source_paths = {[source]!r}\n"
               f"only_mutate = {[path]!r}\n"
               f"pytest_add_cli_args_test_selection = {tests!r}\n"
               f"also_copy = {[p for p in others if p != source]!r}\n"
               # a mutant that loops is stopped at 3x its tests' time (mutmut's default: 15x)
               "timeout_multiplier = 3.0\n").replace("'", '"')
    with open(pyproject, "w") as f:
        f.write(head.rstrip() + "\n\n" + section + tail)


def equivalent_mutants() -> dict[str, tuple[str, str]]:
    """name -> (digest, why), from EQUIVALENT_FILE (``name [digest]  # why`` per line; the
    digest is that of the mutant's diff when it was judged, `mutant_digest`)."""
    found = {}
    if os.path.exists(EQUIVALENT_FILE):
        with open(EQUIVALENT_FILE) as f:
            for line in f:
                head, _, why = line.partition("#")
                name, _, digest = head.strip().partition(" ")
                if name:
                    found[name] = (digest.strip().strip("[]"), why.strip())
    return found


def mutant_diff(folder: str, env: dict, mutant: str) -> list[str]:
    """The lines a mutant removes and adds (`mutmut show`), stripped."""
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=folder, env=env,
                           capture_output=True, text=True).stdout
    return [line[0] + line[1:].strip() for line in shown.splitlines()
            if line[:1] in "+-" and not line.startswith(("---", "+++"))]


def mutant_digest(diff: list[str]) -> str:
    """What an equivalent mutant's line in EQUIVALENT_FILE pins: mutmut numbers a function's
    mutants in order, so an edit of the function gives its numbers to other mutants; a listed
    name whose diff no longer has this digest is not counted as equivalent ("stale")."""
    return hashlib.sha256("\n".join(diff).encode()).hexdigest()[:10]


def _patterns(mutated: str, functions: list[str]) -> list[str]:
    """mutmut's names of the mutants of `functions` (fnmatch patterns) in the file `mutated`."""
    prefix = mutated[:-len(".py")].replace("/", ".") + "."
    return [f"{prefix}{function}__mutmut_*" for function in functions]


def run_module(name: str, children: int, survivors: bool, modules: dict = MODULES) -> Counter:
    path, tests, *restricted = modules[name]
    with tempfile.TemporaryDirectory(prefix="graphopt-mutation-") as folder:
        _copy_tracked(folder)
        mutated = _as_imported(folder, path)
        _configure(folder, mutated, tests)
        patterns = _patterns(mutated, restricted[0]) if restricted else []
        env = dict(os.environ, PYTHONPATH=folder)
        done = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *patterns],
                              cwd=folder, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"mutmut run failed on {name} ({done.returncode})")
        listed = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=folder, env=env,
                                capture_output=True, text=True, check=True).stdout
        equivalent = equivalent_mutants()
        counts: Counter = Counter()
        left = []
        for line in listed.splitlines():
            mutant, _, status = line.strip().rpartition(": ")
            if not mutant or (patterns and not any(fnmatch.fnmatch(mutant, p) for p in patterns)):
                continue
            if mutant in equivalent:
                diff = mutant_diff(folder, env, mutant)
                if mutant_digest(diff) == equivalent[mutant][0]:
                    counts["equivalent"] += 1
                    continue
                # listed, but the mutant of that name is another one now: judged by its status
                counts["stale equivalent"] += 1
                print(f"stale in {os.path.basename(EQUIVALENT_FILE)}: {mutant} ({status}) is now "
                      f"{' | '.join(diff)}", file=sys.stderr, flush=True)
            if status in KILLED:
                counts["killed"] += 1
                if status == "timeout":     # killed, but on a busy machine perhaps only slow: shown
                    counts["timeout"] += 1
                    left.append(mutant)
            elif status == "no tests":
                counts["not covered"] += 1
                left.append(mutant)
            else:
                counts["survived"] += 1
                left.append(mutant)
        if survivors:
            for mutant in left:
                shown = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=folder, env=env,
                                       capture_output=True, text=True).stdout
                print(shown, flush=True)
        return counts


def pin_equivalents(name: str) -> None:
    """Print each mutant EQUIVALENT_FILE lists for module `name` beside why it is listed, and
    write its digest into its line (review what is printed: a name that now means another
    mutant must be judged again, not pinned)."""
    path, tests, *_ = MODULES[name]
    with tempfile.TemporaryDirectory(prefix="graphopt-mutation-") as folder:
        _copy_tracked(folder)
        mutated = _as_imported(folder, path)
        _configure(folder, mutated, tests)
        env = dict(os.environ, PYTHONPATH=folder)
        prefix = mutated[:-len(".py")].replace("/", ".") + "."
        listed = [n for n in equivalent_mutants() if n.startswith(prefix)]
        if not listed:
            return
        # mutmut writes every mutant of the module before it runs the first one named
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", listed[0]], cwd=folder, env=env,
                       capture_output=True)
        digests = {}
        for mutant in listed:
            diff = mutant_diff(folder, env, mutant)
            digests[mutant] = mutant_digest(diff)
            print(f"{mutant}: {' | '.join(diff) or 'NO SUCH MUTANT'}\n    listed because: "
                  f"{equivalent_mutants()[mutant][1]}")
    with open(EQUIVALENT_FILE) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head, hash_mark, why = line.partition("#")
        mutant = head.strip().split(" ")[0]
        if mutant in digests and not line.startswith("#"):
            lines[i] = f"{mutant} [{digests[mutant]}]  #{why}"
    with open(EQUIVALENT_FILE, "w") as f:
        f.write("\n".join(lines) + "\n")


def score(counts: Counter) -> float:
    judged = counts["killed"] + counts["survived"] + counts["not covered"]
    return counts["killed"] / judged if judged else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--survivors", action="store_true")
    ap.add_argument("--pin-equivalents", action="store_true",
                    help="print the modules' listed equivalent mutants and pin their digests (no run)")
    args = ap.parse_args()
    names = [n for n in args.modules.split(",") if n]
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        raise SystemExit(f"unknown modules {unknown} (known: {', '.join(MODULES)})")
    if args.pin_equivalents:
        for name in names:
            pin_equivalents(name)
        return
    rows = []
    for name in names:
        counts = run_module(name, args.children, args.survivors)
        rows.append((name, counts))
        print(f"{name}: {dict(counts)} score {score(counts):.1%}", file=sys.stderr, flush=True)
    print("| module | file | killed (timed out) | survived | not covered | equivalent | score |")
    print("|---|---|---|---|---|---|---|")
    for name, c in rows:
        print(f"| {name} | {MODULES[name][0]} | {c['killed']} ({c['timeout']}) | {c['survived']} | "
              f"{c['not covered']} | {c['equivalent']} | {score(c):.1%} |")


if __name__ == "__main__":
    main()
