"""torchrun-style scripts under ``resihp launch``: their ``env://`` rendezvous joins the job's
authenticated store.

torch's ``env://`` handler makes a plain ``TCPStore`` client of ``MASTER_ADDR:MASTER_PORT``,
which cannot prove a credential, and the job's store (launch/store_server.py) answers no
client that cannot. So the rank shim (rank_env.py) puts ``_site/`` on the script's
PYTHONPATH; its ``sitecustomize`` calls ``install()``, which waits for torch to load
``torch.distributed.rendezvous`` and then puts a handler in front of torch's own: where
``MASTER_ADDR:MASTER_PORT`` is the job's store it hands ``init_process_group`` an
``AuthStore`` (credential ``$RESIHP_RANK_TOKEN``), anywhere else it defers to torch's
handler. Nothing is imported until torch itself is.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

HOOK_ENV = "RESIHP_ENV_RENDEZVOUS"
SITE_DIR = Path(__file__).resolve().with_name("_site")
STORE_ADDR_ENV = "RESIHP_STORE_ADDR"
_TARGET = "torch.distributed.rendezvous"


def site_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the rank shim adds to a rank's environment so that its ``env://`` joins the job's
    store: nothing unless MASTER_ADDR:MASTER_PORT is that store and the rank holds a credential."""
    master = f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"
    if not environ.get(STORE_ADDR_ENV) or master != environ[STORE_ADDR_ENV] or not environ.get("RESIHP_RANK_TOKEN"):
        return {}
    path = environ.get("PYTHONPATH", "")
    return {HOOK_ENV: "1", "PYTHONPATH": f"{SITE_DIR}{os.pathsep}{path}" if path else str(SITE_DIR)}


def _is_job_store(environ: Mapping[str, str]) -> bool:
    return bool(site_env(environ))


def _handler(torch_env: Any) -> Any:
    def env_handler(url: str, timeout: timedelta | None = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if not _is_job_store(os.environ):
            yield from torch_env(url, **({"timeout": timeout} if timeout is not None else {}), **kwargs)
            return
        from urllib.parse import parse_qsl, urlparse

        from resihp.trainer_hooks.launch.store_client import connect

        query = dict(parse_qsl(urlparse(url).query))
        rank = int(query.get("rank", os.environ["RANK"]))
        world = int(query.get("world_size", os.environ["WORLD_SIZE"]))
        yield connect(os.environ[STORE_ADDR_ENV], timeout or timedelta(minutes=30)), rank, world
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")  # as torch's handler

    return env_handler


def _register(module: ModuleType) -> None:
    handlers = module._rendezvous_handlers
    handlers["env"] = _handler(handlers["env"])


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``_register`` right after torch executes its rendezvous module (once)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _register(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Hook torch's ``env://`` rendezvous (now if torch loaded it already, else when it does)."""
    loaded = sys.modules.get(_TARGET)
    if loaded is not None:
        _register(loaded)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
