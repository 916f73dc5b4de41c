"""One options schema: `OptimizeOptions`' field metadata (graphopt/options.py) is the single source
of the CLI's flags, the proto's OptimizeOptions message, the server's and the Python client's
mappings, and the Node client's (from the proto's descriptor).

Checked here against oracles that are not the schema itself: the wire contract as released (field
numbers and types frozen below), the values an example started with after a round trip through
the real proto encoding, the Python CLI's parser and the Node client's mapping and parser, and a
throwaway field added to a copy of the repository that must reach a real server's OptimizeOptions
from the real CLI, the real Python client and the real Node CLI.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from graphopt.options import OptimizeOptions, flag_name, option_specs
from graphopt_service import gen_proto
from graphopt_service._proto import graphopt_pb2 as pb
from graphopt_service.client import make_options
from graphopt_service.server import job_options

REPO = Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "clients" / "node"
FD = pb.OptimizeOptions.DESCRIPTOR.fields[0].__class__   # google.protobuf.descriptor.FieldDescriptor

# The wire contract as released before the schema was generated (proto/graphopt/v1/graphopt.proto
# at 3398cdd): name -> (number, type, repeated, presence). A field's number never changes.
RELEASED = {
    "budget_bytes": (1, FD.TYPE_INT64, False, True), "strategy": (2, FD.TYPE_STRING, False, False),
    "input_dims": (3, FD.TYPE_MESSAGE, True, False), "loss": (7, FD.TYPE_STRING, False, False),
    "threads": (8, FD.TYPE_INT32, False, False), "response_chunk_bytes": (9, FD.TYPE_INT64, False, False),
    "plan": (10, FD.TYPE_BOOL, False, False), "providers": (11, FD.TYPE_STRING, True, False),
    "verify": (12, FD.TYPE_BOOL, False, True), "measure": (13, FD.TYPE_BOOL, False, True),
    "tolerance": (14, FD.TYPE_DOUBLE, False, True), "objective": (15, FD.TYPE_STRING, False, True),
    "max_overhead": (16, FD.TYPE_DOUBLE, False, True), "graph_optimizations": (17, FD.TYPE_STRING, False, True),
    "memory_limit_bytes": (18, FD.TYPE_INT64, False, True),
}
RETIRED_NUMBERS = {4, 5, 6}


def node_exe() -> str:
    exe = shutil.which("node")
    if exe is None:
        pytest.fail("node is not installed: the Node.js client needs Node.js >= 18 (CI installs it)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run `npm ci --prefix clients/node`")
    return exe


# --- the proto ---------------------------------------------------------------------------

def test_the_committed_proto_and_stubs_are_the_generators_output():
    """The OptimizeOptions message and the stubs are what `python -m graphopt_service.gen_proto`
    makes of graphopt/options.py now: an option added without regenerating fails here."""
    stale = [name for name, text in gen_proto.generate().items()
             if not gen_proto._path(name).is_file() or gen_proto._path(name).read_text() != text]
    assert not stale, f"stale: {stale}; run python -m graphopt_service.gen_proto"


def test_released_field_numbers_and_types_never_change():
    fields = pb.OptimizeOptions.DESCRIPTOR.fields_by_name
    for name, (number, type_, repeated, presence) in RELEASED.items():
        field = fields[name]
        assert (field.number, field.type, field.is_repeated, field.has_presence) == \
               (number, type_, repeated, presence), name
    assert not RETIRED_NUMBERS & {f.number for f in pb.OptimizeOptions.DESCRIPTOR.fields}
    assert "InputDims" in fields["input_dims"].message_type.full_name


def test_every_option_is_a_proto_field_and_every_proto_field_an_option():
    specs = {s.name: s for s in option_specs() if s.proto is not None}
    service_own = {name for _, name, _, _ in gen_proto.SERVICE_FIELDS}
    by_name = pb.OptimizeOptions.DESCRIPTOR.fields_by_name
    assert set(by_name) == set(specs) | service_own
    for name, spec in specs.items():
        assert by_name[name].number == spec.proto, name
    # what does not travel: the arrays (a server synthesizes inputs) and the callback
    assert {s.name for s in option_specs() if s.proto is None} == {"inputs", "progress"}


def test_a_field_without_help_or_with_a_taken_number_is_refused(tmp_path):
    from dataclasses import field, make_dataclass

    from graphopt.options import option
    bare = make_dataclass("Bare", [("x", int, field(default=0))])
    with pytest.raises(TypeError, match="Bare.x has no help"):
        option_specs(bare)
    taken = make_dataclass("Taken", [("a", int, option(0, proto=1, help="a")),
                                     ("b", int, option(0, proto=1, help="b"))])
    with pytest.raises(ValueError, match="b and a both have proto number 1"):
        gen_proto.options_message(option_specs(taken))
    retired = make_dataclass("Retired", [("a", int, option(0, proto=5, help="a"))])
    with pytest.raises(ValueError, match="reserved"):
        gen_proto.options_message(option_specs(retired))


# --- random options through every mapping ------------------------------------------------

NAME = st.text(st.characters(whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters="_./:"), min_size=1,
               max_size=12)
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12).filter(
    lambda s: s == s.strip())   # flag values keep their spaces; graphopt's --input-dims strips names only
JS_SAFE = 2 ** 53 - 1


def value_strategy(spec):
    """Random values of one option, from its kind (so a new option is covered as it is added)."""
    if spec.choices is not None:
        values = st.sampled_from(list(spec.choices()))
    elif spec.kind == "int":
        values = st.integers(1, 2 ** 31 - 1) if spec.proto_type == "int32" else st.integers(0, JS_SAFE)
    elif spec.kind == "float":
        values = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)
    elif spec.kind == "str":
        values = TEXT
    elif spec.kind == "bool":
        values = st.booleans()
    elif spec.kind == "list[str]":
        values = st.lists(TEXT, min_size=1, max_size=3)
    elif spec.kind == "dict[str, list[int]]":
        values = st.dictionaries(NAME, st.lists(st.integers(0, 2 ** 40), max_size=4), max_size=3)
    else:
        raise AssertionError(f"no random values for {spec.name}: {spec.kind}")
    return st.one_of(st.none(), values) if spec.default is None else values


OPTIONS = st.fixed_dictionaries({s.name: value_strategy(s) for s in option_specs() if s.proto is not None})


def travelling(options: OptimizeOptions) -> dict:
    return {s.name: getattr(options, s.name) for s in option_specs() if s.proto is not None}


def server_side(message_bytes: bytes) -> OptimizeOptions:
    """What a server makes of an encoded OptimizeOptions: job_options, then the worker's from_dict."""
    library, _ = job_options(pb.OptimizeOptions.FromString(message_bytes), max_threads=2 ** 31 - 1)
    return OptimizeOptions.from_dict(library)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(OPTIONS)
