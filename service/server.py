"""The gRPC server: a thin adapter from graphopt.v1 messages to the graphopt library.

    graphopt serve --port 50051 --workers 2

Health (grpc.health.v1) and server reflection are served beside graphopt.v1.Graphopt. The
library runs in worker processes (workers.py); errors become statuses in status.py.
SIGTERM or SIGINT: health turns NOT_SERVING, new work is refused with UNAVAILABLE, calls in
flight finish (up to `drain_seconds`), then the server stops.

Protections (limits.py, workers.py, auth.py): a call whose client neither sends nor reads for
`idle_timeout_seconds` is ended; uploads in progress are counted apart from admitted calls (a
call takes a queue slot only once its upload is complete) and reserve their disk space; a job
gets at most `job_timeout_seconds` and `job_memory_bytes`; streams other than health are bounded
in number so that threads stay free for health checks; stale work folders of servers that are
gone are removed at start.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from graphopt.options import OptimizeOptions
from graphopt.report import Analysis, Report, peak_lines, summary_text

from ._proto import graphopt_pb2 as pb
from ._proto import graphopt_pb2_grpc as pb_grpc
from .auth import BearerTokenInterceptor
from .limits import (AddressUploads, DiskReservations, StreamLimitInterceptor, StreamWatchdog, UploadRate,
                     peer_address)
from .options import from_message
from .status import (CallCancelledError, IdleTimeoutError, JobTimeoutError, ShuttingDownError, error_from_worker,
                     status_for, trailing_metadata_for)
from .transfer import DEFAULT_CHUNK_BYTES, FileReceiver, ProtocolError, folder_messages
from .workers import WorkerPool, human_bytes

log = logging.getLogger("graphopt_service")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Graphopt"].full_name
UNARY_CALL_THREADS = 8          # threads no stream can take: health checks, ListStrategies
OTHER_STREAMS = 4               # reflection streams at once (health's Watch holds no thread)
MIN_RESPONSE_CHUNK_BYTES = 4 << 10
MAX_RESPONSE_CHUNK_BYTES = 4 << 20
MESSAGE_OVERHEAD_BYTES = 1024   # a FileChunk's fields around its data, with room to spare
MIN_JOB_MEMORY_BYTES = 256 << 20   # an idle worker (Python, onnx, ONNX Runtime) takes about 100-200 MiB
ROOT_PREFIX = "graphopt-service-"
LOCK_NAME = ".lock"
LEGACY_ROOT_AGE_SECONDS = 3600  # a work root without a lock file (an older server's) this old is stale


def memory_limit_bytes() -> int:
    """The memory this server may use: the machine's, or its cgroup's limit where lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_job_memory_bytes(workers: int) -> int:
    """80% of the memory this server may use, shared by its workers (the rest: the server)."""
    return max(MIN_JOB_MEMORY_BYTES, int(memory_limit_bytes() * 0.8) // max(1, workers))


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
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
    idle_timeout_seconds: float = 60.0      # a client silent this long (not sending, not reading) is cut off
    job_timeout_seconds: float = 1800.0     # one job's time on a worker; also bounds an upload's total time
    job_memory_bytes: int | None = None     # a worker and its measuring processes; None: default_job_memory_bytes
    max_files: int = 4096                   # files in one upload (the model and its external data)
    upload_limit: int | None = None         # uploads in progress at once; None: 2 x (workers + queue_limit)
    uploads_per_address: int | None = None  # uploads in progress from one client address; None: no limit
    min_upload_bytes_per_second: int = 16 << 10   # an upload's least pace over each window (0: none)
    upload_rate_window_seconds: float = 30.0

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        for name in ("idle_timeout_seconds", "job_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be at least 0, got {self.drain_seconds}")
        if self.job_memory_bytes is not None and self.job_memory_bytes < MIN_JOB_MEMORY_BYTES:
            raise ValueError(f"the job memory limit must be at least {human_bytes(MIN_JOB_MEMORY_BYTES)} (an idle "
                             f"worker takes about that), got {self.job_memory_bytes} bytes")
        if self.max_files < 1:
            raise ValueError(f"max files must be at least 1, got {self.max_files}")
        if self.upload_limit is not None and self.upload_limit < 1:
            raise ValueError(f"the upload limit must be at least 1, got {self.upload_limit}")
        if self.uploads_per_address is not None and self.uploads_per_address < 1:
            raise ValueError(f"uploads per address must be at least 1, got {self.uploads_per_address}")
        if self.min_upload_bytes_per_second < 0:
            raise ValueError(f"the minimum upload rate must be at least 0, got {self.min_upload_bytes_per_second}")
        if not self.upload_rate_window_seconds > 0:
            raise ValueError(f"upload_rate_window_seconds must be positive, got {self.upload_rate_window_seconds}")
        if self.token is not None and not self.token.strip():
            raise ValueError("the bearer token is empty: that would let anyone in")


def job_options(options: pb.OptimizeOptions, max_threads: int) -> tuple[dict, dict]:
    """The request's options: the server's `OptimizeOptions` in its `to_dict()` form (options.py
    maps the proto's fields, which carry its names; unset ones take the library's defaults) and
    the service's own (plan, response_chunk_bytes). Checked where a message cannot be; objective,
    max_overhead and the like go as sent: the library's check (in the worker, before any work)
    names a bad value, and that is INVALID_ARGUMENT."""
    if options.threads < 0 or options.threads > max_threads:
        raise ProtocolError(f"threads must be between 1 and {max_threads}, got {options.threads}")
    if options.response_chunk_bytes != 0 and not (
            MIN_RESPONSE_CHUNK_BYTES <= options.response_chunk_bytes <= MAX_RESPONSE_CHUNK_BYTES):
        raise ProtocolError(f"response_chunk_bytes must be 0 (the server's default) or between "
                            f"{MIN_RESPONSE_CHUNK_BYTES} and {MAX_RESPONSE_CHUNK_BYTES}, got {options.response_chunk_bytes}")
    library = OptimizeOptions.from_dict(from_message(options)).to_dict()
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
    """The worker's `Analysis.to_dict()` as the response (its JSON passed on as it came)."""
    typed = Analysis.from_dict(analysis)
    response = pb.AnalyzeResponse(
        loss=typed.loss, nodes=typed.nodes.total, forward_nodes=typed.nodes.forward,
        backward_nodes=typed.nodes.backward, stashed_tensors=len(typed.stashed_tensors), provider=typed.provider,
        predicted_peak_bytes_original=typed.predicted_peak_bytes.original_optimizations_off,
        json=json.dumps(analysis),
        peak_summary="\n".join(peak_lines(typed.peaks_explained)) if typed.peaks_explained is not None else "")
    if typed.predicted_peak_bytes.planned is not None:
        response.predicted_peak_bytes_planned = typed.predicted_peak_bytes.planned
    return response


def _parsed(message_class, raw: bytes):
    """A request message from its bytes; ProtocolError (INVALID_ARGUMENT) when they are not one.
    The handlers take raw bytes so that this is the handler's answer, not gRPC's INTERNAL."""
    try:
        return message_class.FromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ProtocolError(f"a request message is not a valid {message_class.DESCRIPTOR.name} "
                            f"({len(raw)} bytes): {exc}") from None


@dataclass
class _Call:
    folder: Path
    fields: dict
    watch: object
    reserved_bytes: int = 0


class GraphoptServicer(pb_grpc.GraphoptServicer):
    def __init__(self, config: ServerConfig, pool: WorkerPool, work_root: Path, watchdog: StreamWatchdog):
        self.config, self.pool, self.work_root, self.watchdog = config, pool, work_root, watchdog
        self.disk = DiskReservations(work_root)
        self.address_uploads = AddressUploads(config.uploads_per_address)
        self.draining = threading.Event()

    def _without_server_paths(self, message: str) -> str:
        return message.replace(str(self.work_root) + os.sep, "").replace(str(self.work_root), ".")

    # -- one call's life: its folder, its idle watch, logging, the error -> status mapping ----
    @contextmanager
    def _call(self, context, method: str):
        call_id = uuid.uuid4().hex[:12]
        fields = {"call_id": call_id, "method": method, "peer": context.peer()}
        started = time.perf_counter()
        call = None
        status = "OK"
        try:
            if self.draining.is_set():
                raise ShuttingDownError("the server is shutting down and takes no new work")
            folder = Path(tempfile.mkdtemp(prefix=f"call-{call_id}-", dir=self.work_root))
            call = _Call(folder, fields, self.watchdog.watch(context, self.config.idle_timeout_seconds))
            for sub in ("upload", "output", "tmp"):
                (folder / sub).mkdir()
            log.info("call started", extra={"fields": fields})
            yield call
        except GeneratorExit:
            status = "CANCELLED"
            if call is not None and call.watch.expired:
                status = "DEADLINE_EXCEEDED"
                fields["error"] = (f"the client neither sent nor read for {self.config.idle_timeout_seconds:g} s "
                                   f"(--idle-timeout) while the server waited for {call.watch.waiting_for}")
            raise
        except Exception as exc:  # noqa: BLE001 - every error ends the call with its status
            if call is not None and call.watch.expired:
                exc = IdleTimeoutError(
                    f"the client neither sent nor read for {self.config.idle_timeout_seconds:g} s (--idle-timeout) "
                    f"while the server waited for {call.watch.waiting_for}; the call was ended")
            elif not context.is_active() and not isinstance(exc, CallCancelledError):
                exc = CallCancelledError("the client went away or the deadline passed")
            code, message = status_for(exc)
            message = self._without_server_paths(message)
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
            if call is not None:
                call.watch.close()
                shutil.rmtree(call.folder, ignore_errors=True)
                self.disk.release(call.reserved_bytes)
            log.info("call finished", extra={"fields": {**fields, "status": status,
                                                        "seconds": round(time.perf_counter() - started, 3)}})

    def _receive(self, request_iterator, call: _Call) -> dict:
        """The upload, in an upload slot; the stream's messages as raw bytes (see `_parsed`)."""
        with self.address_uploads(peer_address(call.fields["peer"])), self.pool.upload_slot():
            receiver = FileReceiver(call.folder / "upload", self.config.max_model_bytes,
                                    max_files=self.config.max_files, reserve=self._reserver(call))
            options = None
            deadline = time.monotonic() + self.config.job_timeout_seconds
            pace = UploadRate(self.config.min_upload_bytes_per_second, self.config.upload_rate_window_seconds)
            try:
                for raw in call.watch.requests(request_iterator):
                    pace.received(len(raw))
                    if time.monotonic() > deadline:
                        raise JobTimeoutError(f"the upload took longer than this server's limit of "
                                              f"{self.config.job_timeout_seconds:g} s (--job-timeout)")
                    request = _parsed(pb.OptimizeRequest, raw)
                    item = request.WhichOneof("item")
                    if options is None:
                        if item != "options":
                            raise ProtocolError(f"the first message must carry the options, not {item or 'nothing'}")
                        options, service = job_options(request.options, max_threads=os.cpu_count() or 1)
                        call.fields["options"] = options   # logged with the call's end: what was asked
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
        call.fields.update(model_bytes=received.total_bytes, files=len(received.paths))
        folder = call.folder
        return {"options": options, "service": service, "model_path": str(received.model_path),
                "output_dir": str(folder / "output"), "tmp_dir": str(folder / "tmp")}

    def _reserver(self, call: _Call):
        def reserve(size_bytes: int, path: str) -> None:
            self.disk.reserve(size_bytes, path)
            call.reserved_bytes += size_bytes
        return reserve

    @contextmanager
    def _admitted(self, fields: dict):
        # a call that began before the drain is in flight: its upload done, it is admitted (the
        # drain waits for it); new calls were refused when they began (_call)
        with self.pool.admit():
            log.info("call admitted", extra={"fields": fields})
            yield

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
        with self._call(context, "Optimize") as call:
            job = self._receive(request_iterator, call)
            job["kind"] = "optimize"
            fields, folder = call.fields, call.folder
            with self._admitted(call.fields):
                with call.watch.waiting("the client to read a response"):
                    yield pb.OptimizeResponse(progress=pb.Progress(stage="queued", fraction=0.0))
                result = None
                for event in self._work(job, context):
                    if "progress" in event:
                        with call.watch.waiting("the client to read a response"):
                            yield pb.OptimizeResponse(progress=pb.Progress(
                                stage=event["progress"], fraction=min(0.95, event["fraction"] * 0.95)))
                    else:
                        result = event["result"]
                chunk_bytes = min(job["service"]["response_chunk_bytes"] or DEFAULT_CHUNK_BYTES,
                                  self.config.max_message_bytes - MESSAGE_OVERHEAD_BYTES)
                for message in folder_messages(folder / "output", result["files"], chunk_bytes,
                                               lambda **item: pb.OptimizeResponse(**item)):
                    with call.watch.waiting("the client to read a response"):
                        yield message
                report = Report.from_dict(result["report"])
                fields.update(strategy=report.strategy, outcome=report.outcome,
                              peak_bytes_optimized=None if report.measured is None else report.measured.optimized.peak_bytes)
                log.info("report", extra={"fields": {**fields, "summary": summary_text(report)}})
                with call.watch.waiting("the client to read a response"):
                    yield pb.OptimizeResponse(report=report_message(report))

    def Analyze(self, request_iterator, context):
        with self._call(context, "Analyze") as call:
            job = self._receive(request_iterator, call)
            job["kind"] = "analyze"
            with self._admitted(call.fields):
                for event in self._work(job, context):
                    if "result" in event:
                        return _analyze_message(event["result"]["analysis"])

    def ListStrategies(self, request, context):
        from graphopt.search import DEFAULT_STRATEGY, STRATEGIES
        try:
            _parsed(pb.ListStrategiesRequest, request)
        except ProtocolError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ListStrategiesResponse(strategies=[
            pb.Strategy(name=name, description=strategy.description, is_default=name == DEFAULT_STRATEGY)
            for name, strategy in STRATEGIES.items()])


def add_servicer(servicer: GraphoptServicer, server: grpc.Server) -> None:
    """The generated registration, but with requests as raw bytes (parsed by the handlers, so that
    bytes that are no message get INVALID_ARGUMENT rather than gRPC's INTERNAL)."""
    handlers = {
        "Optimize": grpc.stream_stream_rpc_method_handler(
            servicer.Optimize, response_serializer=pb.OptimizeResponse.SerializeToString),
        "Analyze": grpc.stream_unary_rpc_method_handler(
            servicer.Analyze, response_serializer=pb.AnalyzeResponse.SerializeToString),
        "ListStrategies": grpc.unary_unary_rpc_method_handler(
            servicer.ListStrategies, response_serializer=pb.ListStrategiesResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def sweep_stale_roots(base: Path) -> list[str]:
    """Remove the work roots of servers that are gone: each running server holds a lock on its
    root's lock file, so a root whose lock can be taken (or, from older servers, a root without
    one, untouched for an hour) belongs to no one. Returns the names removed."""
    removed = []
    for root in base.glob(ROOT_PREFIX + "*"):
        if not root.is_dir() or root.is_symlink():
            continue
        lock_path = root / LOCK_NAME
        try:
            if lock_path.exists():
                with open(lock_path, "a") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue   # its server is running
                    shutil.rmtree(root, ignore_errors=True)
            elif time.time() - root.stat().st_mtime > LEGACY_ROOT_AGE_SECONDS:
                shutil.rmtree(root, ignore_errors=True)
            else:
                continue
        except OSError:
            continue
        removed.append(root.name)
    return removed


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc's malloc keeps an arena per thread that allocated; the RPC threads receiving chunks
    would each keep one, and the server's memory would grow with the uploads it has seen
    (MALLOC_ARENA_MAX from the environment wins)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        ctypes.CDLL(None).mallopt(-8, arenas)   # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


class RunningServer:
    """A started server; `drain_and_stop()` is what SIGTERM does."""

    def __init__(self, config: ServerConfig):
        config.check()
        self.config = config
        _limit_malloc_arenas()
        base = Path(config.work_dir or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        swept = sweep_stale_roots(base)
        if swept:
            log.info("removed stale work folders", extra={"fields": {"folders": swept}})
        self.work_root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=base))
        self._lock_file = open(self.work_root / LOCK_NAME, "w")
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)   # held for the server's life
        self.job_memory_bytes = config.job_memory_bytes or default_job_memory_bytes(config.workers)
        upload_limit = config.upload_limit or 2 * (config.workers + config.queue_limit)
        self.pool = WorkerPool(config.workers, config.queue_limit, upload_limit=upload_limit,
                               job_seconds=config.job_timeout_seconds, job_memory_bytes=self.job_memory_bytes)
        self.watchdog = StreamWatchdog()
        self.servicer = GraphoptServicer(config, self.pool, self.work_root, self.watchdog)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        # Threads: every Graphopt call holds one while it uploads (at most upload_limit) or is
        # admitted (at most workers + queue); reflection streams at most OTHER_STREAMS; the rest
        # are for unary calls (health checks): no stream can take those.
        threads = upload_limit + config.workers + config.queue_limit + OTHER_STREAMS + UNARY_CALL_THREADS
        self.streams = StreamLimitInterceptor(
            {"reflection": OTHER_STREAMS}, lambda method: "reflection" if "ServerReflection" in method else None,
            self.watchdog, config.idle_timeout_seconds)
        interceptors = ([BearerTokenInterceptor(config.token)] if config.token else []) + [self.streams]
        options = [("grpc.max_receive_message_length", config.max_message_bytes),
                   ("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_concurrent_streams", threads)]   # per connection
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                                  interceptors=interceptors, options=options,
                                  maximum_concurrent_rpcs=4 * threads)
        add_servicer(self.servicer, self.server)
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
        log.info("serving", extra={"fields": {"host": config.host, "port": self.port, "workers": config.workers,
                                              "queue_limit": config.queue_limit, "upload_limit": upload_limit,
                                              "threads": threads, "idle_timeout_seconds": config.idle_timeout_seconds,
                                              "job_timeout_seconds": config.job_timeout_seconds,
                                              "job_memory_bytes": self.job_memory_bytes,
                                              "job_memory_enforced_by": self.pool.memory_cap_kind(),
                                              "max_files": config.max_files, "tls": bool(config.tls_cert_path),
                                              "uploads_per_address": config.uploads_per_address,
                                              "min_upload_bytes_per_second": config.min_upload_bytes_per_second,
                                              "token": bool(config.token), "pid": os.getpid()}})

    def drain_and_stop(self) -> None:
        log.info("draining", extra={"fields": {"calls_in_flight": self.pool.admitted,
                                               "uploads_in_flight": self.pool.uploading}})
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
        self.watchdog.stop()
        shutil.rmtree(self.work_root, ignore_errors=True)
        self._lock_file.close()
        log.info("stopped", extra={"fields": {"port": self.port}})


