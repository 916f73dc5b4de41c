"""The Node.js client (clients/node) against a real graphopt server.

A server (`python -m graphopt.cli serve --port 0`) runs as a subprocess on loopback; the
Node CLI (`node clients/node/bin/graphopt-node.js`) must optimize a training graph into the
same graph as the in-process library call, upload external data, list the strategies, report
health, and turn a server error into `error: INVALID_ARGUMENT: ...` with a non-zero exit.
A second server with TLS and a bearer token checks both.

Node.js >= 18 and clients/node/node_modules are required: a missing `node` FAILS these
tests (CI installs it); missing node_modules are installed with `npm ci --prefix clients/node`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.external_data_helper import (_get_all_tensors, convert_model_to_external_data, set_external_data,
                                       uses_external_data)

from graphopt.examples import training_example
from graphopt.optimize import OptimizeOptions, optimize
from graphopt.report import Report, summary_text
from graphopt.search import DEFAULT_STRATEGY, STRATEGIES

REPO = Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "clients" / "node"
CLI = NODE_DIR / "bin" / "graphopt-node.js"
SERVER_START_SECONDS = 60
CALL_SECONDS = 120


# --- node -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node() -> str:
    exe = shutil.which("node")
    if exe is None:
        pytest.fail("node is not installed: the Node.js client needs Node.js >= 18 (CI installs it)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 18:
        pytest.fail(f"node {version} is too old: clients/node needs Node.js >= 18")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("clients/node/node_modules is missing and npm is not installed to run "
                        "`npm ci --prefix clients/node`")
        done = subprocess.run([npm, "ci", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund"],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"npm ci --prefix clients/node failed:\n{done.stdout}\n{done.stderr}")
    return exe


def clean_env(**extra: str) -> dict:
    """This environment without GRAPHOPT_* settings (a token or port from the caller's shell
    would change what the server requires and what the client sends)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("GRAPHOPT_")}, **extra}


def run_cli(node: str, *args, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([node, str(CLI), *map(str, args)], capture_output=True, text=True,
                          timeout=CALL_SECONDS, env=clean_env(**(env or {})))
    if check and done.returncode != 0:
        pytest.fail(f"graphopt-node {' '.join(map(str, args))} exited {done.returncode}:\n"
                    f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return done


# --- the server ---------------------------------------------------------------------------

def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the workers live in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Server:
    def __init__(self, folder: Path, *extra: str):
        self.folder = folder
        self.stdout_path, self.stderr_path = folder / "server.out", folder / "server.err"
        work = folder / "work"
        work.mkdir()
        command = [sys.executable, "-m", "graphopt.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--workers", "2", "--work-dir", str(work), "--drain-seconds", "2", *extra]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         cwd=folder, start_new_session=True, env=clean_env())
        self.port = None

    def log(self) -> str:
        return (f"server stdout:\n{self.stdout_path.read_text(errors='replace')}\n"
                f"server stderr:\n{self.stderr_path.read_text(errors='replace')[-20000:]}")

    def wait_listening(self) -> int:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            for line in self.stdout_path.read_text(errors="replace").splitlines():
                if line.startswith("{") and "listening" in line:
                    self.port = int(json.loads(line)["listening"])
                    return self.port
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode} before listening\n{self.log()}")
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"the server did not listen within {SERVER_START_SECONDS} s\n{self.log()}")

    def wait_serving(self, node: str, *cli_args: str) -> None:
        """Health SERVING, asked with the Node CLI itself (within the start time)."""
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            done = run_cli(node, "health", "--server", f"127.0.0.1:{self.port}", "--deadline-seconds", "5",
                           *cli_args, check=False)
            if done.returncode == 0 and done.stdout.strip() == "SERVING":
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the server is not SERVING within {SERVER_START_SECONDS} s (last health: "
                            f"{done.returncode} {done.stdout!r} {done.stderr!r})\n{self.log()}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            below = _descendants(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # drain, stop the workers, exit
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *below]:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(node, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("node-client-server"))
    try:
        srv.wait_listening()
        srv.wait_serving(node)
        yield f"127.0.0.1:{srv.port}"
    finally:
        srv.stop()


# --- graphs -----------------------------------------------------------------------------

