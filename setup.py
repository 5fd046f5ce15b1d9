"""resihp: resilient hybrid-parallel LLM training runtime.

Metadata and tool configuration live in pyproject.toml. This file keeps the design card's
layout: the top-level folders (agent/, proto/, trainer_hooks/, coordinator/, sim/) install
under the one ``resihp`` namespace through ``package_dir``, so the installed package never
claims generic top-level names such as ``proto`` or ``agent``. Every sub-package below them is
discovered, never listed, so a new one cannot be left out of the wheel.
"""
from pathlib import Path

from setuptools import find_packages, setup

# resihp.<name> is installed from the top-level folder <name>/. resihp/<name> is a link to the
# same folder, there only so that editors and type checkers can follow imports in a checkout.
NAMESPACE_FOLDERS = ("agent", "proto", "trainer_hooks", "coordinator", "sim")


def discover() -> tuple[list[str], dict[str, str]]:
    linked = NAMESPACE_FOLDERS + tuple(f"{name}.*" for name in NAMESPACE_FOLDERS)
    found = ["resihp"] + [f"resihp.{p}" for p in find_packages("resihp", exclude=linked)]
    package_dir = {"resihp": "resihp"}
    for name in NAMESPACE_FOLDERS:
        found += [f"resihp.{name}"] + [f"resihp.{name}.{p}" for p in find_packages(name)]
        package_dir[f"resihp.{name}"] = name
    return sorted(found), package_dir


def example_files() -> list[tuple[str, list[str]]]:
    """The example scripts and their inputs, installed as data under
    <prefix>/share/resihp/examples: `resihp demo` runs train_gpt.py from there when resihp comes
    from a wheel (resihp/examples.py finds them), and users copy them (`resihp examples --copy`)."""
    by_folder: dict[str, list[str]] = {}
    for path in sorted(Path("examples").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".md", ".json", ".jsonl"):
            by_folder.setdefault(str(Path("share", "resihp") / path.parent), []).append(str(path))
    return sorted(by_folder.items())


PACKAGES, PACKAGE_DIR = discover()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"": ["py.typed"], "resihp.proto": ["*.proto", "*.pyi"]},
    data_files=example_files(),
)
