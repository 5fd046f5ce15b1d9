"""A cluster of "nodes" on one machine, for multi-node tests: one network namespace per node.

Each node gets its own network namespace (its own address on a private bridge, its own
loopback), its own host name (a UTS namespace per launched command) and its own
``/etc/netns/<node>/hosts`` naming every node, so MPI, gloo and the agents see separate
machines joined by a real (virtual) network: traffic between nodes crosses the bridge,
traffic inside a node stays on its loopback. ``mpirun`` reaches the nodes through its ssh
launcher with ``plm_ssh_agent`` set to a stand-in for ssh that runs the command in the
node's namespaces (``ssh_agent``): Open MPI's own remote launch path (prted on every node,
its out-of-band wiring back to mpirun), only the transport differs.

Building it needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; ``NetnsCluster.create``
raises ``ClusterUnavailable`` with the reason otherwise, which tests turn into a skip.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SSH_AGENT = """#!/bin/sh
# a stand-in for ssh: run the command in the named node's namespaces (tests/netns_cluster.py)
while [ $# -gt 0 ]; do
  case "$1" in -o|-p|-l|-i) shift 2;; -*) shift;; *) break;; esac
done
host="$1"; shift
case " {nodes} " in *" $host "*) ;; *) echo "ssh stand-in: unknown node $host" >&2; exit 255;; esac
exec ip netns exec "$host" unshare --uts -- /bin/sh -c "hostname $host && $*"
"""


_made_clusters = 0


class ClusterUnavailable(RuntimeError):
    """This machine cannot build namespaces (no root, no iproute2, no bridge support)."""


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise ClusterUnavailable(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")


@dataclass
class NetnsCluster:
    nodes: tuple[str, ...]
    addresses: dict[str, str]
    head: str  # the host namespace's address on the bridge (where coordinator and store run)
    subnet: str
    bridge: str
    ssh_agent: Path
    _made: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, workdir: Path, count: int = 2) -> NetnsCluster:
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise ClusterUnavailable("iproute2 ('ip') and util-linux ('unshare') are needed")
        if os.geteuid() != 0:
            raise ClusterUnavailable("network namespaces need root")
        global _made_clusters
        _made_clusters += 1  # several clusters in one process get distinct names
        tag = (os.getpid() * 7 + _made_clusters) % 10000
        net = f"10.215.{tag % 250}"
        bridge = f"rbr{tag}"
        nodes = tuple(f"rn{tag}n{i}" for i in range(1, count + 1))
        addresses = {node: f"{net}.{10 + i}" for i, node in enumerate(nodes, start=1)}
        workdir.mkdir(parents=True, exist_ok=True)
        agent = workdir / "ssh-netns"
        agent.write_text(SSH_AGENT.replace("{nodes}", " ".join(nodes)))
        agent.chmod(0o755)
        c = cls(nodes, addresses, f"{net}.1", f"{net}.0/24", bridge, agent)
        try:
            _ip("link", "add", bridge, "type", "bridge")
            c._made.append(f"link:{bridge}")
            _ip("addr", "add", f"{c.head}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in addresses.items())
            for i, node in enumerate(nodes, start=1):
                _ip("netns", "add", node)
                c._made.append(f"netns:{node}")
                etc = Path("/etc/netns") / node
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts)
                # no resolver inside: a name lookup that misses the hosts file fails at once
                # instead of waiting on a DNS server the namespace cannot reach
                (etc / "resolv.conf").write_text("# no DNS in the test's node namespaces\n")
                veth = f"{bridge}v{i}"
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node)
                c._made.append(f"link:{veth}")
                _ip("link", "set", veth, "master", bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", node, "addr", "add", f"{addresses[node]}/24", "dev", "eth0")
                _ip("-n", node, "link", "set", "eth0", "up")
                _ip("-n", node, "link", "set", "lo", "up")
        except ClusterUnavailable:
            c.close()
            raise
        return c

    def veth(self, node: str) -> str:
        """The bridge-side end of ``node``'s link."""
        return f"{self.bridge}v{self.nodes.index(node) + 1}"

    def link_bytes(self, node: str) -> int:
        """Bytes that crossed ``node``'s link so far, both directions."""
        stats = Path("/sys/class/net") / self.veth(node) / "statistics"
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def throttle_link(self, node: str, mbit: float) -> None:
        """Shape ``node``'s link to ``mbit`` Mbit/s both ways (a token bucket on each end of its
        veth pair): a real, kernel-enforced slow NIC, as congestion or a degraded port makes."""
        for where in ([], ["-n", node]):
            dev = "eth0" if where else self.veth(node)
            res = subprocess.run(["tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                                  "burst", "16kb", "latency", "200ms"], capture_output=True, text=True, timeout=20)
            if res.returncode != 0:
                raise ClusterUnavailable(f"tc cannot shape {dev}: {res.stderr.strip()}")

    def clear_link(self, node: str) -> None:
        for where in ([], ["-n", node]):
            dev = "eth0" if where else self.veth(node)
            subprocess.run(["tc", *where, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=20)

    def hostfile(self, path: Path, slots: int) -> Path:
        path.write_text("".join(f"{n} slots={slots}\n" for n in self.nodes))
        return path

    def mpirun_args(self) -> list[str]:
        """What mpirun needs to reach these nodes: the ssh stand-in, and the bridge's subnet for
        its own wiring and for MPI's TCP transport."""
        return ["--prtemca", "plm_ssh_agent", str(self.ssh_agent), "--prtemca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet]

    def launch_command(self, run: Path, hostfile: Path, job: Sequence[str], coordinator: Sequence[str],
                       train: Sequence[str]) -> list[str]:
        """``resihp launch`` of ``train`` on these nodes: ``job`` its layout options, ``coordinator``
        extra coordinator arguments. The coordinator gets the demo's description of a CPU
        machine (its device profile and detection policy) unless ``coordinator`` overrides it."""
        from resihp.demo import CPU_CLUSTER, CPU_POLICY

        profile = run.parent / f"{run.name}-cpu-cluster.json"
        profile.write_text(json.dumps(CPU_CLUSTER))
        line = [sys.executable, "-m", "resihp.cli", "launch", *job, "--hostfile", str(hostfile), "--head-address",
                self.head, "--gpu-sampler", "off", "--heartbeat-timeout-s", "3", "--run-dir", str(run),
                "--finalize-grace-s", "3"]
        line += [f"--mpirun-arg={a}" for a in self.mpirun_args()]
        line += [f"--coordinator-arg=--cluster={profile}"] + [f"--coordinator-arg=--policy={p}" for p in CPU_POLICY]
        return line + [f"--coordinator-arg={a}" for a in coordinator] + ["--", *train]

    def close(self) -> None:
        for item in reversed(self._made):
            kind, name = item.split(":", 1)
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=20)
        self._made.clear()


@contextmanager
def cluster_or_skip(workdir: Path, count: int) -> Iterator[NetnsCluster]:
    """A cluster of ``count`` nodes for a test, removed afterwards; the test is skipped, with the
    reason, where this machine cannot build one."""
    import pytest

    try:
        cluster = NetnsCluster.create(workdir, count)
    except ClusterUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()


def admin_status(run: Path) -> dict[str, Any]:
    """``resihp admin --json status`` of the job in ``run`` (iteration -1 until it answers)."""
    res = subprocess.run([sys.executable, "-m", "resihp.cli", "admin", "--run-dir", str(run), "--json", "status"],
                         capture_output=True, text=True, timeout=60)
    return dict(json.loads(res.stdout)) if res.returncode == 0 else {"iteration": -1, "ranks": []}


def stop(launch: subprocess.Popen[str]) -> None:
    """End a ``resihp launch`` still running (SIGINT: it stops its daemons and ranks itself)."""
    if launch.poll() is None:
        launch.send_signal(signal.SIGINT)
        launch.wait(60)


def launch_four_node_job(cluster: NetnsCluster, work: Path, policy: Sequence[str], steps: int = 400) -> subprocess.Popen[str]:
    """The slow-link tests' job on a four-node cluster, one rank per node: TP1 x PP2 x DP2 of
    gpt-tiny under ``resihp launch`` (run directory ``work/run``), with coordinator ``policy``."""
    repo = Path(__file__).resolve().parents[1]
    line = cluster.launch_command(work / "run", cluster.hostfile(work / "hosts", slots=1),
                                  ["-n", "4", "--pp", "2", "--dp", "2", "--microbatches", "8"], policy,
                                  [sys.executable, str(repo / "examples" / "train_gpt.py"), "--pp", "2", "--dp", "2",
                                   "--microbatches", "8", "--steps", str(steps), "--threads", "1", "--log-every",
                                   "1000"])
    # output to a file, not a pipe nobody reads: the ranks' output must not block
    return subprocess.Popen(line, stdout=open(work / "launch.log", "w"), stderr=subprocess.STDOUT, text=True,
                            cwd=str(repo))


def healthy_at(run: Path, rank: int, iteration: int) -> int | None:
    """The job's iteration once it is at least ``iteration`` with ``rank`` judged healthy (a noise
    finding on the shared cores must have cleared first), else None."""
    st = admin_status(run)
    healthy = any(r["rank"] == rank and r["state"] == "healthy" for r in st["ranks"])
    return int(st["iteration"]) if st["iteration"] >= iteration and healthy else None