def graph_signature(model: onnx.ModelProto):
    """Nodes in order (op_type, domain, inputs, outputs, attributes) and initializers (name,
    type, dims, bytes). Metadata (measured times) may differ."""
    nodes = [(n.op_type, n.domain, list(n.input), list(n.output),
              [a.SerializeToString(deterministic=True) for a in n.attribute]) for n in model.graph.node]
    inits = [(t.name, t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes())
             for t in model.graph.initializer]
    return nodes, inits


def assert_same_graph(got: onnx.ModelProto, want: onnx.ModelProto) -> None:
    got_nodes, got_inits = graph_signature(got)
    want_nodes, want_inits = graph_signature(want)
    assert len(got_nodes) == len(want_nodes), (len(got_nodes), len(want_nodes))
    for i, (g, w) in enumerate(zip(got_nodes, want_nodes)):
        assert g == w, f"node {i} differs: {g[:4]} vs {w[:4]}"
    assert [t[:3] for t in got_inits] == [t[:3] for t in want_inits]
    for g, w in zip(got_inits, want_inits):
        assert g[3] == w[3], f"initializer {g[0]!r} holds other bytes"
    assert [(i.name, i.type.SerializeToString()) for i in got.graph.input] == \
           [(i.name, i.type.SerializeToString()) for i in want.graph.input]
    assert [o.name for o in got.graph.output] == [o.name for o in want.graph.output]


def library_result(model: onnx.ModelProto) -> onnx.ModelProto:
    """What the library gives in-process: Feng & Huang (deterministic: it depends only on
    measured bytes), synthesized inputs as the server uses, no measuring."""
    options = OptimizeOptions(strategy="feng-huang", measure=False)
    assert options.inputs is None  # synthesized, as on the server
    return optimize(model, options).model


@pytest.fixture(scope="module")
def resnet():
    model, _ = training_example("resnet", small=True)
    return model


@pytest.fixture(scope="module")
def resnet_full():
    """The full-size resnet example: its optimize takes 10 s or more here, where the small one's
    took about 1 s with warm measuring processes (a 1 s deadline then raced the result)."""
    model, _ = training_example("resnet")
    return model


# --- tests ------------------------------------------------------------------------------

def test_node_unit_tests(node):
    done = subprocess.run([node, "--test", str(NODE_DIR / "test" / "unit.test.js")],
                          capture_output=True, text=True, timeout=CALL_SECONDS, cwd=NODE_DIR)
    assert done.returncode == 0, done.stdout + done.stderr


def test_health_and_strategies(node, server):
    done = run_cli(node, "health", "--server", server)
    assert done.stdout.strip() == "SERVING"
    done = run_cli(node, "health", "--server", server, "--service", "graphopt.v1.Graphopt")
    assert done.stdout.strip() == "SERVING"

    done = run_cli(node, "strategies", "--server", server)
    rows = [line.split(None, 1) for line in done.stdout.splitlines() if line.strip()]
    assert [name for name, _ in rows] == list(STRATEGIES)
    defaults = [name for name, rest in rows if rest.startswith("(default)")]
    assert defaults == [DEFAULT_STRATEGY]


