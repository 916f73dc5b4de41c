# Thin for now: the graphopt command line on a slim Python base, as a non-root user.
# The gRPC service (`graphopt serve`), its health check and the GPU variant come with the
# service issue.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY graphopt ./graphopt
RUN pip install --no-cache-dir . && useradd --create-home graphopt
USER graphopt
ENTRYPOINT ["graphopt"]
CMD ["demo"]
