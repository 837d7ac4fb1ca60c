# syntax=docker/dockerfile:1
# The weightstream server image: `weightstream serve`, configured by WEIGHTSTREAM_* variables.
#
#   docker build -t weightstream:dev .
#   docker run --rm -p 50051:50051 -p 50052:50052 -p 8080:8080 -v "$PWD/models:/models:ro" weightstream:dev
#
# Build arguments:
#   PYTHON_IMAGE     base of both stages; any Debian-like image with python3 (>= 3.10) and its venv module.
#   TORCH_SPEC       the torch the server gets. The Run:ai streamer imports torch (runai-model-streamer
#                    requires humanize, numpy and torch) to hand out its buffers as tensors, but the server
#                    only reads bytes from them on the CPU and never touches a GPU: a CPU build is enough and
#                    keeps the image about 4 GB smaller than a CUDA one.
#   TORCH_INDEX_URL  where TORCH_SPEC comes from: PyTorch's CPU wheel index by default.
#   EXTRAS           the project's extras installed: the server with every store (S3, gs://, az://) by
#                    default; "server" alone leaves out the GCS and Azure backends (about 60 MB).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=server,gcs,azure
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# torch first and on its own: the server extra's requirement (torch>=2.4) is then already met, so
# pip does not pull the multi-GB CUDA build from PyPI.
RUN python3 -m venv /opt/weightstream \
    && /opt/weightstream/bin/pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
# A regular (not editable) install: the runtime stage copies the venv alone, without /src.
RUN /opt/weightstream/bin/pip install ".[${EXTRAS}]" \
    && /opt/weightstream/bin/weightstream --version

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="weightstream" \
      org.opencontainers.image.description="gRPC weight-streaming server for LLM inference" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric user, so that Kubernetes' runAsNonRoot can check it without a passwd lookup.
# /var/cache/weightstream is where the deployments put the disk cache (WEIGHTSTREAM_DISK_CACHE, off
# unless set): the server's own and no one else's, which a named volume mounted there inherits.
RUN groupadd --gid 10001 weightstream \
    && useradd --uid 10001 --gid weightstream --no-create-home --home-dir /cache \
       --shell /usr/sbin/nologin weightstream \
    && mkdir -p /models /cache /var/cache/weightstream \
    && chown weightstream:weightstream /cache /var/cache/weightstream \
    && chmod 0700 /var/cache/weightstream
COPY --from=build /opt/weightstream /opt/weightstream
# HOST=0.0.0.0: the server's default (127.0.0.1) would be unreachable from outside the container,
# including by Docker's and Kubernetes' health checks. /cache is the only place the server process
# writes (library caches, temporary files), so the root filesystem can be mounted read-only.
# DATA_PORT is the data port of clients on other hosts (transport tcp); it runs TLS with the gRPC
# port's certificates when those are set, and 0 turns it off.
ENV PATH=/opt/weightstream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/cache \
    XDG_CACHE_HOME=/cache \
    TMPDIR=/cache \
    WEIGHTSTREAM_HOST=0.0.0.0 \
    WEIGHTSTREAM_MODEL_ROOT=/models \
    WEIGHTSTREAM_GRPC_PORT=50051 \
    WEIGHTSTREAM_DATA_PORT=50052 \
    WEIGHTSTREAM_HTTP_PORT=8080
VOLUME ["/models", "/cache"]
EXPOSE 50051 50052 8080
USER 10001:10001
WORKDIR /cache
# Liveness only (/healthz): /readyz also fails while a store is unreachable, which is no reason to
# restart the container. The port follows WEIGHTSTREAM_HTTP_PORT when it is changed at run time.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('WEIGHTSTREAM_HTTP_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["weightstream", "serve"]
