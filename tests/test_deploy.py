"""The Kubernetes manifests in deploy/, checked without a cluster.

No cluster (and no network) is where the tests run, so nothing is applied. Every YAML document in
deploy/ is parsed and what the manifests promise is checked against the Dockerfile and against
`graphopt serve` itself: the Service is headless and reaches the Deployment's pods on the
container's gRPC port; the probes are built-in gRPC probes on that port, for health service names
a real server (started with the manifest's environment) answers SERVING to; the container runs as
the Dockerfile's non-root user with a read-only root and writable volumes where the server writes;
the GRAPHOPT_* variables the manifest names (its comments included) are ones `graphopt serve`
reads; the grace period outlasts the drain. With `kubernetes-validate` installed, the documents
are also validated against the Kubernetes JSON schemas (strict: unknown fields are errors).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import yaml

from service_process import ServerProcess
from test_container import parse_dockerfile

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("*.yml")])
# built-in gRPC probes are GA from 1.27; the newest is whatever kubernetes-validate ships
OLDEST_KUBERNETES = "1.27"
REAPERS = {"tini", "dumb-init", "catatonit"}   # an init as the container's command would also reap


# ---------------------------------------------------------------- loading

@pytest.fixture(scope="module")
def documents() -> list[dict]:
    assert MANIFESTS, f"no YAML file in {DEPLOY}"
    docs = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert isinstance(doc, dict), f"{path.name}: a document that is not a mapping: {doc!r}"
            for key in ("apiVersion", "kind", "metadata"):
                assert key in doc, f"{path.name}: a {doc.get('kind', '?')} without {key}"
            docs.append(doc)
    return docs


def only(documents: list[dict], kind: str) -> dict:
    found = [d for d in documents if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def deployment(documents) -> dict:
    return only(documents, "Deployment")


@pytest.fixture(scope="module")
def service(documents) -> dict:
    return only(documents, "Service")


@pytest.fixture(scope="module")
def pod(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    containers = pod["containers"]
    assert len(containers) == 1, "one container: the graphopt server"
    return containers[0]


@pytest.fixture(scope="module")
def grpc_port(container) -> int:
    ports = [p for p in container.get("ports", []) if p.get("name") == "grpc"]
    assert len(ports) == 1, f"the container needs one port named grpc, has {container.get('ports')}"
    return ports[0]["containerPort"]


@pytest.fixture(scope="module")
def image() -> dict:
    """USER and ENV of the Dockerfile's final stage."""
    final = parse_dockerfile().stages[-1]
    user = final.last("USER")
    assert user is not None, "the Dockerfile's final stage sets no USER"
    return {"user": user.text.strip(), "env": dict(final.env)}


@pytest.fixture(scope="module")
def container_env(container, image) -> dict[str, str]:
    """What the server sees: the image's ENV, then the manifest's env over it (a value from a
    Secret or the like stands as a placeholder)."""
    env = dict(image["env"])
    for item in container.get("env", []):
        env[item["name"]] = str(item["value"]) if "value" in item else "from-a-reference"
    return env


def serve_args(env: dict[str, str]) -> argparse.Namespace:
    """`graphopt serve`'s parsed options under exactly these GRAPHOPT_* variables (argparse
    converts them with each option's type, so a bad value fails here as it would in the pod)."""
    from graphopt.cli import build_parser
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHOPT_")}
    ours = {k: v for k, v in env.items() if k.startswith("GRAPHOPT_")}
    with mock.patch.dict(os.environ, {**clean, **ours}, clear=True):
        try:
            return build_parser().parse_args(["serve"])
        except SystemExit as exc:
            raise AssertionError(f"`graphopt serve` rejects this environment {ours}") from exc


@pytest.fixture(scope="module")
def effective(container_env) -> argparse.Namespace:
    return serve_args(container_env)


# ---------------------------------------------------------------- the documents

def test_every_document_parses_and_the_kinds_are_there(documents):
    kinds = sorted(d["kind"] for d in documents)
    assert {"Deployment", "Service"} <= set(kinds), kinds
    names = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert len(names) == len(set(names)), f"a kind/name twice: {names}"


