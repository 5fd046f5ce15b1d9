"""Multi-node: agents and trainers in two network namespaces with their own addresses.

Each namespace gets a veth pair to the host namespace in a private test subnet
(10.213.N.0/24) created here and removed afterwards. Skipped, with the reason, where
``ip netns`` is not allowed (no root, no CAP_NET_ADMIN, no iproute2).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cp_helpers import Cluster, wait_until


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def namespaces() -> Iterator[list[tuple[str, str]]]:
    """Two namespaces; yields [(name, host-side address the namespace reaches the host on)]."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    tag = f"{os.getpid() % 100000}"
    made: list[str] = []
    out: list[tuple[str, str]] = []
    try:
        for i, suffix in enumerate("ab", start=1):
            ns = f"rhp{tag}{suffix}"
            res = _ip("netns", "add", ns)
            if res.returncode != 0:
                pytest.skip(f"'ip netns add' is not allowed here: {res.stderr.strip()}")
            made.append(ns)
            host_if, ns_if = f"rh{tag}{suffix}0", f"rh{tag}{suffix}1"
            net = f"10.213.{(int(tag) % 50) * 4 + i}"
            for cmd in (["link", "add", host_if, "type", "veth", "peer", "name", ns_if],
                        ["link", "set", ns_if, "netns", ns], ["addr", "add", f"{net}.1/24", "dev", host_if],
                        ["link", "set", host_if, "up"], ["-n", ns, "addr", "add", f"{net}.2/24", "dev", ns_if],
                        ["-n", ns, "link", "set", ns_if, "up"], ["-n", ns, "link", "set", "lo", "up"]):
                res = _ip(*cmd)
                if res.returncode != 0:
                    pytest.skip(f"cannot set up veth for {ns}: ip {' '.join(cmd)}: {res.stderr.strip()}")
            out.append((ns, f"{net}.1"))
        yield out
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # removes the namespace's veth end and with it the pair


def test_agents_in_two_network_namespaces_report_to_one_coordinator(
        tmp_path: Path, namespaces: list[tuple[str, str]]) -> None:
    c = Cluster(tmp_path, world=4, pp=2, heartbeat_timeout_s=2.0)
    try:
        addr = c.start_coordinator(host="0.0.0.0")
        port = addr.rsplit(":", 1)[1]
        (ns_a, host_a), (ns_b, host_b) = namespaces
        c.start_agent("nodeA", coordinator=f"{host_a}:{port}", netns=ns_a)
        c.start_agent("nodeB", coordinator=f"{host_b}:{port}", netns=ns_b)
        c.start_trainer("ta", [0, 1], "nodeA")
        c.start_trainer("tb2", [2], "nodeB")
        c.start_trainer("tb3", [3], "nodeB")
        st = wait_until(lambda: (s := c.status()).iteration >= 5 and s.agents_connected == 2 and s, 40,
                        "both namespaces reporting")
        assert {r.rank: r.node for r in st.ranks} == {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"}
        regs = {e["node"]: e for e in c.events("agent-registered")}
        assert set(regs) >= {"nodeA", "nodeB"}
        t_kill = c.kill("tb3")
        f = wait_until(lambda: [f for f in c.events("finding") if f["ranks"] == [3]], 60, "fail-stop across netns")[0]
        assert f["kind"] == "fail-stop" and f["time"] - t_kill < 1.0
    finally:
        codes = c.close()
    assert codes["tb3"] == -signal.SIGKILL and codes["coordinator"] == 0
