#!/usr/bin/env bash
# Serve a model with entmtp: the one start command behind `make serve` and the CPU Docker image. It ends in
# `exec vllm serve ...`, so vLLM's server is this process (PID 1 in a container: it gets the stop signal).
#
# Environment (all optional):
#   MODEL                   model folder, or a hub name with HF_HUB_OFFLINE=0 (default: the prepared default model,
#                           SmolLM2-135M-Instruct, which `vllm-entmtp prepare` dequantises into $VLLM_ENTMTP_CACHE/models/)
#   SERVED_MODEL_NAME       the name clients send (default: SmolLM2-135M-Instruct for the default model)
#   HOST, PORT              where to listen (127.0.0.1, 8000)
#   DTYPE                   the target's dtype (default: auto on a CPU with AVX-512 BF16, float32 elsewhere:
#                           without native bfloat16 GEMMs verifying draft tokens costs ~one step per row)
#   MEM_UTIL                vLLM's --gpu-memory-utilization (0.5; on CPU the share of the NUMA node's memory that
#                           must be free at start-up)
#   VLLM_CPU_KVCACHE_SPACE  KV cache on CPU, GiB (4)
#   SPECULATIVE_CONFIG      the --speculative-config JSON ('{"method": "entmtp"}')
#   SERVE_ARGS              more `vllm serve` arguments, split on spaces
#   VENV                    a virtual environment whose vllm and vllm-entmtp to run (default: ./.venv if it
#                           exists, else the commands on PATH)
#   ENTMTP_SERVE_DRY_RUN=1  print the command, one argument per line, instead of running it
set -euo pipefail

VENV=${VENV:-$( [ -x .venv/bin/vllm ] && echo .venv || true )}
BIN=${VENV:+$VENV/bin/}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MEM_UTIL=${MEM_UTIL:-0.5}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
if [ -z "${DTYPE:-}" ]; then
    if grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null; then DTYPE=auto; else DTYPE=float32; fi
fi
SPECULATIVE_CONFIG=${SPECULATIVE_CONFIG:-'{"method": "entmtp"}'}
if [ -z "${MODEL:-}" ]; then
    PY=${BIN:+${BIN}python}
    MODEL=$("${BIN}vllm-entmtp" prepare --json | "${PY:-python3}" -c 'import json, sys; print(json.load(sys.stdin)["model"])')
    SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-SmolLM2-135M-Instruct}
fi

cmd=("${BIN}vllm" serve "$MODEL" --host "$HOST" --port "$PORT" --gpu-memory-utilization "$MEM_UTIL"
     --dtype "$DTYPE" --speculative-config "$SPECULATIVE_CONFIG")
if [ -n "${SERVED_MODEL_NAME:-}" ]; then cmd+=(--served-model-name "$SERVED_MODEL_NAME"); fi
# shellcheck disable=SC2206  # SERVE_ARGS is split on purpose
if [ -n "${SERVE_ARGS:-}" ]; then set -f; cmd+=($SERVE_ARGS); set +f; fi  # split on spaces, no globbing
if [ "${ENTMTP_SERVE_DRY_RUN:-}" = 1 ]; then printf '%s\n' "${cmd[@]}"; exit 0; fi
exec "${cmd[@]}"
