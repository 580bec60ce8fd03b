# syntax=docker/dockerfile:1
# kvtier cache daemon image (CPU build of torch; the daemon serves CPU/disk/remote tiers).
#   docker build -t ghcr.io/kvtier/kvtier:0.1.0 .
# The uid/gid (10001) and ports must match k8s/base/daemonset.yaml; tests/deploy checks both.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: a self-contained virtualenv in /opt/kvtier ----------------------------------------
FROM ${PYTHON_IMAGE} AS build
# Keep in step with the Makefile's TORCH pin.
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvtier
ENV PATH=/opt/kvtier/bin:$PATH
# CPU wheel first, from the PyTorch index, so the project's torch requirement is already met
# and pip does not pull the multi-GB CUDA build from PyPI.
RUN pip install --upgrade pip \
 && pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . .
# Install the project with its dependencies, generate the gRPC stubs from the .proto in the
# source tree (when the project has a generator), then reinstall the package so the generated
# modules ship in site-packages. grpcio-tools is a build-time tool only.
RUN pip install . \
 && if [ -f kvtier/rpc/build_proto.py ]; then \
        pip install "grpcio-tools>=1.62,<2" \
     && python -m kvtier.rpc.build_proto \
     && pip install --no-deps --force-reinstall . \
     && pip uninstall -y grpcio-tools; \
    fi \
 && kvtier --help > /dev/null

# --- runtime ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvtier" \
      org.opencontainers.image.description="Tiered KV-cache offload service for LLM inference" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvtier --create-home \
        --shell /usr/sbin/nologin kvtier \
 && mkdir -p /var/lib/kvtier /etc/kvtier/config /etc/kvtier/secrets \
 && chown 10001:10001 /var/lib/kvtier \
 && chmod 0700 /var/lib/kvtier
COPY --from=build /opt/kvtier /opt/kvtier
ENV PATH=/opt/kvtier/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric user so the kubelet can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/kvtier
EXPOSE 7070 9400
ENTRYPOINT ["kvtier"]
CMD ["serve", "--config", "/etc/kvtier/config/kvtier.toml"]
