# radixserve's server image: `radixserve serve` with the built-in demo model on port 30000 unless told otherwise,
# and sglang-router (the [router] extra) for the router pods of `radixserve deploy kubernetes`.
#
# CPU (the default; runs on any x86-64 CPU):
#   docker build -t radixserve:cpu .
# NVIDIA GPUs (a CUDA base, and torch's CUDA build):
#   docker build -t radixserve:cuda --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Run:
#   docker run --rm -p 30000:30000 radixserve:cpu
#   docker run --rm --gpus all -p 30000:30000 -v /srv/models:/models radixserve:cuda serve --host 0.0.0.0 \
#       --model /models/Qwen2.5-0.5B-Instruct
# Push where your cluster pulls from, then name it to `radixserve deploy kubernetes --image` (whose default is
# radixserve:cpu, radixserve:cuda with --gpu: these tags, for a cluster that has them locally, e.g. kind load):
#   docker tag radixserve:cpu registry.example.com/radixserve:cpu
#   docker push registry.example.com/radixserve:cpu
#
# Nothing is compiled for the build machine's CPU here: the native CPU attention kernel is compiled at the first
# start, in the container, for the CPU it runs on (kernels/native.py picks AVX-512, AVX2 or the portable build
# with explicit flags, never -march=native), which is why the image keeps a C compiler.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=router

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/radixserve PATH=/opt/radixserve/bin:$PATH TOKENIZERS_PARALLELISM=false

# gcc and the C headers: the native kernel (and triton's launchers on CUDA). A base without a Python that has
# venv and its headers (a CUDA base) gets Debian's or Ubuntu's.
RUN set -eu; \
    packages="gcc libc6-dev ca-certificates"; \
    python3 -c "import ensurepip, sysconfig, os; assert os.path.exists(sysconfig.get_path('include') + '/Python.h')" \
        2>/dev/null || packages="$packages python3 python3-venv python3-dev"; \
    apt-get update; \
    apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv "$VIRTUAL_ENV"; \
    pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"

COPY . /tmp/radixserve-src
RUN pip install "/tmp/radixserve-src[$EXTRAS]" && rm -rf /tmp/radixserve-src \
    && useradd --create-home --uid 1000 radixserve

USER radixserve
WORKDIR /home/radixserve
EXPOSE 30000
ENTRYPOINT ["radixserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "30000"]
