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
# tree that mirrors the installed resihp.* namespace. PURE lists the decision modules that
# promise to stay clean under --strict.
PURE := $(addprefix resihp.coordinator.,spec plan trace costmodel schedule schedule_orders \
	detector detector_config detector_types detector_idle detector_probe detector_evidence detector_model detector_program detect_cli \
	cluster memory planner planner_cost planner_split planner_shares planner_groups planner_search \
	planner_levels planner_decision planner_move planner_exhaustive planner_tables planner_arrange plan_cli statemachine joiner \
	plan_audit service_audit planner_profile profile_cli) \
	resihp.trainer_hooks.layout resihp.trainer_hooks.reshard resihp.trainer_hooks.checkpoint_format resihp.trainer_hooks.hostfile \
	resihp.report_data resihp.report_summary \
	$(addprefix resihp.sim.,engine runner perf world failures scenarios detection workload workload_truth policies)
typecheck: venv
	rm -rf .mypyroot && mkdir -p .mypyroot/resihp
	for d in coordinator trainer_hooks sim agent proto; do ln -s ../../$$d .mypyroot/resihp/$$d; done
	cp resihp/__init__.py .mypyroot/resihp/__init__.py
	for f in report_data report_summary; do ln -s ../../resihp/$$f.py .mypyroot/resihp/$$f.py; done
	cd .mypyroot && ../$(VENV)/bin/mypy --strict --follow-imports=silent $(foreach m,$(PURE),-p $(m))

proto: venv
	$(PY) -m resihp.proto.regen

clean:
	rm -rf $(VENV) build *.egg-info
