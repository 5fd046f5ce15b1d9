"""Python runs this at start-up when launch/rank_env.py put this folder on PYTHONPATH: the
script's ``env://`` rendezvous then joins the job's authenticated store (env_rendezvous.py).
Nothing heavy is imported here; any ``sitecustomize`` this one shadows still runs."""
from __future__ import annotations

import os


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path, the one this file shadows."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("RESIHP_ENV_RENDEZVOUS") == "1":
    try:
        from resihp.trainer_hooks.launch.env_rendezvous import install

        install()
    except ImportError:  # resihp is not importable by this interpreter: nothing to hook
        pass
_chain()