def test_random_options_round_trip_through_the_proto(values):
    options = OptimizeOptions(**values)
    back = server_side(make_options(options).SerializeToString())
    assert travelling(back) == travelling(options)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(OPTIONS)
def test_random_options_round_trip_through_the_cli_flags(values):
    from graphopt.cli import build_parser, options_from_args
    from graphopt.options import option_args
    options = OptimizeOptions(**values)
    argv = ["optimize", "m.onnx", "-o", "o.onnx", "--server", "127.0.0.1:1", *option_args(options)]
    back = options_from_args(build_parser().parse_args(argv))
    assert travelling(back) == travelling(options), argv


def js_options(options: OptimizeOptions) -> dict:
    """The Node client's options object of `options`: camelCase keys; int64 as decimal strings
    (the lossless form); everything given, defaults too."""
    specs = {s.name: s for s in option_specs() if s.proto is not None}
    out = {}
    for name, value in travelling(options).items():
        if value is None:
            continue
        if specs[name].kind == "int" and specs[name].proto_type == "int64":
            value = str(value)
        out[name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])] = value
    return out


NODE_SCRIPT = r"""
const { toProtoOptions, loadPackage, DEFAULT_PROTO_PATH } = require('./src/client');
const { parseCommandLine } = require('./bin/graphopt-node');
const Optimize = loadPackage(DEFAULT_PROTO_PATH).graphopt.v1.Graphopt.service.Optimize;
const encode = (options) => Optimize.requestSerialize({ options: toProtoOptions(options) }).toString('base64');
const out = [];
for (const line of require('fs').readFileSync(0, 'utf8').split('\n').filter(Boolean)) {
  const { options, argv } = JSON.parse(line);
  const parsed = parseCommandLine(['optimize', 'm.onnx', '-o', 'o.onnx', '--server', 'h:1', ...argv]);
  out.push({ library: encode(options), cli: encode(parsed.options) });
}
process.stdout.write(JSON.stringify(out));
"""


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(OPTIONS, min_size=40, max_size=40))
# found by a random run: graphopt-node kept --input-dims in a plain object, where "__proto__"
# set the prototype instead of an input
@example([{"input_dims": {"__proto__": [2, 3], "constructor": [], "toString": [1]}}])
def test_random_options_round_trip_through_the_node_client(batch):
    """Each example through the Node client's mapping (toProtoOptions over the proto's
    descriptor) and through its command line (graphopt-node's flags, given the flags graphopt's
    CLI writes), encoded by Node, decoded by the server's mapping: the values it started with.
    One node process per batch of examples."""
    from graphopt.options import option_args
    examples = [OptimizeOptions(**values) for values in batch]
    lines = "".join(json.dumps({"options": js_options(o), "argv": option_args(o)}) + "\n" for o in examples)
    done = subprocess.run([node_exe(), "-e", NODE_SCRIPT], input=lines, capture_output=True, text=True,
                          cwd=NODE_DIR, timeout=120)
    assert done.returncode == 0, done.stderr
    for options, encoded in zip(examples, json.loads(done.stdout), strict=True):
        request = pb.OptimizeRequest.FromString(base64.b64decode(encoded["library"]))
        assert travelling(server_side(request.options.SerializeToString())) == travelling(options)
        request = pb.OptimizeRequest.FromString(base64.b64decode(encoded["cli"]))
        assert travelling(server_side(request.options.SerializeToString())) == travelling(options), \
            option_args(options)


