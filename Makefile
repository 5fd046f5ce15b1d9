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

# mypy cannot follow the editable install's package_dir mapping, so it checks a symlink
# tree that mirrors the installed resihp.* namespace.
PURE_MODULES ?= spec plan trace costmodel schedule schedule_orders
typecheck: venv
	rm -rf .mypyroot && mkdir -p .mypyroot/resihp
	ln -s ../../coordinator .mypyroot/resihp/coordinator
	cp resihp/__init__.py .mypyroot/resihp/__init__.py
	cd .mypyroot && ../$(VENV)/bin/mypy --strict $(foreach m,$(PURE_MODULES),-p resihp.coordinator.$(m))

proto: venv
	$(PY) -m resihp.proto.regen

clean:
	rm -rf $(VENV) build *.egg-info
