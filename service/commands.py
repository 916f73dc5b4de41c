"""The command-line side of the service: `graphopt serve`, `graphopt health`, and the
`--server HOST:PORT` forms of optimize, analyze and strategies (graphopt/cli.py dispatches
here, so the library itself never imports gRPC)."""
from __future__ import annotations

import json
import logging
import os
import sys

import grpc

ENV_PREFIX = "GRAPHOPT_"


def token_from(args) -> str | None:
    """The bearer token of --token-file or $GRAPHOPT_TOKEN. A token file that is empty (or only
    white space) is an error, not "no token": a server would otherwise run open."""
    from graphopt.errors import InvalidOptionError
    if getattr(args, "token_file", None):
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise InvalidOptionError(f"cannot read the token file {str(args.token_file)!r}: {exc.strerror}") from None
        if not token:
            raise InvalidOptionError(f"the token file {str(args.token_file)!r} is empty")
        return token
    return os.environ.get(ENV_PREFIX + "TOKEN") or None


def _client(args):
    from .client import Client
    return Client(args.server, token=token_from(args), tls_ca_path=getattr(args, "tls_ca", None))


def rpc_error_exit(exc: grpc.RpcError) -> int:
    print(f"graphopt: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 2


def serve(args) -> int:
    from .logs import configure
    from .server import ServerConfig, serve as run
    configure(logging.DEBUG if args.verbose else logging.INFO)
    from graphopt.errors import InvalidOptionError
    token = token_from(args)
    if token is None and ENV_PREFIX + "TOKEN" in os.environ and not getattr(args, "token_file", None):
        # set but empty: someone meant to require a token (say, from a Secret that is empty)
        raise InvalidOptionError(f"${ENV_PREFIX}TOKEN is set but empty; unset it to serve without a token")
    config = ServerConfig(host=args.host, port=args.port, workers=args.workers, queue_limit=args.queue,
                          max_model_bytes=args.max_model_bytes, max_message_bytes=args.max_message_bytes,
                          work_dir=args.work_dir, token=token, tls_cert_path=args.tls_cert,
                          tls_key_path=args.tls_key, drain_seconds=args.drain_seconds,
                          idle_timeout_seconds=args.idle_timeout, job_timeout_seconds=args.job_timeout,
                          job_memory_bytes=args.job_memory, max_files=args.max_files,
                          uploads_per_address=args.uploads_per_address,
                          min_upload_bytes_per_second=args.min_upload_rate,
                          upload_rate_window_seconds=args.upload_rate_window)
    try:
        config.check()
    except ValueError as exc:
        raise InvalidOptionError(str(exc)) from None
    return run(config)


def health(args) -> int:
    try:
        with _client(args) as client:
            status = client.health(args.service, timeout_seconds=args.timeout)
    except grpc.RpcError as exc:
        return rpc_error_exit(exc)
    print(status)
    return 0 if status == "SERVING" else 1


def remote_runner(args):
    """`graphopt batch --server`: the batch's runner on the servers named."""
    from .batch import RemoteRunner
    return RemoteRunner(args.server, token=token_from(args), tls_ca_path=args.tls_ca)


def optimize(args, options, progress) -> int:
    """`graphopt optimize --server`: `options` (the library's OptimizeOptions) on the server."""
    from graphopt.report import summary_text
    try:
        with _client(args) as client:
            report = client.optimize(args.model, args.output, progress=progress,
                                     timeout_seconds=args.deadline_seconds, options=options)
    except grpc.RpcError as exc:
        return rpc_error_exit(exc)
    if args.report:
        args.report.write_text(json.dumps(report.to_dict(), indent=2))
    print(summary_text(report))
    print(f"wrote {args.output}" + (f" and {args.report}" if args.report else "") + f" (server {args.server})")
    return 0


def analyze(args, options) -> int:
    try:
        with _client(args) as client:
            analysis = client.analyze(args.model, timeout_seconds=args.deadline_seconds, plan=args.plan,
                                      options=options)
    except grpc.RpcError as exc:
        return rpc_error_exit(exc)
    print(json.dumps(analysis, indent=2))
    if analysis.get("peaks_explained"):   # for the eye; the JSON above holds the same
        from graphopt.report import Analysis, peak_lines
        print("\n".join(peak_lines(Analysis.from_dict(analysis).peaks_explained)), file=sys.stderr)
    return 0


def strategies(args) -> int:
    try:
        with _client(args) as client:
            listed = client.list_strategies()
    except grpc.RpcError as exc:
        return rpc_error_exit(exc)
    for s in listed:
        print(f"{s.name:16s}{' (default)' if s.is_default else '':10s} {s.description}")
    return 0
