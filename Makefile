# make demo: tiny GPT-MoE pretraining with `mok` (GPU when present, CPU otherwise)
# make test: the test suite (GPU tests skip without a GPU)
# Both create .venv (Python >= 3.12), install the dependencies and build the extension.

VENV      := .venv
PY        := $(VENV)/bin/python
PYTHON312 ?= $(shell scripts/find_python312.sh)
DEPS      := torch==2.11.0 "megatron-core>=0.19,<0.20" nvidia-cutlass==4.2.0.0 ninja numpy pytest psutil pyflakes
CSRC      := $(shell find csrc -type f)

.PHONY: install demo test test-gpu gpu-check clean reliability

$(VENV)/.deps:
	@test -n "$(PYTHON312)" || { echo "need Python >= 3.12 (set PYTHON312=...)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel "setuptools<82"
	$(PY) -m pip install -q $(DEPS)
	touch $@

# Builds the CUDA extension whenever nvcc is found (no GPU needed: sm_90a is fixed).
$(VENV)/.built: $(VENV)/.deps setup.py $(CSRC)
	TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$${MAX_JOBS:-2} $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

demo: install
	PYTHON=$(PY) bash examples/demo.sh

test: install
	$(PY) -m pytest -q -ra tests

test-gpu: install
	$(PY) -m pytest -q -ra -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info megatron_mok/_C*.so

# The reliability suite (docs/reliability.md): its CPU half anywhere, its GPU half
# (fuzz, overflow at EP 2/4/8, watchdog, soak, CUDA graphs) where a GPU is present.
reliability: install
	$(PY) -m pytest -q -ra tests/reliability
