"""CI: deploy/graphopt.yaml run for real with `podman kube play`, two replicas of the image, a
zoo batched over the pods' addresses, one pod killed mid-batch.

Called by .ci/container with podman configured (CONTAINERS_CONF and friends in the environment)
and the CPU image built:

    python3 .ci/kube_play.py --image localhost/graphopt-ci:cpu --work DIR

What is checked:
- the Deployment's pods start from the manifest as it is, with two changes for podman (below),
  and each one's gRPC health turns SERVING for the readiness probe's service;
- the settings that podman applies are the manifest's: user 10001, read-only root file system,
  the memory limit, a process namespace shared with the pod's pause process;
- `graphopt batch ZOO --server POD0:50051,POD1:50051` optimizes the ten-model batch zoo while
  the second pod is killed (SIGKILL to every container of the pod, its network gone: what a
  node lost looks like to a client) once it has served a model and has another call in flight;
- every model optimized exactly once (one successful Optimize call per model in the two pods'
  logs), outputs identical, the summary's unmeasured fields the same as a local batch's on the
  same zoo; a rerun against the pod left does nothing;
- SIGTERM to the pod left, with an Optimize call in flight (a rollout or a drain): the call
  finishes, the server exits 0 within the manifest's grace period.

The two changes, both for podman 4.3 (Debian 12's), neither for Kubernetes:
- `replicas: 2` (the manifest says 3; two pods fit CI's two cores);
- the container's `ports:` list is dropped: podman 4.3 publishes every containerPort on the
  host (Kubernetes never does, podman >= 4.8 only with --publish-all), so a second replica
  could not bind the host's port 50051. Clients reach each pod at its own address, as in a
  cluster.
Podman 4.3 also makes each emptyDir a named volume shared by both pods: the two servers share
one work folder (each keeps its own locked root in it). What podman does not do at all: the gRPC probes (podman 4.3 converts exec, HTTP and TCP
probes only; this script asks the readiness probe's question itself), the Service (no DNS
name: the pods' addresses are given to the batch, as deploy/README.md describes for clients
outside a cluster), the PodDisruptionBudget, and the restart of a killed pod by the
Deployment's controller.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from batch_checks import batch_models, check_batch_outputs, unmeasured_summary  # noqa: E402

REPLICAS = 2
GRPC_PORT = 50051
READY_SECONDS = 120          # the manifest's startupProbe allows 60 s; pods start one after another here
BATCH_SECONDS = 900


def say(message: str) -> None:
    print(f"kube: {message}", flush=True)


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    stderr = "\n".join(line for line in proc.stderr.splitlines()
                       if "unable to get systemd connection" not in line)
    if check and proc.returncode != 0:
        raise SystemExit(f"kube: podman {' '.join(args)} failed ({proc.returncode}): {stderr}")
    return proc.stdout


def manifest_for_podman(image: str) -> tuple[list[dict], dict]:
    """deploy/graphopt.yaml with the two changes above; (all documents, the Deployment)."""
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "graphopt.yaml").read_text()) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["replicas"] = REPLICAS
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    container["image"] = image
    ports = container.pop("ports")
    assert [p["containerPort"] for p in ports] == [GRPC_PORT], ports
    return docs, deployment


def pod_names(deployment: dict) -> list[str]:
    return [f"{deployment['metadata']['name']}-pod-{k}" for k in range(REPLICAS)]


def container_name(pod: str, deployment: dict) -> str:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return f"{pod}-{container['name']}"


def pod_address(pod: str, network: str) -> str:
    infra = json.loads(podman("pod", "inspect", pod))["InfraContainerID"]
    networks = json.loads(podman("inspect", infra, "--format", "{{json .NetworkSettings.Networks}}"))
    return networks[network]["IPAddress"]


def health(target: str, service: str | None = None, timeout: float = 2) -> str:
    args = ["graphopt", "health", "--server", target, "--timeout", str(timeout)]
    if service:
        args += ["--service", service]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout + 30)
    return proc.stdout.strip() or " ".join(proc.stderr.strip().splitlines()[-1:])


def wait_ready(pod: str, container: str, target: str, service: str) -> float:
    started = time.monotonic()
    while (answer := health(target, service)) != "SERVING":
        if podman("inspect", container, "--format", "{{.State.Running}}").strip() != "true":
            print(container_log(container, "--tail", "40"), file=sys.stderr)
            raise SystemExit(f"kube: {pod} exited before it was ready")
        if time.monotonic() - started > READY_SECONDS:
            raise SystemExit(f"kube: {pod} not ready at {target} within {READY_SECONDS} s (last answer: {answer})")
        time.sleep(1)
    return time.monotonic() - started


def check_settings(container: str, template: dict) -> None:
    """What podman applied against what the manifest asks for."""
    spec = template["spec"]
    (wanted,) = spec["containers"]
    info = json.loads(podman("inspect", container))[0]
    user = info["Config"]["User"]
    memory_bytes = info["HostConfig"]["Memory"]
    read_only = info["HostConfig"]["ReadonlyRootfs"]
    pid_mode = info["HostConfig"]["PidMode"]
    say(f"{container}: user {user}, read-only root {read_only}, memory limit {memory_bytes} bytes, "
        f"pid namespace {pid_mode.split(':')[0]}")
    assert user.split(":")[0] == str(wanted["securityContext"]["runAsUser"]), user
    assert read_only is wanted["securityContext"]["readOnlyRootFilesystem"] is True
    limit = wanted["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and memory_bytes == int(limit[:-2]) << 30, (limit, memory_bytes)
    assert spec["shareProcessNamespace"] and pid_mode.startswith("container:"), pid_mode


def container_log(container: str, *args: str) -> str:
    """What the container wrote to stdout and stderr (`podman logs` keeps the two apart)."""
    return subprocess.run(["podman", "logs", *args, container], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60).stdout


def log_path(container: str) -> Path:
    """The container's log file (podman's k8s-file driver: TIME STREAM P|F TEXT lines)."""
    return Path(podman("inspect", container, "--format", "{{.HostConfig.LogConfig.Path}}").strip())


_LOG_PATHS: dict[str, Path] = {}


def log_entries(container: str) -> list[dict]:
    """The server's JSON log lines, read from the container's log file (a killed container's
    too: podman keeps it until the container is removed); a file read, so polling it is cheap."""
    path = _LOG_PATHS.setdefault(container, log_path(container))
    entries, partial = [], ""
    for record in path.read_text(errors="replace").splitlines():
        parts = record.split(" ", 3)
        if len(parts) < 3:
            continue
        text = partial + (parts[3] if len(parts) == 4 else "")
        if parts[2] == "P":                 # a long line, split: the rest follows
            partial = text
            continue
        partial = ""
        if text.startswith("{"):
            try:
                entries.append(json.loads(text))
            except json.JSONDecodeError:
                pass
    return entries


def calls(container: str, message: str, **fields) -> list[dict]:
    return [e for e in log_entries(container)
            if e.get("message") == message and all(e.get(k) == v for k, v in fields.items())]


def batch(*args: str, timeout: float = BATCH_SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphopt.cli", "batch", *args],
                          capture_output=True, text=True, timeout=timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--network", default="graphopt-ci-kube")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)

    docs, deployment = manifest_for_podman(args.image)
    manifest = work / "graphopt.podman.yaml"
    manifest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    template = deployment["spec"]["template"]
    readiness = template["spec"]["containers"][0]["readinessProbe"]["grpc"]
    assert readiness["port"] == GRPC_PORT

    podman("network", "rm", "-f", args.network, check=False)
    podman("network", "create", args.network)
    started = time.monotonic()
    try:
        say(f"podman kube play {manifest.name} ({REPLICAS} replicas) on network {args.network}")
        print(podman("kube", "play", "--network", args.network, str(manifest)), end="")
        pods = pod_names(deployment)
        containers = [container_name(pod, deployment) for pod in pods]
        targets = [f"{pod_address(pod, args.network)}:{GRPC_PORT}" for pod in pods]
        for pod, container, target in zip(pods, containers, targets):
            seconds = wait_ready(pod, container, target, readiness["service"])
            say(f"{pod} at {target}: {readiness['service']} SERVING after {seconds:.1f} s; "
                f"liveness (whole server): {health(target)}")
            check_settings(container, template)

        from graphopt_zoo.batch_zoo import write_batch_zoo
        zoo = write_batch_zoo(work / "zoo")
        out = work / "out"
        jobs = REPLICAS * int(next(e["value"] for e in template["spec"]["containers"][0]["env"]
                                   if e["name"] == "GRAPHOPT_WORKERS"))
        say(f"graphopt batch {len(batch_models(zoo))} models --jobs {jobs} --server {','.join(targets)}")
        running = subprocess.Popen([sys.executable, "-m", "graphopt.cli", "batch", str(zoo), "-o", str(out),
                                    "--jobs", str(jobs), "--server", ",".join(targets)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # the second pod is killed once it has served a model and has another in flight
        victim_pod, victim = pods[1], containers[1]
        deadline = time.monotonic() + 300
        while True:
            done_there = len(calls(victim, "call finished", method="Optimize", status="OK"))
            started_there = len(calls(victim, "call started", method="Optimize"))
            if done_there >= 1 and started_there > done_there:
                break
            if running.poll() is not None or time.monotonic() > deadline:
                running.kill()
                stdout, stderr = running.communicate()
                print(stdout, stderr, container_log(victim, "--tail", "20"), sep="\n", file=sys.stderr)
                raise SystemExit(f"kube: the second pod never had a call in flight after serving one "
                                 f"({started_there} started, {done_there} done; the batch's output above)")
            time.sleep(0.02)
        podman("pod", "kill", victim_pod)
        say(f"killed {victim_pod} (SIGKILL, every container) after {done_there} model(s) served there, "
            f"with {started_there - done_there} call(s) in flight")
        batch_started = time.monotonic()
        stdout, stderr = running.communicate(timeout=BATCH_SECONDS)
        say(f"batch ended {time.monotonic() - batch_started:.1f} s after the kill: {stdout.strip().splitlines()[-1:]}")
        if running.returncode != 0:
            print(stderr, file=sys.stderr)
            raise SystemExit(f"kube: the batch failed ({running.returncode})")
        assert f"{len(batch_models(zoo))} optimized, 0 done before, 0 failed" in stdout, stdout
        reports = check_batch_outputs(zoo, out)

        # exactly once: one successful Optimize call per model over both pods' logs
        finished = {c: calls(c, "call finished", method="Optimize") for c in containers}
        ok = sum(e["status"] == "OK" for entries in finished.values() for e in entries)
        started_on_victim = len(calls(victim, "call started", method="Optimize"))
        say(f"successful Optimize calls per pod: "
            f"{ {c: sum(e['status'] == 'OK' for e in finished[c]) for c in containers} }; "
            f"the killed pod started {started_on_victim} and finished {len(finished[victim])}")
        assert ok == len(reports) == len(batch_models(zoo)), (ok, len(reports))
        assert started_on_victim > len(finished[victim]), "the killed pod had no call in flight"
        assert all(any(e["status"] == "OK" for e in finished[c]) for c in containers), "a pod served no model"
        assert "sending the call again" in stderr, stderr

        local = work / "local"
        proc = batch(str(zoo), "-o", str(local), "--jobs", "2")
        assert proc.returncode == 0, proc.stderr
        assert unmeasured_summary(out) == unmeasured_summary(local)
        say("summary: the unmeasured fields of every model are the local batch's")

        survivor = containers[0]
        before = len(calls(survivor, "call started"))
        again = batch(str(zoo), "-o", str(out), "--server", targets[0])
        assert again.returncode == 0 and "0 optimized, 10 done before, 0 failed" in again.stdout, again
        assert len(calls(survivor, "call started")) == before
        say("a rerun against the pod left: 0 optimized, 10 done before, no call made")

        # A rollout's or drain's SIGTERM with a call in flight: the kubelet stops the app container
        # within the grace period, then the pod's sandbox. (`podman pod stop` and `kube down` stop
        # the pause process at the same time, and with the shared process namespace its exit
        # SIGKILLs the server: the app container is stopped first here, as the kubelet does.)
        grace = template["spec"]["terminationGracePeriodSeconds"]
        model = zoo / "training" / "unet.onnx"
        before = len(calls(survivor, "call started", method="Optimize"))
        client = subprocess.Popen([sys.executable, "-m", "graphopt.cli", "optimize", str(model),
                                   "-o", str(work / "drained.onnx"), "--server", targets[0]],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while len(calls(survivor, "call started", method="Optimize")) == before:
            assert client.poll() is None, client.communicate()
            time.sleep(0.1)
        stopping = time.monotonic()
        podman("stop", "-t", str(grace), survivor, timeout=grace + 60)
        stop_seconds = time.monotonic() - stopping
        client_out, client_err = client.communicate(timeout=60)
        code = podman("inspect", survivor, "--format", "{{.State.ExitCode}}").strip()
        draining = calls(survivor, "draining")
        if code != "0" or client.returncode != 0:
            print(client_out, client_err, container_log(survivor, "--tail", "30"), sep="\n", file=sys.stderr)
        assert code == "0", f"{survivor} exited {code} on SIGTERM, {stop_seconds:.1f} s after it (its log above)"
        assert client.returncode == 0 and (work / "drained.onnx").is_file(), client_err
        assert draining and draining[-1]["calls_in_flight"] == 1, draining
        assert calls(survivor, "call finished", method="Optimize")[-1]["status"] == "OK"
        say(f"SIGTERM to {survivor} with an Optimize call in flight: the call finished OK, the "
            f"server stopped {stop_seconds:.1f} s after the signal, exit code 0")
        for warning in calls(survivor, "threads still in calls at exit"):
            say(f"the server exited with threads still in calls (service/server.py exit_process): {warning['threads']}")
        podman("pod", "stop", pods[0])
        say(f"{time.monotonic() - started:.0f} s in all")
        return 0
    finally:
        subprocess.run(["podman", "kube", "down", str(manifest)], capture_output=True, timeout=300)
        for volume in {v["name"] for v in template["spec"].get("volumes", [])}:
            subprocess.run(["podman", "volume", "rm", "-f", volume], capture_output=True, timeout=60)
        subprocess.run(["podman", "network", "rm", "-f", args.network], capture_output=True, timeout=60)


if __name__ == "__main__":
    sys.exit(main())
