# GPU image: the official vLLM 0.32 image plus the entmtp plugin (the plugin refuses any other vLLM version).
#   docker build -f docker/gpu.Dockerfile -t vllm-entmtp-gpu .
#   docker run --rm --gpus all -p 8000:8000 -v hf-cache:/root/.cache/huggingface vllm-entmtp-gpu \
#       HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config '{"method": "entmtp"}'
# The image's entrypoint is `vllm serve` (PID 1); the arguments after the image name are its arguments. Another
# target model needs MTP heads trained for it, given as "model" in --speculative-config (docs/heads.md).
# On a GPU vLLM has no tree attention: entmtp schedules chains per request (README, Limits).
# --no-deps: the image's torch and vLLM stay as they are. Serving imports only what vLLM itself depends on (torch,
# transformers, numpy, pydantic, safetensors); the CLI's plotting (matplotlib) and `vllm-entmtp prepare`'s GGUF
# reader are not needed to serve. Not built here (no Docker daemon on the project's machines): see docs/deploy.md.
FROM vllm/vllm-openai:v0.32.0

COPY . /opt/vllm-entmtp
RUN pip install --no-cache-dir --no-deps /opt/vllm-entmtp