def test_both_command_lines_name_each_option_alike():
    """graphopt's flag of every option that travels is one of graphopt-node's (same rule, from the
    proto's names), and the Node CLI has no option flag graphopt's lacks."""
    script = ("const { optionFields } = require('./src/client');"
              "const { optionFlags } = require('./bin/graphopt-node');"
              "process.stdout.write(JSON.stringify(optionFlags(optionFields()).map((f) => f.flag)));")
    done = subprocess.run([node_exe(), "-e", script], capture_output=True, text=True, cwd=NODE_DIR, timeout=60)
    assert done.returncode == 0, done.stderr
    node_flags = {"--" + f for f in json.loads(done.stdout)}
    python_flags = {s.flag for s in option_specs() if s.proto is not None}
    assert python_flags <= node_flags, python_flags - node_flags
    # Node offers each bool both ways; without those, the same flags
    bools = {s.name for s in option_specs() if s.kind == "bool"}
    assert {f for f in node_flags if f.lstrip("-").removeprefix("no-").replace("-", "_") not in bools} == \
           {s.flag for s in option_specs() if s.proto is not None and s.kind != "bool"}
    assert flag_name("budget_bytes", "int", None) == "--budget" and flag_name("verify", "bool", True) == "--no-verify"


# --- a throwaway field, end to end -------------------------------------------------------

THROWAWAY = '''    throwaway_bytes: int | None = option(None, proto=20, help="a throwaway option of the tests")
    throwaway_note: str = option("", proto=21, help="another: a string")
'''


