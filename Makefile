# One place that knows how to set the project up. Everything runs from .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on these machines; an open range would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test demo bench clean proto typecheck

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[train,plot,dev]"
	touch $@

test: venv
	$(VENV)/bin/pytest -q tests

demo: venv
	$(VENV)/bin/resihp demo

typecheck: venv
	$(VENV)/bin/mypy --strict coordinator

proto: venv
	$(PY) -m resihp.proto.regen

clean:
	rm -rf $(VENV) build *.egg-info