def test_the_documents_match_the_kubernetes_schemas(documents):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (PyPI) is not installed: no schema check")
    import jsonschema                                  # a requirement of kubernetes-validate
    newest = kubernetes_validate.latest_version()
    problems = []
    for version in (OLDEST_KUBERNETES, newest):
        for doc in documents:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except jsonschema.ValidationError as exc:    # kubernetes-validate raises it, or a subclass
                problems.append(f"{doc['kind']} {doc['metadata']['name']} against Kubernetes {version}: "
                                f"{exc.message} at {'.'.join(map(str, exc.absolute_path))}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- Service and selection

def test_the_service_is_headless_and_selects_exactly_the_deployments_pods(service, deployment):
    spec = service["spec"]
    assert spec.get("clusterIP") == "None", (
        "the Service must be headless (clusterIP: None): gRPC keeps one connection per channel, so "
        "behind a cluster IP every call of a batch would go to one pod")
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    assert not spec.get("publishNotReadyAddresses", False), "starting and draining pods must stay out of DNS"
    match_labels = deployment["spec"]["selector"]["matchLabels"]
    assert not deployment["spec"]["selector"].get("matchExpressions")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert match_labels.items() <= pod_labels.items(), "the Deployment's selector must match its own pods"
    assert spec["selector"] == match_labels, (
        f"the Service selects {spec['selector']}, the Deployment's pods are {match_labels}")


def test_the_service_reaches_the_grpc_port(service, container, grpc_port):
    ports = service["spec"]["ports"]
    assert len(ports) == 1, ports
    port = ports[0]
    assert port["name"] == "grpc" and port.get("protocol", "TCP") == "TCP"
    target = port.get("targetPort", port["port"])
    resolved = grpc_port if target == "grpc" else target
    assert resolved == grpc_port, f"targetPort {target!r} is not the container's grpc port {grpc_port}"
    # a headless Service maps no port: clients dial the pod at the port in their target
    assert port["port"] == grpc_port, "headless: the Service port must be the pod's port"


def test_the_disruption_budget_covers_the_same_pods(documents, deployment):
    budgets = [d for d in documents if d["kind"] == "PodDisruptionBudget"]
    replicas = deployment["spec"]["replicas"]
    for budget in budgets:
        spec = budget["spec"]
        assert spec["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        if "maxUnavailable" in spec:    # 0 would block every node drain
            assert 0 < spec["maxUnavailable"] < replicas, spec
        if "minAvailable" in spec:
            assert spec["minAvailable"] < replicas, spec


def test_the_deployment_runs_three_replicas_of_the_cpu_image(deployment, container):
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "graphopt:cpu"
    # the image's ENTRYPOINT (`graphopt serve`) is what runs, unless an init is put before it
    command = container.get("command")
    assert command is None or Path(command[0]).name in REAPERS, command
    assert container.get("args") is None, "configure the server through GRAPHOPT_* variables"


# ---------------------------------------------------------------- probes

@pytest.mark.parametrize("kind", ["readinessProbe", "livenessProbe", "startupProbe"])
def test_probes_are_grpc_health_on_the_grpc_port(container, grpc_port, kind):
    probe = container.get(kind)
    if kind == "startupProbe" and probe is None:
        return
    assert probe is not None, f"no {kind}"
    handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & probe.keys()
    assert handlers == {"grpc"}, f"{kind} must be a built-in grpc probe, has {sorted(handlers)}"
    assert probe["grpc"]["port"] == grpc_port, f"{kind} probes port {probe['grpc']['port']}, not {grpc_port}"


def test_the_probed_health_services_are_served(container, container_env, tmp_path):
    """A real `graphopt serve` under the manifest's environment answers SERVING for every service
    name a probe asks about (a name the server does not know is NOT_FOUND: the pod would never
    become ready)."""
    from graphopt_service.client import Client
    names = sorted({container[k]["grpc"].get("service", "")
                    for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container})
    env = {k: v for k, v in container_env.items() if k.startswith("GRAPHOPT_")}
    env.pop("GRAPHOPT_TOKEN", None)     # health needs no token; a placeholder must not be one
    server = ServerProcess(tmp_path / "work", env=env)   # its own port and work dir, the rest as in the pod
    try:
        with Client(server.target) as client:
            answers = {name: client.health(name) for name in names}
        assert answers == {name: "SERVING" for name in names}, answers
        assert server.terminate() == 0
    finally:
        server.kill()


# ---------------------------------------------------------------- the process and its files

def effective_security(pod: dict, container: dict, key: str):
    """A container's securityContext value, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def test_runs_as_the_dockerfiles_non_root_user(pod, container, image):
    uid, _, gid = image["user"].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"the Dockerfile's USER should be a numeric non-root uid: {image['user']}"
    assert effective_security(pod, container, "runAsNonRoot") is True
    assert effective_security(pod, container, "runAsUser") == int(uid) == 10001
    group = effective_security(pod, container, "runAsGroup")
    assert group is None or not gid or group == int(gid)
    security = container.get("securityContext", {})
    assert security.get("allowPrivilegeEscalation") is False
    assert security.get("readOnlyRootFilesystem") is True
    assert security.get("capabilities", {}).get("drop") == ["ALL"]
    assert not security.get("capabilities", {}).get("add")
    assert not security.get("privileged", False)


def test_the_work_dir_and_tmp_are_writable_volumes(pod, container, effective):
    """With a read-only root, the server's work dir (GRAPHOPT_WORK_DIR as `graphopt serve` reads
    it) and /tmp must be mounts of writable volumes."""
    assert effective.work_dir, "GRAPHOPT_WORK_DIR is unset (the image sets it)"
    mounts = {m["mountPath"].rstrip("/"): m for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for path in (effective.work_dir.rstrip("/"), "/tmp"):
        assert path in mounts, f"nothing mounted at {path} (mounts: {sorted(mounts)})"
        mount = mounts[path]
        assert not mount.get("readOnly", False) and not mount.get("subPath")
        volume = volumes[mount["name"]]
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume or "ephemeral" in volume, volume
        if "emptyDir" in volume:
            # tmpfs would count the uploaded models against the memory limit the models are measured in
            assert (volume["emptyDir"] or {}).get("medium", "") != "Memory", f"{path}: use the node's disk"


def test_the_container_port_is_the_servers_port(grpc_port, effective):
    assert effective.port == grpc_port, f"graphopt serve listens on {effective.port}, the manifest says {grpc_port}"


def test_grace_period_outlasts_the_drain(pod, effective):
    """SIGTERM: calls in flight get GRAPHOPT_DRAIN_SECONDS (default 25), then the server stops with
    1 s of grace and removes its work folder; the kubelet's SIGKILL must come after that."""
    grace = pod.get("terminationGracePeriodSeconds", 30)
    assert grace > effective.drain_seconds + 1, (
        f"terminationGracePeriodSeconds {grace} does not outlast a drain of {effective.drain_seconds} s")


def test_orphaned_measuring_processes_are_reaped(pod, container):
    """`graphopt serve` as PID 1 does not reap the measuring processes orphaned when a cancelled
    call's worker is killed; a shared process namespace makes the pause container PID 1 (it
    reaps), as would an init before the server."""
    command = container.get("command") or []
    assert pod.get("shareProcessNamespace") is True or (command and Path(command[0]).name in REAPERS)


def test_service_links_are_off(pod):
    """Kubernetes injects <SERVICE>_PORT=tcp://IP:PORT for every Service with a cluster IP in the
    namespace: one named graphopt would set GRAPHOPT_PORT, which `graphopt serve` reads."""
    assert pod.get("enableServiceLinks") is False


def test_memory_is_requested_and_limited(container):
    resources = container.get("resources", {})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    assert "memory" in requests and "memory" in limits, "models are run and measured in the pod: size its memory"
    assert "cpu" in requests


# ---------------------------------------------------------------- variables and docs

def graphopt_serve_reads() -> set[str]:
    """The GRAPHOPT_* names `graphopt serve --help` names (GRAPHOPT_TOKEN among them)."""
    from graphopt.cli import build_parser
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    names = set(re.findall(r"\$(GRAPHOPT_[A-Z0-9_]+)", help_text.getvalue()))
    return names


def test_graphopt_variables_are_ones_graphopt_serve_reads():
    """Every GRAPHOPT_* name in deploy/, set or only in a comment (the optional TLS and token
    lines), must be one the server reads: a misspelt one would be silently ignored."""
    mentioned = set()
    for path in [*MANIFESTS, DEPLOY / "README.md"]:
        if path.exists():
            mentioned |= set(re.findall(r"\bGRAPHOPT_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert mentioned, "the manifest sets no GRAPHOPT_* variable"
    known = graphopt_serve_reads()
    # not all are in the help (DRAIN_SECONDS, TLS_CERT, TLS_KEY): a name also counts when its
    # value changes the parsed options
    baseline = vars(serve_args({}))
    unknown = []
    for name in sorted(mentioned - known):
        # "7" parses as an int, a float, a byte size and a path, and is no option's default
        if vars(serve_args({name: "7"})) == baseline:
            unknown.append(name)
    assert not unknown, f"`graphopt serve` reads none of {unknown}"


def test_the_readme_targets_the_service(service, grpc_port):
    """The README's batch command dials the headless Service's DNS name on its port."""
    text = (DEPLOY / "README.md").read_text()
    name = service["metadata"]["name"]
    targets = re.findall(r"dns:///([\w.-]+):(\d+)", text)
    assert targets, "deploy/README.md shows no dns:/// target"
    for host, port in targets:
        assert host.split(".")[0] == name and host.endswith(".svc.cluster.local"), host
        assert int(port) == grpc_port
