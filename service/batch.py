"""`graphopt batch --server ...`: the batch's jobs on one or more graphopt servers.

One channel with gRPC's client-side round-robin over every server address: each call goes
to the next ready server. A call that fails because its server went away (UNAVAILABLE) is
sent again and goes to another server; the model's result is written by the batch only when
a call returns it, so nothing is lost or done twice.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace

import grpc

from graphopt.batch import BatchJob, BatchOptions

from .client import Client

log = logging.getLogger(__name__)
RETRIES = 6
RETRY_WAIT_SECONDS = 0.5
# a server that died or drained mid-call ends the call with UNAVAILABLE; a server whose queue is
# full refuses it with RESOURCE_EXHAUSTED before doing anything: both are sent again
RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


def channel_target(servers: str) -> str:
    """'h1:p1,h2:p2' -> 'ipv4:a1:p1,a2:p2' (each resolved); one 'h:p' -> 'dns:///h:p' (a headless
    Service name resolves to every pod); a target with a scheme is used as it is."""
    if servers.startswith(("dns:", "ipv4:", "ipv6:", "unix:")):
        return servers
    parts = [p.strip() for p in servers.split(",") if p.strip()]
    if len(parts) == 1:
        return f"dns:///{parts[0]}"
    addresses = []
    for part in parts:
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"not HOST:PORT: {part!r}")
        info = socket.getaddrinfo(host.strip("[]"), int(port), socket.AF_INET, socket.SOCK_STREAM)
        addresses.append(f"{info[0][4][0]}:{port}")
    return "ipv4:" + ",".join(addresses)


class RemoteRunner:
    def __init__(self, servers: str, token: str | None = None, tls_ca_path: str | None = None,
                 retries: int = RETRIES, deadline_seconds: float | None = None):
        self.client = Client(channel_target(servers), token=token, tls_ca_path=tls_ca_path, lb_policy="round_robin")
        self.retries, self.deadline_seconds = retries, deadline_seconds

    def close(self) -> None:
        self.client.close()

    def optimize(self, job: BatchJob, options: BatchOptions) -> dict:
        if options.sweep:
            raise ValueError("--sweep runs in-process only (the service has no sweep call)")
        job.out_dir.mkdir(parents=True, exist_ok=True)
        budget = None
        if options.budget_fraction is not None:
            analysis = self._call(lambda: self.client.analyze(job.training_path, timeout_seconds=self.deadline_seconds))
            budget = int(options.budget_fraction * analysis["predicted_peak_bytes"]["original_optimizations_off"])
        each = replace(options.optimize, budget_bytes=budget)
        report = self._call(lambda: self.client.optimize(
            job.training_path, job.optimized_path, timeout_seconds=self.deadline_seconds, options=each))
        return report.to_dict()

    def _call(self, call):
        for attempt in range(self.retries + 1):
            try:
                return call()
            except grpc.RpcError as exc:
                queue_full = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in (exc.details() or "")
                if (exc.code() not in RETRYABLE and not queue_full) or attempt == self.retries:
                    raise
                log.warning("a server went away; sending the call again (%s: %s)", exc.code().name, exc.details())
                time.sleep(min(8.0, RETRY_WAIT_SECONDS * 2 ** attempt))
