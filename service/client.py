"""The Python client of the graphopt service.

    from graphopt_service.client import Client
    with Client("localhost:50051") as client:
        report = client.optimize("train.onnx", "opt.onnx", budget_bytes=512 << 20)   # a graphopt Report

Errors come back as grpc.RpcError with the server's status code and message.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphopt.ingest import external_data_files
from graphopt.options import OptimizeOptions
from graphopt.report import Report

from ._proto import graphopt_pb2 as pb
from ._proto import graphopt_pb2_grpc as pb_grpc
from .options import to_message
from .transfer import DEFAULT_CHUNK_BYTES, FileReceiver, ProtocolError, folder_messages

Progress = Callable[[str, float], None]


def make_options(options: OptimizeOptions | None = None, *, plan: bool = False, response_chunk_bytes: int = 0,
                 **fields) -> pb.OptimizeOptions:
    """The proto's options of the library's `OptimizeOptions` (or of its fields by name, see
    graphopt/options.py), with the service's own plan and response_chunk_bytes. The inputs'
    arrays and the progress callback do not travel (the server synthesizes inputs from
    input_dims)."""
    if options is None:
        options = OptimizeOptions.from_dict({k: v for k, v in fields.items() if v is not None})
    elif fields:
        raise TypeError("give an OptimizeOptions or its fields, not both")
    if options.inputs is not None:
        raise ValueError("inputs are not sent to a server: give input_dims (the server synthesizes inputs)")
    return to_message(options, pb.OptimizeOptions(plan=plan, response_chunk_bytes=response_chunk_bytes))


def upload_messages(model_path: str | os.PathLike, options: pb.OptimizeOptions,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.OptimizeRequest]:
    """The request stream: options, the model file, then each external-data file it references.
    The model is read (and a bad one refused with InvalidModelError) here, before the call
    starts: raised inside the stream, gRPC would end the call as UNKNOWN."""
    model_path = Path(model_path)
    files = [model_path.name, *external_data_files(model_path)]

    def stream():
        yield pb.OptimizeRequest(options=options)
        yield from folder_messages(model_path.parent, files, chunk_bytes, lambda **item: pb.OptimizeRequest(**item))
    return stream()


class Client:
    def __init__(self, target: str, token: str | None = None, tls_ca_path: str | None = None,
                 max_message_bytes: int = 16 << 20, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_download_bytes: int | None = None, lb_policy: str | None = None):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if lb_policy:   # e.g. round_robin over every address a target resolves to
            options.append(("grpc.lb_policy_name", lb_policy))
        if tls_ca_path:
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_path).read_bytes())
            self.channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.GraphoptStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.chunk_bytes = chunk_bytes
        self.max_download_bytes = max_download_bytes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def health(self, service: str = "", timeout_seconds: float = 5.0) -> str:
        """SERVING, NOT_SERVING, ... of `service` ("" is the whole server)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def list_strategies(self, timeout_seconds: float | None = 30.0) -> list[pb.Strategy]:
        return list(self.stub.ListStrategies(pb.ListStrategiesRequest(), metadata=self.metadata,
                                             timeout=timeout_seconds).strategies)

    def analyze(self, model_path: str | os.PathLike, timeout_seconds: float | None = None,
                **options) -> dict:
        """The server's analysis of a model file (annotations, predicted peaks) as a dict."""
        response = self.stub.Analyze(upload_messages(model_path, make_options(**options), self.chunk_bytes),
                                     metadata=self.metadata, timeout=timeout_seconds)
        return json.loads(response.json)

    def optimize_call(self, model_path: str | os.PathLike, timeout_seconds: float | None = None, **options):
        """The raw response stream (a grpc call object: iterate it, or cancel() it)."""
        return self.stub.Optimize(upload_messages(model_path, make_options(**options), self.chunk_bytes),
                                  metadata=self.metadata, timeout=timeout_seconds)

    def optimize(self, model_path: str | os.PathLike, output_path: str | os.PathLike,
                 progress: Progress | None = None, timeout_seconds: float | None = None, **options) -> Report:
        """Optimize a model file on the server; write the rewritten model (and its external data
        beside it) to `output_path`; return the library's report. Nothing is written on failure.
        `options`: see `make_options`."""
        output_path = Path(output_path)
        output_path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".graphopt-download-", dir=output_path.parent))
        receiver = FileReceiver(staging, self.max_download_bytes)
        try:
            report = None
            for response in self.optimize_call(model_path, timeout_seconds, **options):
                item = response.WhichOneof("item")
                if item == "progress" and progress:
                    progress(response.progress.stage, response.progress.fraction)
                elif item == "file":
                    receiver.header(response.file)
                elif item == "chunk":
                    receiver.chunk(response.chunk)
                elif item == "report":
                    report = Report.from_dict(json.loads(response.report.json))
            if report is None:
                raise ProtocolError("the server ended the stream without a report")
            received = receiver.finish()
            # the model to its name; its external data keeps the paths the model refers to
            for relative in received.paths[1:]:
                target = output_path.parent / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / relative, target)
            os.replace(received.model_path, output_path)
            return report
        finally:
            receiver.abort()
            shutil.rmtree(staging, ignore_errors=True)
