# dsv4lab — set-up, tests and the headless reproduction. Every target installs what it needs first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
# Every other dependency is pinned here, so CI cannot change colour without a commit; `make constraints` refreshes it.
CONSTRAINTS ?= constraints.txt

.PHONY: install constraints test test-fast reproduce lab browser-deps tiny clean-runs help

help:
	@echo "make install       create $(VENV) and install dsv4lab with all extras (idempotent)"
	@echo "make constraints   re-resolve every dependency in a fresh venv and rewrite $(CONSTRAINTS) (then run make test)"
	@echo "make test          the whole test suite (what CI runs)"
	@echo "make test-fast     the suite without the slow, browser, notebook and distributed tests"
	@echo "make reproduce     every notebook headless on data/tiny-py (data/tiny without it) into runs/<UTC stamp>_<commit>/"
	@echo "make lab           JupyterLab on notebooks/: the .py text notebooks open as notebooks and save output-free"
	@echo "make browser-deps  Debian's chromium, for the JupyterLab browser tests"
	@echo "make tiny          regenerate data/tiny byte-for-byte"
	@echo "make clean-runs    delete runs/ and scratch/ (where notebooks run by hand write)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first: a bare "torch" requirement would pull a multi-GB CUDA build. Keep an existing torch
# (a CUDA or ROCm build installed beforehand); otherwise install the CPU wheel.
install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[all]"
	@$(PY) -c "import dsv4lab, torch; print('dsv4lab', dsv4lab.__version__, '| torch', torch.__version__)"

# Debian's chromium for the JupyterLab browser test (playwright cannot download its own browser here).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# The newest releases that satisfy pyproject.toml, resolved in a throw-away venv. torch, triton and the CUDA
# libraries stay out: they come with the accelerator's torch build (the CPU wheel is pinned above).
constraints:
	rm -rf .venv-constraints && $(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade pip
	.venv-constraints/bin/python -m pip install -q $(TORCH_CPU)
	.venv-constraints/bin/python -m pip install -q -e ".[all]"
	@{ echo "# Pinned by 'make constraints' on $$(date -u +%F) (Python $$(.venv-constraints/bin/python -c 'import platform; print(platform.python_version())')); used by make install and CI."; \
	   echo "# torch, triton and nvidia-* are left to the installed accelerator build."; \
	   .venv-constraints/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|triton|nvidia-|dsv4lab)[=_ -]'; } > $(CONSTRAINTS)
	rm -rf .venv-constraints
	@echo "wrote $(CONSTRAINTS): run 'make test' on it before committing"

# Two tests at a time per worker (--maxschedchunk 2): the long tests, sorted first (tests/conftest.py), then go out one
# by one to whichever worker is free; xdist's default first hands each worker a quarter of its share in one block,
# which put every long test on the same worker.
test: install
	$(PY) -m pytest -q -n auto --dist load --maxschedchunk 2 --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow and not browser and not notebooks and not distributed"

reproduce: install
	$(PY) -m dsv4lab reproduce

# notebooks/jupyter_config makes jupytext's notebook view the default for .py files (docs/notebooks.md).
lab: install
	JUPYTER_CONFIG_PATH=$(CURDIR)/notebooks/jupyter_config $(PY) -m jupyterlab notebooks/

tiny: install
	$(PY) -m dsv4lab make-checkpoint --preset tiny --seed 0 --out data/tiny --overwrite

clean-runs:
	rm -rf runs/ scratch/
