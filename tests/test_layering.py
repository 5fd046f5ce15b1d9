"""The layering promises: decisions import neither torch, grpc nor MPI; the agent never
imports torch. (``make check`` holds the pure core to ``mypy --strict``.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The pure core: whole sub-packages (a module added to one is covered without a list to edit)
# and the pure helpers that live beside impure code.
PURE_PACKAGES = ["coordinator/model", "coordinator/schedule", "coordinator/detector", "coordinator/planner"]
PURE_HELPERS = [
    "resihp.coordinator.cli.detect", "resihp.coordinator.cli.plan", "resihp.coordinator.cli.profile",
    "resihp.coordinator.service.statemachine", "resihp.coordinator.service.joiner", "resihp.coordinator.service.audit",
    "resihp.trainer_hooks.runtime.layout", "resihp.trainer_hooks.reconfig.reshard",
    "resihp.trainer_hooks.checkpoint.format", "resihp.trainer_hooks.launch.hostfile",
    "resihp.report.data", "resihp.report.summary",
    "resihp.sim.engine", "resihp.sim.runner", "resihp.sim.workload",
]


def pure_modules() -> list[str]:
    found = []
    for folder in PURE_PACKAGES:
        package = "resihp." + folder.replace("/", ".")
        found += [package] + [f"{package}.{p.stem}" for p in sorted((REPO / folder).glob("*.py")) if p.stem != "__init__"]
    return found + PURE_HELPERS


PURE = pure_modules()

# Makes any import of the named top-level packages fail, as on a machine without them.
BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def __init__(self, names): self.names = names
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in self.names:
            raise ImportError(f'layering: {name} imported')
        return None
sys.meta_path.insert(0, Block(set(sys.argv[1].split(','))))
import importlib
for mod in sys.argv[2:]:
    importlib.import_module(mod)
print('ok', len(sys.argv) - 2)
"""


def _import_without(blocked: str, modules: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, blocked, *modules], capture_output=True, text=True, timeout=120
    )


def test_pure_modules_import_without_torch_grpc_or_mpi() -> None:
    done = _import_without("torch,grpc,mpi4py,google", PURE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"ok {len(PURE)}"


def test_agent_never_imports_torch() -> None:
    agent = [f"resihp.agent.{p.stem}" for p in sorted((REPO / "agent").glob("*.py")) if p.stem != "__init__"]
    done = _import_without("torch,mpi4py", agent)
    assert done.returncode == 0, done.stderr[-2000:]


def test_blocker_really_blocks() -> None:
    done = _import_without("torch", ["resihp.trainer_hooks.runtime.model"])
    assert done.returncode != 0 and "layering: torch imported" in done.stderr
