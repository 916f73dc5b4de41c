"""The gRPC server: a thin adapter from graphopt.v1 messages to the graphopt library.

    graphopt serve --port 50051 --workers 2

Health (grpc.health.v1) and server reflection are served beside graphopt.v1.Graphopt. The
library runs in worker processes (workers.py); errors become statuses in status.py.
SIGTERM or SIGINT: health turns NOT_SERVING, new work is refused with UNAVAILABLE, calls in
flight finish (up to `drain_seconds`), then the server stops.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
import uuid
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from graphopt.report import Report, summary_text

from ._proto import graphopt_pb2 as pb
from ._proto import graphopt_pb2_grpc as pb_grpc
from .auth import BearerTokenInterceptor
from .status import CallCancelledError, ShuttingDownError, error_from_worker, status_for, trailing_metadata_for
from .transfer import DEFAULT_CHUNK_BYTES, FileReceiver, ProtocolError, folder_messages
from .workers import WorkerPool

log = logging.getLogger("graphopt_service")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Graphopt"].full_name
LIGHT_CALL_THREADS = 8          # threads kept for health, reflection and ListStrategies
MAX_RESPONSE_CHUNK_BYTES = 4 << 20
MESSAGE_OVERHEAD_BYTES = 1024   # a FileChunk's fields around its data, with room to spare


@dataclass
class ServerConfig:
    host: str = "[::]"
    port: int = 50051
    workers: int = 2
    queue_limit: int = 8
    max_model_bytes: int = 4 << 30          # the sum of a model's files
    max_message_bytes: int = 16 << 20       # one gRPC message, both directions
    work_dir: str | None = None             # per-call folders go here (default: the system temp dir)
    token: str | None = None
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    drain_seconds: float = 25.0


def job_options(options: pb.OptimizeOptions, max_threads: int) -> tuple[dict, dict]:
    """The request's options: the library's `OptimizeOptions.to_dict()` form (the proto's fields
    carry its names; unset optional fields keep the library's defaults) and the service's own
    (plan, response_chunk_bytes). Checked where a message cannot be."""
    input_dims = {}
    for entry in options.input_dims:
        if not entry.name:
            raise ProtocolError("input_dims has an entry without a name")
        if any(d < 0 for d in entry.dims):
            raise ProtocolError(f"input_dims[{entry.name!r}] has a negative dimension: {list(entry.dims)}")
        input_dims[entry.name] = list(entry.dims)
    if options.threads < 0 or options.threads > max_threads:
        raise ProtocolError(f"threads must be between 1 and {max_threads}, got {options.threads}")
    if options.response_chunk_bytes < 0 or options.response_chunk_bytes > MAX_RESPONSE_CHUNK_BYTES:
        raise ProtocolError(f"response_chunk_bytes must be at most {MAX_RESPONSE_CHUNK_BYTES}, "
                            f"got {options.response_chunk_bytes}")
    library = {"input_dims": input_dims, "threads": options.threads or 1}
    if options.HasField("budget_bytes"):
        library["budget_bytes"] = options.budget_bytes
    if options.strategy:
        library["strategy"] = options.strategy
    # objective and max_overhead as sent: the library's check (in the worker, before any work)
    # names an unknown objective or a bad overhead, and that is INVALID_ARGUMENT
    if options.HasField("objective"):
        library["objective"] = options.objective
    if options.HasField("max_overhead"):
        library["max_overhead"] = options.max_overhead
    if options.HasField("graph_optimizations"):
        library["graph_optimizations"] = options.graph_optimizations
    if options.loss:
        library["loss"] = options.loss
    if options.providers:
        library["providers"] = list(options.providers)
    for name in ("verify", "measure", "tolerance"):
        if options.HasField(name):
            library[name] = getattr(options, name)
    return library, {"plan": options.plan, "response_chunk_bytes": options.response_chunk_bytes}


def report_message(report: Report) -> pb.Report:
    """The proto's Report of the library's."""
    measured = report.measured
    message = pb.Report(
        strategy=report.strategy, checkpoints=len(report.checkpoints), recompute_nodes=report.recompute_nodes,
        predicted_peak_bytes=pb.PeakBytes(
            original_optimizations_off=report.predicted.original_optimizations_off.peak_bytes,
            optimized=report.predicted.optimized.peak_bytes),
        measured_peak_bytes=pb.PeakBytes() if measured is None else pb.PeakBytes(
            original_default_session=measured.original_default_session.peak_bytes,
            original_optimizations_off=measured.original_optimizations_off.peak_bytes,
            optimized=measured.optimized.peak_bytes),
        outputs_match=bool(report.outputs_match), total_seconds=report.total_seconds,
        json=json.dumps(report.to_dict()), summary=summary_text(report),
        measurement_method=report.measurement_method or "", provider=report.provider,
        outcome=report.outcome, outcome_reason=report.outcome_reason)
    if report.order_followed is not None:
        message.order_followed = report.order_followed
    if report.solver_exact is not None:
        message.solver_exact = report.solver_exact
    objective = report.objective
    if objective is not None:
        message.objective = objective.name
        if objective.max_overhead is not None:
            message.max_overhead = objective.max_overhead
        if objective.measured_overhead is not None:
            message.measured_overhead = objective.measured_overhead
        if objective.met is not None:
            message.objective_met = objective.met
    return message


def _analyze_message(analysis: dict) -> pb.AnalyzeResponse:
    response = pb.AnalyzeResponse(
        loss=analysis["loss"], nodes=analysis["nodes"]["total"], forward_nodes=analysis["nodes"]["forward"],
        backward_nodes=analysis["nodes"]["backward"], stashed_tensors=len(analysis["stashed_tensors"]),
        provider=analysis["provider"],
        predicted_peak_bytes_original=analysis["predicted_peak_bytes"]["original_optimizations_off"],
        json=json.dumps(analysis))
    if "planned" in analysis["predicted_peak_bytes"]:
        response.predicted_peak_bytes_planned = analysis["predicted_peak_bytes"]["planned"]
    return response


class GraphoptServicer(pb_grpc.GraphoptServicer):
    def __init__(self, config: ServerConfig, pool: WorkerPool, work_root: Path):
        self.config, self.pool, self.work_root = config, pool, work_root
        self.draining = threading.Event()

    # -- one call's life: admission, its folder, logging, the error -> status mapping --------
    @contextmanager
    def _call(self, context, method: str):
        call_id = uuid.uuid4().hex[:12]
        fields = {"call_id": call_id, "method": method, "peer": context.peer()}
        started = time.perf_counter()
        folder = None
        status = "OK"
        try:
            if self.draining.is_set():
                raise ShuttingDownError("the server is shutting down and takes no new work")
            with self.pool.admit():
                folder = Path(tempfile.mkdtemp(prefix=f"call-{call_id}-", dir=self.work_root))
                for sub in ("upload", "output", "tmp"):
                    (folder / sub).mkdir()
                log.info("call started", extra={"fields": fields})
                yield folder, fields
        except GeneratorExit:
            status = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001 - every error ends the call with its status
            if not context.is_active() and not isinstance(exc, CallCancelledError):
                exc = CallCancelledError("the client went away or the deadline passed")
            code, message = status_for(exc)
            status = code.name
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.INFO
            details = {**fields, "status": status, "error": message}
            if code == grpc.StatusCode.INTERNAL:   # a bug or a crash: keep where it happened
                details["traceback"] = getattr(exc, "worker_traceback", None) or traceback.format_exc()
            log.log(level, "call failed", extra={"fields": details})
            metadata = trailing_metadata_for(exc)
            if metadata:
                context.set_trailing_metadata(metadata)
            context.abort(code, message)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            log.info("call finished", extra={"fields": {**fields, "status": status,
                                                        "seconds": round(time.perf_counter() - started, 3)}})

    def _receive(self, request_iterator, folder: Path, fields: dict) -> dict:
        receiver = FileReceiver(folder / "upload", self.config.max_model_bytes)
        options = None
        try:
            for request in request_iterator:
                item = request.WhichOneof("item")
                if options is None:
                    if item != "options":
                        raise ProtocolError(f"the first message must carry the options, not {item or 'nothing'}")
                    options, service = job_options(request.options, max_threads=os.cpu_count() or 1)
                elif item == "options":
                    raise ProtocolError("the options were sent twice")
                elif item == "file":
                    receiver.header(request.file)
                elif item == "chunk":
                    receiver.chunk(request.chunk)
                else:
                    raise ProtocolError("a request message carries nothing")
            if options is None:
                raise ProtocolError("the stream ended before the options")
            received = receiver.finish()
        finally:
            receiver.abort()
        fields.update(model_bytes=received.total_bytes, files=len(received.paths))
        return {"options": options, "service": service, "model_path": str(received.model_path),
                "output_dir": str(folder / "output"), "tmp_dir": str(folder / "tmp")}

    def _work(self, job: dict, context):
        """Progress events, then the result (an error becomes its exception)."""
        for event in self.pool.run(job, is_cancelled=lambda: not context.is_active()):
            if "progress" in event:
                yield event
            elif "error" in event:
                raise error_from_worker(event)
            else:
                yield event

    # -- the RPCs ----------------------------------------------------------------------------
    def Optimize(self, request_iterator, context):
        with self._call(context, "Optimize") as (folder, fields):
            job = self._receive(request_iterator, folder, fields)
            job["kind"] = "optimize"
            yield pb.OptimizeResponse(progress=pb.Progress(stage="queued", fraction=0.0))
            result = None
            for event in self._work(job, context):
                if "progress" in event:
                    yield pb.OptimizeResponse(progress=pb.Progress(
                        stage=event["progress"], fraction=min(0.95, event["fraction"] * 0.95)))
                else:
                    result = event["result"]
            chunk_bytes = min(job["service"]["response_chunk_bytes"] or DEFAULT_CHUNK_BYTES,
                              self.config.max_message_bytes - MESSAGE_OVERHEAD_BYTES)
            yield from folder_messages(folder / "output", result["files"], chunk_bytes,
                                       lambda **item: pb.OptimizeResponse(**item))
            report = Report.from_dict(result["report"])
            fields.update(strategy=report.strategy, outcome=report.outcome,
                          peak_bytes_optimized=None if report.measured is None else report.measured.optimized.peak_bytes)
            log.info("report", extra={"fields": {**fields, "summary": summary_text(report)}})
            yield pb.OptimizeResponse(report=report_message(report))

    def Analyze(self, request_iterator, context):
        with self._call(context, "Analyze") as (folder, fields):
            job = self._receive(request_iterator, folder, fields)
            job["kind"] = "analyze"
            for event in self._work(job, context):
                if "result" in event:
                    return _analyze_message(event["result"]["analysis"])

    def ListStrategies(self, request, context):
        from graphopt.search import DEFAULT_STRATEGY, STRATEGIES
        return pb.ListStrategiesResponse(strategies=[
            pb.Strategy(name=name, description=strategy.description, is_default=name == DEFAULT_STRATEGY)
            for name, strategy in STRATEGIES.items()])


class RunningServer:
    """A started server; `drain_and_stop()` is what SIGTERM does."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._own_root = config.work_dir is None
        base = config.work_dir or tempfile.gettempdir()
        Path(base).mkdir(parents=True, exist_ok=True)
        self.work_root = Path(tempfile.mkdtemp(prefix="graphopt-service-", dir=base))
        self.pool = WorkerPool(config.workers, config.queue_limit)
        self.servicer = GraphoptServicer(config, self.pool, self.work_root)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        interceptors = [BearerTokenInterceptor(config.token)] if config.token else []
        limits = [("grpc.max_receive_message_length", config.max_message_bytes),
                  ("grpc.max_send_message_length", config.max_message_bytes)]
        threads = config.workers + config.queue_limit + LIGHT_CALL_THREADS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                                  interceptors=interceptors, options=limits)
        pb_grpc.add_GraphoptServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        address = f"{config.host}:{config.port}"
        if config.tls_cert_path or config.tls_key_path:
            if not (config.tls_cert_path and config.tls_key_path):
                raise ValueError("TLS needs both a certificate and its key")
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key_path).read_bytes(), Path(config.tls_cert_path).read_bytes())])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"fields": {"port": self.port, "workers": config.workers,
                                              "queue_limit": config.queue_limit, "tls": bool(config.tls_cert_path),
                                              "token": bool(config.token), "pid": os.getpid()}})

    def drain_and_stop(self) -> None:
        log.info("draining", extra={"fields": {"calls_in_flight": self.pool.admitted}})
        self.health.enter_graceful_shutdown()
        self.servicer.draining.set()
        drained = self.pool.wait_idle(self.config.drain_seconds)
        if not drained:
            log.warning("drain time is up; stopping calls still in flight",
                        extra={"fields": {"calls_in_flight": self.pool.admitted}})
        self.stop(grace_seconds=1.0)

    def stop(self, grace_seconds: float = 0.0) -> None:
        self.server.stop(grace_seconds).wait()
        self.pool.close()
        shutil.rmtree(self.work_root, ignore_errors=True)
        log.info("stopped", extra={"fields": {"port": self.port}})


def serve(config: ServerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain. Returns the exit code."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    running = RunningServer(config)
    print(json.dumps({"listening": running.port}), flush=True)   # for supervisors and tests
    while not stop.wait(1.0):
        pass
    running.drain_and_stop()
    return 0