def test_optimize_gives_the_library_graph(node, server, resnet, tmp_path):
    model_path = tmp_path / "in" / "resnet.onnx"
    model_path.parent.mkdir()
    onnx.save(resnet, str(model_path))
    out = tmp_path / "out" / "opt.onnx"
    report_path = tmp_path / "report.json"
    done = run_cli(node, "optimize", model_path, "-o", out, "--server", server, "--strategy", "feng-huang",
                   "--no-measure", "--report", report_path)

    # progress on stderr, the summary on stdout
    assert re.search(r"^\[ *\d+%\] plan$", done.stderr, re.M), done.stderr
    assert f"wrote {out}" in done.stdout
    assert "strategy feng-huang" in done.stdout
    report = json.loads(report_path.read_text())
    # the Node client prints graphopt's one summary (the server's Report.summary), not its own
    assert summary_text(Report.from_dict(report)) in done.stdout
    assert out.stat().st_size > 64 * 1024   # more than one response chunk below
    assert report["strategy"] == "feng-huang" and report["outputs_match"] is True
    assert "measured" not in report or not report["measured"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["opt.onnx"]  # no temporary files left

    got = onnx.load(str(out))
    want = library_result(resnet)
    assert report["recompute_nodes"] > 0
    assert_same_graph(got, want)

    # small messages both ways: 16 KiB upload chunks, response chunks under a 64 KiB limit
    small = tmp_path / "small" / "opt.onnx"
    run_cli(node, "optimize", model_path, "-o", small, "--server", server, "--strategy", "feng-huang",
            "--no-measure", "--chunk-bytes", "16KiB", "--max-message-bytes", "64KiB")
    assert_same_graph(onnx.load(str(small)), want)


def test_objective_and_max_overhead_reach_the_server(node, server, tmp_path):
    model, _ = training_example("mlp", small=True)
    model_path = tmp_path / "mlp.onnx"
    onnx.save(model, str(model_path))
    for flags, name, limit in ((["--max-overhead", "0.4"], "bounded-overhead", 0.4),
                               (["--objective", "least-peak"], "least-peak", None)):
        report_path = tmp_path / f"{name}.json"
        done = run_cli(node, "optimize", model_path, "-o", tmp_path / f"{name}.onnx", "--server", server,
                       "--no-measure", "--report", report_path, *flags)
        objective = json.loads(report_path.read_text())["objective"]
        assert (objective["name"], objective.get("max_overhead")) == (name, limit), objective
        assert f"objective {name}" in done.stdout
    # an unknown objective: the server's INVALID_ARGUMENT names it; nothing is written
    done = run_cli(node, "optimize", model_path, "-o", tmp_path / "no" / "opt.onnx", "--server", server,
                   "--objective", "fastest", "--no-measure", check=False)
    assert done.returncode == 2, done.stderr
    assert "error: INVALID_ARGUMENT: unknown objective 'fastest'" in done.stderr, done.stderr
    assert not (tmp_path / "no").exists()
    # the graph optimizations travel too: "none" plans the file as given; an unknown level is named
    report_path = tmp_path / "none.json"
    run_cli(node, "optimize", model_path, "-o", tmp_path / "none.onnx", "--server", server, "--no-measure",
            "--graph-optimizations", "none", "--report", report_path)
    assert json.loads(report_path.read_text())["graph_optimizations"] == {}
    done = run_cli(node, "optimize", model_path, "-o", tmp_path / "no" / "opt.onnx", "--server", server,
                   "--graph-optimizations", "all", "--no-measure", check=False)
    assert done.returncode == 2, done.stderr
    assert "error: INVALID_ARGUMENT: unknown graph optimizations 'all'" in done.stderr, done.stderr
    assert not (tmp_path / "no").exists()


def test_external_data_is_uploaded(node, server, tmp_path):
    model, _ = training_example("densenet", small=True)
    folder = tmp_path / "ext"
    folder.mkdir()
    model_path = folder / "model.onnx"
    onnx.save(model, str(model_path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    weights = folder / "weights.bin"
    assert weights.stat().st_size > 3 * 1024
    saved = onnx.load(str(model_path), load_external_data=False)
    assert sum(uses_external_data(t) for t in saved.graph.initializer) > 0

    out = tmp_path / "out" / "opt.onnx"
    # small chunks: several per file
    run_cli(node, "optimize", model_path, "-o", out, "--server", server, "--strategy", "feng-huang",
            "--no-measure", "--chunk-bytes", "1024")
    assert_same_graph(onnx.load(str(out)), library_result(onnx.load(str(model_path))))

    # without its weights the server cannot load it: the client refuses before sending
    weights.rename(folder / "elsewhere.bin")
    done = run_cli(node, "optimize", model_path, "-o", tmp_path / "out2" / "opt.onnx", "--server", server,
                   check=False)
    assert done.returncode == 1
    assert 'external data file "weights.bin" does not exist' in done.stderr
    assert not (tmp_path / "out2").exists()


def test_external_data_files_match_onnx(node, server, tmp_path):
    """The partial ONNX schema finds the files onnx itself would load (several files, a subfolder,
    a tensor attribute), each once, and they all reach the server; escaping and absolute
    locations are refused."""
    model, _ = training_example("mlp", small=True)
    folder = tmp_path / "m"
    (folder / "sub").mkdir(parents=True)
    # one file per tensor, a Constant node's tensor attribute among them, and two
    # initializers sharing a file in a subfolder
    many = onnx.ModelProto()
    many.CopyFrom(model)
    many.graph.node.insert(0, onnx.helper.make_node(
        "Constant", [], ["extra_const"], name="extra_const_node",
        value=numpy_helper.from_array(np.arange(64, dtype=np.float32), "extra_const")))
    convert_model_to_external_data(many, all_tensors_to_one_file=False, size_threshold=0, convert_attribute=True)
    for tensor in list(many.graph.initializer)[:2]:
        set_external_data(tensor, "sub/pair.bin")
    onnx.save(many, str(folder / "model.onnx"))
    want = []
    check = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in _get_all_tensors(check):
        if uses_external_data(tensor):
            location = next(e.value for e in tensor.external_data if e.key == "location")
            if location not in want:
                want.append(location)
    assert any(n.op_type == "Constant" and uses_external_data(a.t) for n in check.graph.node for a in n.attribute)

    script = ("const {externalDataFiles} = require(%s);"
              "console.log(JSON.stringify(externalDataFiles(process.argv[1]).map(f => f.path)))"
              % json.dumps(str(NODE_DIR / "src" / "onnx_refs.js")))
    done = subprocess.run([node, "-e", script, str(folder / "model.onnx")], capture_output=True, text=True,
                          timeout=CALL_SECONDS)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == want
    run_cli(node, "optimize", folder / "model.onnx", "-o", tmp_path / "many" / "opt.onnx", "--server", server,
            "--strategy", "feng-huang", "--no-measure")
    assert_same_graph(onnx.load(str(tmp_path / "many" / "opt.onnx")),
                      library_result(onnx.load(str(folder / "model.onnx"))))

    # one file for all, written in a subfolder
    onnx.save(model, str(folder / "one.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="sub/w.bin", size_threshold=0)
    done = subprocess.run([node, "-e", script, str(folder / "one.onnx")], capture_output=True, text=True,
                          timeout=CALL_SECONDS)
    assert json.loads(done.stdout) == ["sub/w.bin"]

    for bad, message in (("../w.bin", "points outside the model's folder"), ("/tmp/w.bin", "is absolute")):
        escaping = onnx.load(str(folder / "one.onnx"), load_external_data=False)
        for tensor in escaping.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = bad
        onnx.save(escaping, str(folder / "bad.onnx"))
        done = run_cli(node, "optimize", folder / "bad.onnx", "-o", tmp_path / "o.onnx",
                       "--server", "127.0.0.1:1", check=False)
        assert done.returncode == 1, done.stderr
        assert message in done.stderr and bad in done.stderr


def test_analyze(node, server, resnet, tmp_path):
    model_path = tmp_path / "resnet.onnx"
    onnx.save(resnet, str(model_path))
    done = run_cli(node, "analyze", model_path, "--server", server, "--plan", "--strategy", "feng-huang")
    analysis = json.loads(done.stdout)
    # the graph analyzed is the one planned: the file after ORT's graph optimizations (when applied)
    applied = analysis["full"]["graph_optimizations"]
    assert analysis["nodes"] == len(resnet.graph.node) + sum(applied.get("op_types", {}).values())
    assert analysis["forward_nodes"] + analysis["backward_nodes"] == analysis["nodes"]
    assert int(analysis["predicted_peak_bytes_planned"]) <= int(analysis["predicted_peak_bytes_original"])
    assert analysis["full"]["plan"]["strategy"] == "feng-huang"
    assert not any(key.startswith("_") for key in analysis)
    # where the peak falls: the data in the analysis, the lines (graphopt's renderer) printed
    explained = analysis["full"]["peaks_explained"]
    assert explained["original"]["peak_bytes"] == int(analysis["predicted_peak_bytes_original"])
    assert explained["returned"]["peak_bytes"] == int(analysis["predicted_peak_bytes_planned"])
    assert analysis["peak_summary"] in done.stderr
    assert f"original: predicted peak" in done.stderr and "least peak the search can reach" in done.stderr


def test_not_onnx_is_invalid_argument(node, server, tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not an ONNX model\n")
    out = tmp_path / "out" / "opt.onnx"
    done = run_cli(node, "optimize", bad, "-o", out, "--server", server, check=False)
    assert done.returncode == 2, done.stderr
    assert re.search(r"^error: INVALID_ARGUMENT: .+", done.stderr, re.M), done.stderr
    assert not out.exists() and not out.parent.exists()

    done = run_cli(node, "optimize", tmp_path / "missing.onnx", "-o", out, "--server", server, check=False)
    assert done.returncode == 1 and "does not exist" in done.stderr

    done = run_cli(node, "optimize", bad, "--server", server, check=False)   # usage: no -o
    assert done.returncode == 1 and "-o OUT" in done.stderr


def test_impossible_budget_is_failed_precondition(node, server, resnet, tmp_path):
    model_path = tmp_path / "resnet.onnx"
    onnx.save(resnet, str(model_path))
    out = tmp_path / "opt.onnx"
    # a strategy that plans for budgets (feng-huang takes none: the registry refuses it, INVALID_ARGUMENT)
    done = run_cli(node, "optimize", model_path, "-o", out, "--server", server, "--budget", "100",
                   "--strategy", "chen-greedy", "--no-measure", check=False)
    assert done.returncode == 2, done.stderr
    assert "error: FAILED_PRECONDITION: budget of 100 bytes cannot be met" in done.stderr
    least = re.search(r"the least feasible peak is (\d+) bytes", done.stderr)
    assert least and int(least.group(1)) > 100, done.stderr
    assert not out.exists()


def test_deadline_exceeded(node, server, resnet_full, tmp_path):
    """Measuring takes seconds: a 1 s deadline ends the call, and nothing is written."""
    model_path = tmp_path / "resnet.onnx"
    onnx.save(resnet_full, str(model_path))
    out = tmp_path / "out" / "opt.onnx"
    started = time.monotonic()
    done = run_cli(node, "optimize", model_path, "-o", out, "--server", server, "--deadline-seconds", "1",
                   check=False)
    assert done.returncode == 2, done.stderr
    assert "error: DEADLINE_EXCEEDED: " in done.stderr
    assert time.monotonic() - started < 30
    assert not out.parent.exists()
    # the server stopped that work and serves the next call
    done = run_cli(node, "strategies", "--server", server)
    assert done.stdout.split()[0] == list(STRATEGIES)[0]


def test_interrupt_cancels(node, server, resnet, tmp_path):
    """SIGINT during a call: exit 130, the call cancelled, nothing written."""
    model_path = tmp_path / "resnet.onnx"
    onnx.save(resnet, str(model_path))
    out = tmp_path / "out" / "opt.onnx"
    proc = subprocess.Popen([node, str(CLI), "optimize", str(model_path), "-o", str(out), "--server", server],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        seen = []
        for line in proc.stderr:           # measuring (last) takes seconds: interrupt once planning
            seen.append(line)
            if "] plan" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=CALL_SECONDS)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(seen) + rest
    assert "error: CANCELLED: interrupted by SIGINT" in rest
    assert not out.parent.exists()


# --- TLS and a bearer token -------------------------------------------------------------

def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (trustme, in the test extra)."""
    import trustme
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.cert_chain_pems[0].write_to_path(str(paths[1]))
    cert.private_key_pem.write_to_path(str(paths[2]))
    return paths


def test_tls_and_token(node, tmp_path):
    ca, cert, key = _certificates(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    srv = Server(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file))
    try:
        srv.wait_listening()
        srv.wait_serving(node, "--tls-ca", str(ca))   # health needs no token
        target = f"127.0.0.1:{srv.port}"

        done = run_cli(node, "strategies", "--server", target, "--tls-ca", ca, "--token", "s3cret-token")
        assert done.stdout.split()[0] == list(STRATEGIES)[0]
        assert "DEP0123" not in done.stderr
        done = run_cli(node, "strategies", "--server", target, "--tls-ca", ca, "--token-file", token_file)
        assert done.returncode == 0
        done = run_cli(node, "strategies", "--server", target, "--tls-ca", ca, env={"GRAPHOPT_TOKEN": "s3cret-token"})
        assert done.returncode == 0
        done = run_cli(node, "strategies", "--server", target, "--tls-ca", ca, check=False)
        assert done.returncode == 2 and "error: UNAUTHENTICATED: " in done.stderr, done.stderr
        done = run_cli(node, "strategies", "--server", target, "--tls-ca", ca, "--token", "wrong", check=False)
        assert done.returncode == 2 and "error: UNAUTHENTICATED: " in done.stderr, done.stderr
        # plaintext to a TLS server does not get through
        done = run_cli(node, "health", "--server", target, "--deadline-seconds", "5", check=False)
        assert done.returncode == 2 and done.stdout.strip() != "SERVING"

        model, _ = training_example("mlp", small=True)
        onnx.save(model, str(tmp_path / "mlp.onnx"))
        run_cli(node, "optimize", tmp_path / "mlp.onnx", "-o", tmp_path / "opt.onnx", "--server", target,
                "--tls-ca", ca, "--token", "s3cret-token", "--strategy", "feng-huang", "--no-measure",
                "--deadline-seconds", "100")
        assert_same_graph(onnx.load(str(tmp_path / "opt.onnx")), library_result(model))
    finally:
        srv.stop()
