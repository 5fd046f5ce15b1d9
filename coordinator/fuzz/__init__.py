"""Hostile and malformed input for resihp's daemons: adversarial cases per RPC (``cases``), a
runner that sends them at live servers and judges the answers (``runner``), and the same for
the job's store (``store``). Importable without torch; ``bench/chaos.py`` uses it."""
from resihp.coordinator.fuzz.cases import Case, CaseGenerator, Target
from resihp.coordinator.fuzz.runner import FuzzResult, fuzz_endpoints

__all__ = ["Case", "CaseGenerator", "FuzzResult", "Target", "fuzz_endpoints"]
