# CPU image: vLLM's CPU build with the entmtp plugin, serving the default model (SmolLM2-135M-Instruct).
#   docker build -t vllm-entmtp .
#   docker run --rm -p 8000:8000 -v entmtp-cache:/cache vllm-entmtp
#   docker run --rm -p 9000:9000 -e PORT=9000 -e DTYPE=float32 -e VLLM_CPU_KVCACHE_SPACE=8 -v entmtp-cache:/cache vllm-entmtp
# The install is `make setup`, the step CI runs on a clean clone (.ci/run -> make test -> make setup). The start
# command is tools/serve.sh, which ends in `exec vllm serve`: vLLM's server is PID 1. Its environment (HOST, PORT,
# DTYPE, MEM_UTIL, VLLM_CPU_KVCACHE_SPACE, MODEL, SPECULATIVE_CONFIG, SERVE_ARGS) is listed in its header; DTYPE
# left unset is chosen at start from the host's CPU flags. /cache keeps vLLM's torch.compile cache between runs, and
# the plugin's kernels, built with g++ at the first start (for AVX-512F or AVX2, by the CPU).
# torch==2.13.0+cpu comes from PyTorch's CPU wheel index (PyPI's torch 2.13.0 is a CUDA build).
# A GPU image: docker/gpu.Dockerfile.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    VLLM_ENTMTP_CACHE=/opt/vllm-entmtp \
    VLLM_CACHE_ROOT=/cache/vllm \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    HF_HUB_OFFLINE=1 \
    HOST=0.0.0.0 \
    PORT=8000 \
    VLLM_CPU_KVCACHE_SPACE=4
WORKDIR /app
COPY . /app
RUN make setup PYTHON=python3.11 && .venv/bin/vllm-entmtp prepare
VOLUME ["/cache"]
EXPOSE 8000
CMD ["tools/serve.sh"]