STOP_EXTRA_SECONDS = 10.0   # beyond the drain: the stop's own grace (1 s), closing the workers, the work folder


def threads_in_calls() -> list[dict]:
    """The threads, this one aside, that are in this package's code (a call's handler that has
    not returned, say), each with the innermost frames of its stack. Daemon threads (the workers'
    output readers) and gRPC's idle pool threads are left out."""
    here = os.path.dirname(os.path.abspath(__file__))
    by_ident = {t.ident: t for t in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        thread = by_ident.get(ident)
        if ident == threading.get_ident() or thread is None or thread.daemon:
            continue
        stack = traceback.extract_stack(frame)
        if any(os.path.abspath(f.filename).startswith(here + os.sep) for f in stack):
            found.append({"thread": thread.name,
                          "at": [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack[-5:]]})
    return found


def exit_process(code: int, message: str | None = None) -> NoReturn:
    """End the process now, with `code`, after the logs are written. Once the server has stopped,
    nothing is left to do, but the interpreter's exit joins every thread of gRPC's pool, and one
    still in a call (a handler that never returned) would keep a drained server alive until its
    grace period's SIGKILL; such threads are logged, with where each one is."""
    stuck = threads_in_calls()
    if stuck or message:
        log.warning(message or "threads still in calls at exit", extra={"fields": {"threads": stuck}})
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(config: ServerConfig) -> NoReturn:
    """Serve until SIGTERM or SIGINT, then drain and exit 0 (the process ends here: exit_process).
    A stop that overruns the drain by STOP_EXTRA_SECONDS ends the process with code 1."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    running = RunningServer(config)
    print(json.dumps({"listening": running.port}), flush=True)   # for supervisors and tests
    while not stop.wait(1.0):
        pass
    overrun = threading.Timer(config.drain_seconds + STOP_EXTRA_SECONDS, exit_process,
                              args=(1, "the stop overran the drain time; exiting"))
    overrun.daemon = True
    overrun.start()
    running.drain_and_stop()
    exit_process(0)
