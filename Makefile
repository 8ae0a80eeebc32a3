# The two commands of the README. Both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo tiny-demo test install clean

# The venv sees the interpreter's site-packages, so a torch the user already has
# (CUDA build included) is imported and kept. Only when no torch is importable do
# we pin the CPU-friendly wheel; an unpinned torch would pull GBs of CUDA packages.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# GRPO on the committed pretrained ShapeBench model, held-out accuracy before / after (~9 min)
demo: $(STAMP)
	$(PY) scripts/shapebench_demo.py

# the same loop on a tiny random SD3 and JPEG compressibility (under a minute)
tiny-demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests

clean:
	rm -rf $(VENV) runs
