# One place that knows how to set the project up. Everything runs from .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on these machines; an open range would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test check lint typecheck pyright demo bench clean proto

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[train,plot,dev]"
	touch $@

# The README's test command: static checks first (seconds), then the suite.
test: check
	$(VENV)/bin/pytest -q -rfER tests  # -rfER: failures, errors and reruns named in the summary

check: venv
	$(VENV)/bin/ruff check .
	$(MAKE) -s typecheck pyright

# Fixes what ruff can (import order, modern syntax); what is left it prints.
lint: venv
	$(VENV)/bin/ruff check --fix .

# The pure core (shared model, schedule, detector, planner, their CLIs and the pure helpers
# of the other packages) promises to stay clean under --strict. mypy reads resihp.* from the
# checkout through the links resihp/<folder> -> <folder>; nothing is generated.
PURE_PACKAGES := $(addprefix resihp.coordinator.,model schedule detector planner) resihp.report
PURE_MODULES := $(addprefix resihp.coordinator.,cli.detect cli.plan cli.profile service.statemachine service.joiner service.audit) \
	$(addprefix resihp.trainer_hooks.,runtime.layout runtime.docsplit reconfig.reshard checkpoint.format launch.hostfile \
	  launch.rank_env launch.watch launch.store_server launch.env_rendezvous model_source own_loop) \
	$(addprefix resihp.sim.,engine runner perf world failures scenarios detection workload workload_truth) resihp.sim.policies
typecheck: venv
	$(VENV)/bin/mypy --strict --follow-imports=silent $(foreach p,$(PURE_PACKAGES),-p $(p)) $(foreach m,$(PURE_MODULES),-m $(m))

# The whole tree, as an editor sees it (configuration in pyproject.toml).
pyright: venv
	$(VENV)/bin/basedpyright

demo: venv
	$(VENV)/bin/resihp demo

proto: venv
	$(PY) -m resihp.proto.regen

clean:
	rm -rf $(VENV) build dist *.egg-info
