# syntax=docker/dockerfile:1
#
# One image for every dyad role: `dyad router`, `dyad worker --pool encoder|llm`, and the client
# commands (`dyad submit`, `dyad watch`, ...). Two targets:
#
#   docker build -t REGISTRY/dyad:0.1.0 .
#       UCX from the ucxx wheel: TCP between nodes, cuda_ipc/shared memory within a node.
#   docker build --target rdma -t REGISTRY/dyad:0.1.0-rdma .
#       adds a UCX built with verbs and rdmacm (the wheel's has neither) for GPUDirect RDMA;
#       used by k8s/overlays/rdma.
#
# Not built in CI (no container daemon there): docs/deploy.md says what was checked and what not.
# CUDA 12 throughout, matching the pyproject's ucxx-cu12; the host driver must support it.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# ------------------------------------------------------------------------------------------------
# The Python environment: a venv in /opt/venv with torch, dyad and ucxx.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS base

# PyTorch's CUDA 12.8 wheels (PyPI's default torch wheels are built for a newer CUDA major).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Pin it for a reproducible image (--build-arg TORCH_REQUIREMENT=torch==X.Y.Z, a version the
# index carries).
ARG TORCH_REQUIREMENT=torch

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python is 3.12. libnuma1: UCX's NUMA-aware placement.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_REQUIREMENT}"

COPY pyproject.toml README.md /tmp/src/
COPY proto/ /tmp/src/proto/
COPY dyad/ /tmp/src/dyad/
COPY dyad/configs/ /opt/dyad/configs/

# The gRPC stubs are build products (dyad/wire/__init__.py): generate them into the source tree
# so that the installed package carries them (it has no proto/ to generate from at run time).
# torch is already satisfied, so `pip install .` keeps the CUDA 12.8 build installed above.
# ucx_info (the wheel's) needs the wheel's libraries on its path: a wrapper says where.
RUN cd /tmp/src \
    && pip install "grpcio-tools>=1.60" \
    && python -m grpc_tools.protoc -Iproto \
        -I"$(python -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')" \
        --python_out=. --grpc_python_out=. proto/dyad/wire/dyad.proto \
    && pip install . ucxx-cu12 \
    && cd / && rm -rf /tmp/src \
    && python -c "import dyad.wire, dyad.router.server" \
    && libucx="$(python -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')" \
    && printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s/bin/ucx_info "$@"\n' \
        "$libucx" "$libucx" > /usr/local/bin/ucx_info \
    && chmod 755 /usr/local/bin/ucx_info

# Ubuntu's images ship a user 1000 (`ubuntu`); the manifests run as uid/gid 1000 by number.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && (groupdel ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 dyad \
    && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin dyad \
    && mkdir -p /var/lib/dyad \
    && chown 1000:1000 /var/lib/dyad

WORKDIR /var/lib/dyad
USER 1000:1000
ENTRYPOINT ["dyad"]
CMD ["--help"]

# ------------------------------------------------------------------------------------------------
# UCX with InfiniBand verbs, rdmacm and CUDA, the same version as the libucx wheel (1.21), with
# the wheel's own configure flags plus verbs and rdmacm (logging kept on for UCX_LOG_LEVEL).
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS ucx-build
ARG UCX_VERSION=1.21.0
# Set to the release tarball's SHA-256 to have it checked.
ARG UCX_SHA256=
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl build-essential pkg-config \
        libibverbs-dev librdmacm-dev libnuma-dev \
    && rm -rf /var/lib/apt/lists/*
RUN curl -fsSL -o /tmp/ucx.tar.gz \
        "https://github.com/openucx/ucx/releases/download/v${UCX_VERSION}/ucx-${UCX_VERSION}.tar.gz" \
    && if [ -n "${UCX_SHA256}" ]; then echo "${UCX_SHA256}  /tmp/ucx.tar.gz" | sha256sum -c -; fi \
    && mkdir /tmp/ucx && tar -xzf /tmp/ucx.tar.gz -C /tmp/ucx --strip-components=1 \
    && cd /tmp/ucx \
    && ./configure --prefix=/opt/ucx --disable-debug --disable-assertions --disable-params-check \
        --enable-mt --enable-cma --enable-numa --with-cuda=/usr/local/cuda \
        --with-verbs --with-rdmacm --without-java --without-go \
    && make -j"$(nproc)" \
    && make install

# ------------------------------------------------------------------------------------------------
# The RDMA image: the base plus that UCX, loaded instead of the wheel's (libucx's loader honours
# RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY and falls back to the wheel when the system one is missing:
# docs/deploy.md shows how to check which one a process loaded).
FROM base AS rdma
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends ibverbs-providers ibverbs-utils rdmacm-utils \
    && rm -rf /var/lib/apt/lists/*
COPY --from=ucx-build /opt/ucx /opt/ucx
# The loader dlopens "libucs.so" by that name, which the linker cache does not hold: the path.
ENV RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true \
    LD_LIBRARY_PATH=/opt/ucx/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/ucx/bin:${PATH}
RUN rm /usr/local/bin/ucx_info
USER 1000:1000

# ------------------------------------------------------------------------------------------------
# The default target (last stage): the base image as it is.
FROM base AS default
