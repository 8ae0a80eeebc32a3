# The two commands of the README. Both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := constraints.txt

.PHONY: demo tiny-demo test gpu-check install lock clean

# The venv sees the interpreter's site-packages, so a torch the user already has
# (CUDA build included) is imported and kept. Only when no torch is importable do
# we pin the CPU-friendly wheel; an unpinned torch would pull GBs of CUDA packages.
# Everything else comes at the versions of the lock (constraints.txt, which leaves
# torch and what only torch needs alone), installed into the venv over any other
# version the interpreter has; the last line checks that they are what is installed.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -c $(LOCK) "torch==2.13.0"
	$(PY) -m pip install -c $(LOCK) -e ".[dev]"
	$(PY) scripts/lock.py --check $(LOCK)
	touch $(STAMP)

install: $(STAMP)

# rewrite the lock: the newest versions pyproject.toml allows, resolved in a fresh venv
# without system packages (a few minutes); then `make test` and commit constraints.txt
lock:
	$(PYTHON) scripts/lock.py --refresh $(LOCK)

# GRPO on the committed pretrained ShapeBench model, held-out accuracy before / after (~9 min)
demo: $(STAMP)
	$(PY) scripts/shapebench_demo.py

# the same loop on a tiny random SD3 and JPEG compressibility (under a minute)
tiny-demo: $(STAMP)
	$(PY) scripts/demo.py

# two pytest-xdist workers, a test file each at a time (a file's module fixtures and its
# multi-process runs stay together); every worker runs torch on one thread (tests/conftest.py).
# More cores: make test TEST_WORKERS=8
TEST_WORKERS ?= 2
test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the GPU path on the first GPU at hand, under 8 minutes: precision-sensitive tests on CUDA, every tiny family in
# bf16, a FLUX.1-dev-sized training step; prints a table and appends it to docs/experiments/gpu.md.
# No GPU: make gpu-check GPU_CHECK_DEVICE=cpu (the CPU-possible parts, in bf16)
GPU_CHECK_DEVICE ?= cuda
gpu-check: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) bench/gpu_check.py --device $(GPU_CHECK_DEVICE)

clean:
	rm -rf $(VENV) runs