def test_a_new_field_reaches_the_server_from_the_cli_the_python_client_and_the_node_client(tmp_path, monkeypatch):
    """A copy of the repository gets two fields in graphopt/options.py and nothing else, then
    the one regenerate command; a real server of that copy on a loopback port sees their values
    in its OptimizeOptions (logged with each call) from `graphopt analyze --server`, from
    `Client.analyze` and from `graphopt-node analyze`."""
    from graphopt.examples import training_example
    from graphopt.optimize import save_model
    from service_process import ServerProcess
    node = node_exe()
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "graphopt", copy / "graphopt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "service", copy / "graphopt_service", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "proto", copy / "proto")
    (copy / "clients/node").mkdir(parents=True)
    for part in ("src", "bin", "proto", "package.json"):
        (shutil.copytree if (NODE_DIR / part).is_dir() else shutil.copy)(NODE_DIR / part, copy / "clients/node" / part)
    (copy / "clients/node/node_modules").symlink_to(NODE_DIR / "node_modules")
    options_py = copy / "graphopt" / "options.py"
    text = options_py.read_text()
    anchor = "    progress: Progress | None = option("
    assert text.count(anchor) == 1
    options_py.write_text(text.replace(anchor, THROWAWAY + anchor))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GRAPHOPT_")}, "PYTHONPATH": str(copy)}
    regenerate = subprocess.run([sys.executable, "-m", "graphopt_service.gen_proto"], cwd=copy, env=env,
                                capture_output=True, text=True, timeout=300)
    assert regenerate.returncode == 0, regenerate.stderr
    assert "optional int64 throwaway_bytes = 20;" in (copy / "proto/graphopt/v1/graphopt.proto").read_text()

    model, _ = training_example("mlp", small=True)
    save_model(model, tmp_path / "mlp.onnx")
    monkeypatch.chdir(copy)   # `python -m` puts the working directory first on the path: the copy's
    server = ServerProcess(tmp_path / "server", "--workers", "1", env=env)
    try:
        cli = subprocess.run([sys.executable, "-m", "graphopt.cli", "analyze", str(tmp_path / "mlp.onnx"),
                              "--server", server.target, "--throwaway", "3KiB", "--throwaway-note", "from the CLI"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stderr
        client = subprocess.run([sys.executable, "-c", (
            "import sys; from graphopt_service.client import Client\n"
            "with Client(sys.argv[1]) as c: c.analyze(sys.argv[2], throwaway_bytes=5, throwaway_note='from Python')")
            , server.target, str(tmp_path / "mlp.onnx")], env=env, capture_output=True, text=True, timeout=300)
        assert client.returncode == 0, client.stderr
        nodejs = subprocess.run([node, str(copy / "clients/node/bin/graphopt-node.js"), "analyze",
                                 str(tmp_path / "mlp.onnx"), "--server", server.target, "--throwaway", "7MiB",
                                 "--throwaway-note", "from Node"], env=env, capture_output=True, text=True, timeout=300)
        assert nodejs.returncode == 0, nodejs.stderr
        calls = server.wait_for_logs("call finished", 3, method="Analyze", status="OK")
    finally:
        server.kill()
    seen = sorted((c["options"]["throwaway_bytes"], c["options"]["throwaway_note"]) for c in calls)
    assert seen == [(5, "from Python"), (3 << 10, "from the CLI"), (7 << 20, "from Node")]
    # and the repository itself has no such option: the copy's one field made the difference
    plain = subprocess.run([sys.executable, "-m", "graphopt.cli", "analyze", "m.onnx", "--throwaway", "1"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "--throwaway" in plain.stderr


# --- the batch's options -----------------------------------------------------------------

def test_batch_options_hold_optimize_options_and_keep_the_job_keys_of_earlier_batches():
    """BatchOptions' fingerprint (part of each job's key) is what the batch wrote before it held an
    OptimizeOptions (strings from that code, 3398cdd), so a rerun finds its jobs done; an option
    beyond those changes the key only when set."""
    from graphopt.batch import BatchOptions
    assert BatchOptions().fingerprint() == (
        '{"budget_fraction": null, "graph_optimizations": null, "loss": "cross_entropy", "max_overhead": null, '
        '"measure": true, "memory_limit_bytes": null, "objective": null, "strategy": null, "sweep": null}')
    assert BatchOptions(loss="mse", budget_fraction=0.5, sweep=3, optimize=OptimizeOptions(
        strategy="chen-sqrt", memory_limit_bytes=5, graph_optimizations="none", objective="least-peak",
        measure=False)).fingerprint() == (
        '{"budget_fraction": 0.5, "graph_optimizations": "none", "loss": "mse", "max_overhead": null, '
        '"measure": false, "memory_limit_bytes": 5, "objective": "least-peak", "strategy": "chen-sqrt", "sweep": 3}')
    assert BatchOptions(optimize=OptimizeOptions(tolerance=1e-3)).fingerprint() != BatchOptions().fingerprint()
    with pytest.raises(Exception, match="budget_fraction"):
        BatchOptions(optimize=OptimizeOptions(budget_bytes=1 << 20)).check()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.fixed_dictionaries({s.name: value_strategy(s) for s in option_specs() if s.proto is not None and s.batch}),
       st.sampled_from(["mse", "cross_entropy", "output:loss"]))
def test_batch_flags_give_each_models_options_and_the_batchs_own_loss(values, loss):
    """`graphopt batch`'s --loss is the forward models' training loss, not OptimizeOptions.loss; the
    option flags it shares with optimize give each model's options."""
    from graphopt.cli import batch_options_from_args, build_parser
    from graphopt.options import option_args
    options = OptimizeOptions(**values)
    args = build_parser().parse_args(["batch", "zoo", "-o", "out", "--loss", loss, *option_args(options)])
    batch = batch_options_from_args(args)
    assert batch.loss == loss and batch.optimize.loss is None
    assert travelling(batch.optimize) == travelling(options)
