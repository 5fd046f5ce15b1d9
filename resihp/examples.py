"""Where the example scripts are, in a checkout or installed from a wheel, and ``resihp examples``.

In a checkout they are ``examples/`` beside the package. A wheel installs the same files as
data under ``<prefix>/share/resihp/examples`` (setup.py's ``data_files``): they are scripts a
user runs and edits, not modules of the package.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

SHARE = Path("share") / "resihp" / "examples"


def candidates() -> list[Path]:
    """Where the examples may be, in the order they are looked for."""
    checkout = Path(__file__).resolve().parents[1] / "examples"
    prefixes = [sysconfig.get_paths()["data"], sys.prefix, sys.base_prefix]
    return [checkout] + [Path(p) / SHARE for p in dict.fromkeys(prefixes)]


def examples_dir() -> Path:
    """The folder holding ``train_gpt.py`` and the other examples."""
    for folder in candidates():
        if (folder / "train_gpt.py").is_file():
            return folder
    raise FileNotFoundError(
        "resihp: the example scripts were not found (looked in "
        + ", ".join(str(p) for p in candidates())
        + "); reinstall the wheel, or run from a checkout of the repository")


def example(relative: str) -> Path:
    """One example file, e.g. ``example("train_gpt.py")`` or ``example("llama/train.py")``."""
    path = examples_dir() / relative
    if not path.is_file():
        raise FileNotFoundError(f"resihp: no example {relative!r} in {path.parent}")
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="resihp examples", description="Print where the example training scripts "
                                 "are (a checkout's examples/ or the wheel's copy), or copy them to a folder.")
    ap.add_argument("--copy", metavar="DIR", default="", help="copy the examples into DIR (created; must not exist)")
    args = ap.parse_args(argv)
    try:
        folder = examples_dir()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not args.copy:
        print(folder)
        return 0
    target = Path(args.copy)
    if target.exists():
        print(f"resihp examples: {target} exists; name a new folder", file=sys.stderr)
        return 2
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"copied {folder} to {target}")
    return 0
