"""Shared test helpers."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def resihp_exe() -> str:
    """The installed console script of the interpreter running the tests."""
    exe = VENV_BIN / "resihp"
    return str(exe) if exe.exists() else "resihp"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
