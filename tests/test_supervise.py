"""The launcher's supervision of its daemons (trainer_hooks/launch/supervise.py), with real
short-lived processes and a clock the test moves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resihp.trainer_hooks.launch.supervise import Supervisor, pin_option


def _proc(code: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])


def test_a_dead_daemon_is_restarted_after_its_backoff_until_the_budget_is_spent(tmp_path: Path) -> None:
    now = [0.0]
    started: list[list[str]] = []

    def start(argv: list[str], env: object, log: object) -> subprocess.Popen[bytes]:
        started.append(argv)
        return _proc(7)

    sup = Supervisor(tmp_path / "events.jsonl", "job", budget=2, backoff_s=(1.0, 4.0), clock=lambda: now[0],
                     start=start)
    first = _proc(9)
    first.wait()
    sup.add("agent node1", ["resihp", "agent", "--hook-address", "127.0.0.1:5000"], {}, tmp_path / "a.log", first)
    assert "restart 1 of 2 in 1.0 s" in sup.poll()[0] and started == []
    now[0] = 0.5
    assert sup.poll() == []  # inside the backoff
    now[0] = 1.0
    assert "restarted" in sup.poll()[0] and started == [["resihp", "agent", "--hook-address", "127.0.0.1:5000"]]
    sup.daemons[0].proc.wait()
    assert "restart 2 of 2 in 4.0 s" in sup.poll()[0]
    now[0] = 5.0
    sup.poll()
    sup.daemons[0].proc.wait()
    assert "budget (2) is spent" in sup.poll()[0]
    assert sup.poll() == []  # given up: said once
    kinds = [json.loads(x)["event"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kinds == ["daemon-exited", "daemon-restarted", "daemon-exited", "daemon-restarted", "daemon-gave-up"]
    assert all(json.loads(x)["source"] == "launcher" for x in (tmp_path / "events.jsonl").read_text().splitlines())


def test_a_running_daemon_is_left_alone_and_options_are_pinned(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sup = Supervisor(tmp_path / "events.jsonl", "job")
        sup.add("coordinator", ["c"], {}, tmp_path / "c.log", live)
        assert sup.poll() == [] and not (tmp_path / "events.jsonl").exists()
    finally:
        live.kill()
        live.wait()
    assert pin_option(["x", "--port", "0", "--y"], "--port", "4242") == ["x", "--port", "4242", "--y"]
    assert pin_option(["x"], "--metrics-port", "81") == ["x", "--metrics-port", "81"]
    with pytest.raises(ValueError, match="restart budget must be >= 0"):
        Supervisor(tmp_path / "e", "job", budget=-1)


def test_a_restarted_store_takes_its_address_back_and_clients_reconnect_to_it() -> None:
    """kill -9 of the store: restarted empty on the same address and credential, a client's
    next call after the failed one reaches it (what the old store held is gone)."""
    import os
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    from resihp.trainer_hooks.launch.store_client import AuthStore
    from resihp.trainer_hooks.reconfig.ulfm import StoreProcess

    store = StoreProcess(credential="c" * 64)
    try:
        client = AuthStore(store.host, store.port, "c" * 64, timedelta(seconds=10))
        client.set("before", "1")
        port, old = store.port, store.proc.pid
        os.kill(old, signal.SIGKILL)
        store.proc.wait(10)
        with pytest.raises(dist.DistNetworkError, match="Connection closed"):
            client.get("before")
        proc = store.restart()
        assert store.port == port and proc.pid != old
        client.set("after", "2")
        assert client.get("after") == b"2" and not client.check(["before"])
        client.close()
    finally:
        store.close()
