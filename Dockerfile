# CPU image: vLLM's CPU build with the entmtp plugin, serving the default model (SmolLM2-135M-Instruct).
#   docker build -t vllm-entmtp .
#   docker run --rm -p 8000:8000 vllm-entmtp
# torch==2.13.0+cpu comes from PyTorch's CPU wheel index (PyPI's torch 2.13.0 is a CUDA build).
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    VLLM_ENTMTP_CACHE=/cache \
    HF_HUB_OFFLINE=1
WORKDIR /app
COPY . /app
RUN make setup PYTHON=python3.11 && .venv/bin/vllm-entmtp prepare
EXPOSE 8000
CMD ["make", "serve", "HOST=0.0.0.0", "PORT=8000"]
