# syntax=docker/dockerfile:1
# The graphopt gRPC service (`graphopt serve`) in a slim image, run as a non-root user.
#
# CPU image (onnxruntime):
#   docker build -t graphopt:cpu .
# GPU image (onnxruntime-gpu with the CUDA and cuDNN libraries it names, from PyPI; the host
# needs an NVIDIA driver new enough for the CUDA major of that onnxruntime-gpu release, and the
# NVIDIA Container Toolkit; run it with `docker run --gpus all ...`):
#   docker build -t graphopt:gpu --build-arg ORT_PACKAGE=onnxruntime-gpu .
# GPU image on a base that already ships CUDA and cuDNN (it must run Python 3.11 as `python`
# and `pip`, glibc >= 2.28, and have bash and useradd; the wheels are built for CPython 3.11):
#   docker build -t graphopt:gpu --build-arg ORT_PACKAGE=onnxruntime-gpu \
#     --build-arg BASE_IMAGE=<your CUDA + cuDNN + Python 3.11 image> --build-arg ORT_GPU_EXTRAS= .
#
# Run (flags come from GRAPHOPT_* variables, see `graphopt serve --help`; calls in flight get
# GRAPHOPT_DRAIN_SECONDS, default 25, after SIGTERM, so give `docker stop` more than that;
# --init reaps the measuring processes orphaned when a cancelled call's worker is killed):
#   docker run --init --stop-timeout 30 -p 50051:50051 graphopt:cpu

# The runtime base: python:3.11-slim, or a CUDA image with Python 3.11 for the GPU variant.
ARG BASE_IMAGE=python:3.11-slim
# onnxruntime (CPU) or onnxruntime-gpu; one version for both, inside pyproject's range (>=1.20,<1.40).
ARG ORT_PACKAGE=onnxruntime
ARG ORT_VERSION=1.31.1
# pip extras of onnxruntime-gpu that bring CUDA and cuDNN as wheels; empty when the base has them.
ARG ORT_GPU_EXTRAS=[cuda,cudnn]

# ---- build: wheels of graphopt and of everything it needs, into /wheels -----------------
FROM python:3.11-slim AS build
ARG ORT_PACKAGE
ARG ORT_VERSION
ARG ORT_GPU_EXTRAS
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY pyproject.toml README.md ./
COPY graphopt ./graphopt
COPY service ./service
COPY proto ./proto
# the tests' and benchmarks' shared models: a package of the project's wheel (never imported by the
# service; its torch parts need the test extra, which the image does not have)
COPY zoo ./zoo
# graphopt's own requirement is onnxruntime, so its wheel is built in both variants (the runtime
# stage swaps it out for the GPU package).
RUN gpu=(); \
    if [ "${ORT_PACKAGE}" != "onnxruntime" ]; then gpu=("${ORT_PACKAGE}${ORT_GPU_EXTRAS}==${ORT_VERSION}"); fi; \
    pip wheel --no-cache-dir --wheel-dir /wheels . "onnxruntime==${ORT_VERSION}" "${gpu[@]}"

# ---- runtime: installs from /wheels only (no compilers, no build context, no pip cache) ---
FROM ${BASE_IMAGE} AS runtime
ARG ORT_PACKAGE
ARG ORT_VERSION
ARG ORT_GPU_EXTRAS
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The wheels are bind-mounted from the build stage, so none of them stays in a layer.
# onnxruntime and onnxruntime-gpu both provide the `onnxruntime` module: the GPU variant removes
# the CPU package before installing its own, and the last step checks exactly one is installed.
# The CUDA/cuDNN wheels' library folders go to ld.so's cache so onnxruntime finds them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/graphopt-*.whl "onnxruntime==${ORT_VERSION}" \
    && if [ "${ORT_PACKAGE}" != "onnxruntime" ]; then \
         pip uninstall --yes onnxruntime \
         && pip install --no-cache-dir --no-index --find-links=/wheels "${ORT_PACKAGE}${ORT_GPU_EXTRAS}==${ORT_VERSION}" \
         && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
         && if [ -d "${site}/nvidia" ]; then \
              find "${site}/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u > /etc/ld.so.conf.d/graphopt-nvidia.conf \
              && ldconfig; \
            fi; \
       fi \
    && python -c "import importlib.metadata as m, sys; got = sorted({d.metadata['Name'].lower() for d in m.distributions()} & {'onnxruntime', 'onnxruntime-gpu'}); sys.exit(None if got == ['${ORT_PACKAGE}'] else f'onnxruntime packages: {got}, wanted [${ORT_PACKAGE}]')" \
    && python -c "import onnxruntime, graphopt_service.server; print('onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers())" \
    && groupadd --gid 10001 graphopt \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/graphopt --shell /usr/sbin/nologin graphopt \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/graphopt /var/lib/graphopt/work

# Per-call folders (uploaded models, results) go under GRAPHOPT_WORK_DIR; mount a volume or a
# tmpfs there for large models. GRAPHOPT_HOST: every interface of the container's own network,
# not left to the CLI's default (loopback only), so that `-p` reaches the server.
ENV GRAPHOPT_HOST=[::] \
    GRAPHOPT_PORT=50051 \
    GRAPHOPT_WORKERS=2 \
    GRAPHOPT_WORK_DIR=/var/lib/graphopt/work \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/graphopt
USER 10001:10001
EXPOSE 50051
# `graphopt health` asks grpc.health.v1 on 127.0.0.1:$GRAPHOPT_PORT (it has its own 5 s timeout).
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 CMD ["graphopt", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["graphopt", "serve"]
