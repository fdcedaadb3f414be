# syntax=docker/dockerfile:1
# Learner image: the PyTorch CUDA runtime with rlpipe installed on top (no vLLM).
# The dev overlay also runs producers from it, sampling with transformers on the CPU.
#
#   docker build -f infra/docker/learner.Dockerfile -t rlpipe-learner:0.1.0 .
#
# The base is pinned to the torch release the project tests with and the `gpu` extra names
# (pyproject.toml: torch==2.13.0, the torch vllm 0.32.0 pins); the learner needs no vLLM, so
# it installs rlpipe without that extra. Pin the base by digest in your own registry for
# reproducibility. No credentials are baked in: GCS access comes from Workload Identity
# (Application Default Credentials).
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${TORCH_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/rlpipe \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/hf \
    TRITON_CACHE_DIR=/cache/triton \
    CUDA_CACHE_PATH=/cache/nv

WORKDIR /opt/rlpipe
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY pipeline ./pipeline
COPY producers ./producers
COPY consumers ./consumers

# torch stays the image's own build (pinned to the installed version); everything else from pyproject.
RUN python -m pip freeze | { grep -iE '^torch==' || true; } > /tmp/engine-pins.txt \
 && python -m pip install --constraint /tmp/engine-pins.txt . \
 && rm /tmp/engine-pins.txt \
 && python -c "import torch, peft, consumers, producers" \
 && groupadd --gid 10001 rlpipe \
 && useradd --uid 10001 --gid 10001 --home-dir /home/rlpipe --create-home --shell /usr/sbin/nologin rlpipe \
 && mkdir -p /cache && chown 10001:10001 /cache

USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["rlpipe"]
CMD ["learner", "start", "--help"]
