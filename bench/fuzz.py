"""Fuzz benchmark: seeded hostile requests against a coordinator, an agent and a store, each a real
process started here (coordinator/fuzz).

    python bench/fuzz.py [--cases 10000] [--store-cases 10000] [--seed 0] [--live-job]

``--live-job`` sends only what a live job can take (no valid drains, kills or hellos). Prints a
table, then ONE line of JSON: cases, cases_per_s, by_status, unexpected, daemon_crashes,
store_cases, store_cases_per_s, store_outcomes, store_unexpected, store_crashes.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resihp.coordinator.fuzz import fuzz_endpoints
from resihp.coordinator.fuzz.store import fuzz_store
from resihp.coordinator.protocol.auth import rank_token
from resihp.trainer_hooks.reconfig.ulfm import StoreProcess

PY = sys.executable


def _wait_json(path: Path, proc: subprocess.Popen[bytes], what: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        except (OSError, ValueError):
            time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--store-cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live-job", action="store_true", help="no valid writes (what bench/chaos.py sends a job)")
    a = ap.parse_args(argv)
    token = secrets.token_urlsafe(16)
    env = {**os.environ, "RESIHP_TOKEN": token}
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="resihp-fuzz-") as tmp:
        run = Path(tmp)
        try:
            procs.append(subprocess.Popen(
                [PY, "-m", "resihp.cli", "coordinator", "--run-dir", str(run), "--job", "fuzz", "-n", "4", "--pp", "2",
                 "--port", "0", "--metrics-port", "0", "--log-level", "CRITICAL"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            info = _wait_json(run / "coordinator.json", procs[0], "the coordinator")
            procs.append(subprocess.Popen(
                [PY, "-m", "resihp.cli", "agent", "--node", "n0", "--job", "fuzz", "--coordinator", info["grpc"],
                 "--run-dir", str(run), "--world-size", "4", "--gpu-sampler", "off", "--log-level", "CRITICAL"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            hook = _wait_json(run / "agent-n0.json", procs[1], "the agent")["hook"]
            rpc = fuzz_endpoints(info["grpc"], hook, token, a.cases, a.seed, mutate_state=not a.live_job,
                                 coordinator_pids=[procs[0].pid], agent_pids=[procs[1].pid], metrics_url=info["metrics"])
            alive = all(p.poll() is None for p in procs)
        finally:
            for p in procs:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
    with StoreProcess(credential=rank_token(token)) as store:
        st = fuzz_store(store.host, store.port, store.credential, a.store_cases, a.seed, pid=store.proc.pid)
        store_alive = store.proc.poll() is None
    print(f"{'target':<12} {'cases':>7} {'cases/s':>8} {'unexpected':>10} {'crashes':>7}  statuses")
    print(f"{'rpc':<12} {rpc.cases:>7} {rpc.cases_per_s:>8.0f} {len(rpc.unexpected):>10} {rpc.daemon_crashes:>7}  "
          + ", ".join(f"{k} {v}" for k, v in sorted(rpc.by_status.items())))
    print(f"{'store':<12} {st.cases:>7} {st.cases / max(st.seconds, 1e-9):>8.0f} {len(st.unexpected):>10} {st.crashes:>7}  "
          + ", ".join(f"{k} {v}" for k, v in sorted(st.outcomes.items())))
    for line in (rpc.unexpected + st.unexpected)[:20]:
        print("  unexpected:", line)
    print(json.dumps({"cases": rpc.cases, "cases_per_s": round(rpc.cases_per_s, 1), "by_status": rpc.by_status,
                      "unexpected": len(rpc.unexpected), "daemon_crashes": rpc.daemon_crashes + (not alive),
                      "store_cases": st.cases, "store_cases_per_s": round(st.cases / max(st.seconds, 1e-9), 1),
                      "store_outcomes": st.outcomes, "store_unexpected": len(st.unexpected),
                      "store_crashes": st.crashes + (not store_alive), "seed": a.seed, "live_job": a.live_job}))
    return 0 if not (rpc.unexpected or st.unexpected or rpc.daemon_crashes or st.crashes) else 1


if __name__ == "__main__":
    sys.exit(main())
