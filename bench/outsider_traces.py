"""An independent check of the detector: traces written from docs/trace-format.md alone.

    python bench/outsider_traces.py [--runs 4 --iterations 300 --out DIR]

``bench/detect.py`` judges the detector on ``sim/workload_truth.py``, which shares the
detector's own assumptions (its cost model, its schedule). This writer shares none of it: it
imports nothing of resihp's, simulates its own 1F1B pipelines with its own FLOPs formula and
its own noise, and writes format-1 traces as an outside runtime would (own-kernel F/B spans,
P2P spans that hold the transfer, DP spans from each rank's own entry into the all-reduce,
so holding the wait for the ring's last arriver). Each trace is replayed through the public
``resihp detect`` command. Noise classes (issue #25): per-op compute jitter, lognormal
per-transfer jitter, GC pauses and data-loader stalls of 50-500 ms on single ranks,
co-tenant episodes slowing a host, heavy-tailed document lengths packed at 8K/16K/32K.
Faults: compute 1.1-3x on any rank, a 3x slow path between two stages (inside a node and
across nodes), a 4x slow NIC (its cross-node transfers and DP rings), a transient slowdown,
all from iteration 120 (the detector warmed up); and a 1.3x device slow from iteration 0 (a bad
node at job start: its own first iterations cannot be its healthy reference).

Prints a table per noise level x fault kind, then one line of JSON:
``outsider_false_alarms_per_run`` (fail-slow findings naming no rank of the fault, per
run), ``outsider_localisation`` (the share of right findings that name the fault's ranks
only), ``outsider_host_load_findings_per_run`` (compute findings of ranks whose whole host ran
a co-tenant episode of 3-12 %: above the effect floor, a fault by the detector's rules, so
counted apart), ``outsider_recall`` (faults found on the right rank and cause, as fail-slow
or degraded, within 60 iterations), ``outsider_latency_p95`` (faults from iteration 120),
``outsider_from_start_found_at_max`` (the latest iteration a device slow from iteration 0 was
found at) and the worst cell of each.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import random
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MODEL = {"name": "outsider-7b", "num_layers": 32, "hidden": 4096, "num_heads": 32, "ffn_hidden": 11008,
         "vocab": 32000, "gated_mlp": True}
PEAK_FLOPS = 400e12 * 0.45  # one device's sustained rate
P2P_BPS, RING_BPS = 25e9, 40e9  # per-transfer and all-reduce bandwidth
FAULT_AT = 120  # faults start here (the detector warms up first)
# tp, pp, dp, micro-batches per replica, GPUs per node (the last: a TP4 x PP2 replica in one
# node, every pipeline transfer inside it)
LAYOUTS = ((2, 4, 2, 8, 4), (1, 2, 4, 8, 4), (4, 2, 2, 4, 4), (4, 2, 2, 4, 8))


@dataclass(frozen=True)
class NoiseLevel:
    op: float  # per-op lognormal sigma of compute
    p2p: float  # per-transfer lognormal sigma
    stall_p: float  # per-iteration chance of a 50-500 ms stall on one rank
    cotenant_p: float  # per-iteration chance a host starts a co-tenant episode


NOISE = {"quiet": NoiseLevel(0.01, 0.05, 0.0, 0.0), "realistic": NoiseLevel(0.03, 0.2, 0.02, 0.005),
         "harsh": NoiseLevel(0.05, 0.3, 0.05, 0.01)}


@dataclass(frozen=True)
class Fault:
    kind: str  # compute | link | nic | transient | healthy
    factor: float = 1.0
    rank: int = -1  # compute, transient: the rank; link: the sending rank of the slow path; nic: a rank of the node
    length: int = 10**9
    start: int = FAULT_AT  # the first slowed iteration (0: a device slow from the job's start)


@dataclass
class Job:
    tp: int
    pp: int
    dp: int
    mbs: int
    per_node: int
    budget: int
    noise: NoiseLevel
    fault: Fault
    rng: random.Random
    cotenant: dict[str, tuple[int, float]] = field(default_factory=dict)  # node -> (until, factor)
    device: dict[int, float] = field(default_factory=dict)  # each device's own speed, +-2 %
    episodes: list[tuple[str, int, int, float]] = field(default_factory=list)  # (node, from, until, factor)

    def loaded(self, ranks: list[int], it: int) -> bool:
        """Whether every one of ``ranks`` sat on a host under co-tenant load at ``it`` or in
        the few iterations before (a finding quotes the iteration that confirmed it)."""
        return all(any(node == self.node(r) and start <= it and it - 8 <= until
                       for node, start, until, _ in self.episodes) for r in ranks)

    def rank(self, d: int, s: int, j: int) -> int:
        return (d * self.pp + s) * self.tp + j

    def node(self, r: int) -> str:
        return f"n{r // self.per_node}"


def documents(rng: random.Random, budget: int, count: int) -> list[list[int]]:
    """``count`` micro-batches of ``budget`` tokens packed from heavy-tailed documents
    (lognormal, median 1K, a few >= 16K); a document that does not fit continues in the next."""
    out: list[list[int]] = []
    cur: list[int] = []
    room = budget
    while len(out) < count:
        n = max(16, min(int(rng.lognormvariate(math.log(1024), 1.2)), 65536))
        while n > 0 and len(out) < count:
            take = min(n, room)
            cur.append(take)
            n -= take
            room -= take
            if room == 0:
                out.append(cur)
                cur, room = [], budget
    return out


def forward_s(seqlens: list[int], layers: int, tp: int) -> float:
    h, f = MODEL["hidden"], MODEL["ffn_hidden"]
    tokens = sum(seqlens)
    dense = 2 * tokens * (4 * h * h + 3 * h * f)  # QKVO + gated MLP
    attn = 4 * h * sum(x * x for x in seqlens) / 2  # causal
    return layers * (dense + attn) / tp / PEAK_FLOPS + 2e-4


def iteration(job: Job, it: int, t0: float) -> dict[str, object]:
    """One step of every replica's 1F1B pipeline, then the DP all-reduce and the optimizer."""
    rng, nz, fault = job.rng, job.noise, job.fault
    active = fault.start <= it < fault.start + fault.length
    for node in sorted({job.node(r) for r in range(job.tp * job.pp * job.dp)}):
        until, _ = job.cotenant.get(node, (-1, 1.0))
        if until < it and rng.random() < nz.cotenant_p:
            job.cotenant[node] = (it + rng.randint(10, 40), 1 + rng.uniform(0.03, 0.12))
            job.episodes.append((node, it, *job.cotenant[node]))
    stall = (rng.randrange(job.tp * job.pp * job.dp), rng.uniform(0.05, 0.5)) if rng.random() < nz.stall_p else None
    layers = MODEL["num_layers"] // job.pp
    seqlens = [documents(rng, job.budget, job.mbs) for _ in range(job.dp)]
    chunks: list[list[object]] = []
    last_b: dict[int, float] = {}

    def speed(r: int) -> float:
        if r not in job.device:
            job.device[r] = rng.lognormvariate(0, 0.02)
        f = job.device[r]
        until, extra = job.cotenant.get(job.node(r), (-1, 1.0))
        if until >= it:
            f *= extra
        if active and fault.kind in ("compute", "transient") and r == fault.rank:
            f *= fault.factor
        return f

    def link(src: int, dst: int, nbytes: float) -> float:
        f = 1.0
        if active and fault.kind == "link" and {src, dst} == {fault.rank, fault.rank + job.tp}:
            f = fault.factor
        if active and fault.kind == "nic" and job.node(fault.rank) in (job.node(src), job.node(dst)) \
                and job.node(src) != job.node(dst):
            f = fault.factor
        return nbytes / P2P_BPS * f * rng.lognormvariate(0, nz.p2p) + 3e-5

    for d in range(job.dp):
        order = []
        for s in range(job.pp):
            warm = min(job.pp - s - 1, job.mbs)
            ops = [("F", m) for m in range(warm)]
            for m in range(job.mbs - warm):
                ops += [("F", warm + m), ("B", m)]
            ops += [("B", m) for m in range(job.mbs - warm, job.mbs)]
            order.append(ops)
        done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> the group's end
        free = [0.0] * job.pp
        pos = [0] * job.pp
        while any(pos[s] < len(order[s]) for s in range(job.pp)):
            for s in range(job.pp):
                if pos[s] >= len(order[s]):
                    continue
                kind, m = order[s][pos[s]]
                dep = (kind, s - 1, m) if kind == "F" else (kind, s + 1, m)
                if (kind == "F" and s > 0 or kind == "B" and s < job.pp - 1) and dep not in done:
                    continue
                ready = free[s]
                if dep in done:
                    nbytes = sum(seqlens[d][m]) * MODEL["hidden"] * 2 / job.tp
                    arrive = 0.0
                    for j in range(job.tp):
                        x = link(job.rank(d, dep[1], j), job.rank(d, s, j), nbytes)
                        r = job.rank(d, s, j)
                        start = max(done[dep], free[s])
                        chunks.append([r, "P2P", m, 0, round(start, 6), round(start + x, 6)])
                        arrive = max(arrive, start + x)
                    ready = max(ready, arrive)
                base = forward_s(seqlens[d][m], layers, job.tp) * (2.0 if kind == "B" else 1.0)
                end = ready
                for j in range(job.tp):
                    r = job.rank(d, s, j)
                    dur = base * speed(r) * rng.lognormvariate(0, nz.op)
                    if stall is not None and stall[0] == r and rng.random() < 0.2:
                        dur += stall[1]  # a GC pause inside a host-timed op
                        stall = None
                    chunks.append([r, kind, m, 0, round(ready, 6), round(ready + dur, 6)])
                    end = max(end, ready + dur)
                    if kind == "B":
                        last_b[r] = ready + dur
                done[(kind, s, m)] = end
                free[s] = end
                pos[s] += 1
    grad_bytes = 2 * layers * (4 * MODEL["hidden"] ** 2 + 3 * MODEL["hidden"] * MODEL["ffn_hidden"]) / job.tp
    finish = 0.0
    for s in range(job.pp):
        for j in range(job.tp):
            ring = [job.rank(d, s, j) for d in range(job.dp)]
            go = max(last_b[r] for r in ring)
            slow = 1.0
            if active and fault.kind == "nic" and any(job.node(r) == job.node(fault.rank) for r in ring) \
                    and len({job.node(r) for r in ring}) > 1:
                slow = fault.factor
            xfer = 2 * grad_bytes * (job.dp - 1) / job.dp / RING_BPS * slow * rng.lognormvariate(0, nz.p2p / 3)
            for r in ring:
                opt = 0.004 * speed(r) * rng.lognormvariate(0, nz.op)
                chunks.append([r, "DP", -1, 0, round(last_b[r], 6), round(go + xfer, 6)])
                chunks.append([r, "OPT", -1, 0, round(go + xfer, 6), round(go + xfer + opt, 6)])
                finish = max(finish, go + xfer + opt)
    if stall is not None:  # a data-loader stall before the step's work: every span of the job waits
        finish += stall[1]
    return {"type": "iteration", "iteration": it, "start_s": round(t0, 6), "time_s": round(finish, 6),
            "seqlens": seqlens, "chunks": chunks}


def write_trace(job: Job, iterations: int) -> Iterator[str]:
    n = job.tp * job.pp * job.dp
    replicas = [{"stages": [[job.rank(d, s, j) for j in range(job.tp)] for s in range(job.pp)],
                 "layers": [MODEL["num_layers"] // job.pp] * job.pp, "microbatches": job.mbs} for d in range(job.dp)]
    yield json.dumps({"format": 1, "type": "header", "job": "outsider", "model": MODEL,
                      "plan": {"epoch": 0, "schedule": "1f1b", "virtual_chunks": 1, "spares": [], "replicas": replicas},
                      "devices": [{"rank": r, "node": job.node(r), "local_rank": r % job.per_node} for r in range(n)],
                      "tokens_per_microbatch": job.budget, "meta": {"generator": "bench/outsider_traces.py"}})
    t = 0.0
    for it in range(iterations):
        rec = iteration(job, it, t)
        t += float(rec["time_s"]) + 0.001  # type: ignore[arg-type]
        yield json.dumps(rec, separators=(",", ":"))


def expected(job: Job) -> tuple[set[int], str]:
    """The ranks a right finding may name, and its cause."""
    f = job.fault
    if f.kind in ("compute", "transient"):
        return {f.rank}, "compute"
    if f.kind == "link":
        return {f.rank, f.rank + job.tp}, "communication"
    if f.kind == "nic":
        return {r for r in range(job.tp * job.pp * job.dp) if job.node(r) == job.node(f.rank)}, "communication"
    return set(), ""


@dataclass(frozen=True)
class Seen:
    """What the scoring reads of one finding of ``resihp detect``."""
    iteration: int
    kind: str
    ranks: frozenset[int]
    cause: str


def replay(lines: list[str]) -> list[Seen]:
    from resihp.coordinator.cli.detect import main as detect  # the public command, in-process
    with tempfile.TemporaryDirectory() as tmp:
        trace, out = Path(tmp) / "t.jsonl", Path(tmp) / "f.jsonl"
        trace.write_text("\n".join(lines) + "\n")
        err = io.StringIO()
        stderr, sys.stderr = sys.stderr, err
        try:
            rc = detect(["--trace", str(trace), "--out", str(out)])
        finally:
            sys.stderr = stderr
        if rc != 0:
            raise RuntimeError(f"resihp detect failed ({rc}): {err.getvalue()}")
        found = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
        return [Seen(int(f["iteration"]), str(f["kind"]), frozenset(int(r) for r in f["ranks"]), str(f["cause"]))
                for f in found]


def faults(rng: random.Random, job: Job) -> dict[str, Fault]:
    """One fault of each kind on ranks drawn at random; a slow path between two stages
    inside a node and one across nodes, where the layout has such a path."""
    tp, pp, dp = job.tp, job.pp, job.dp
    n = tp * pp * dp
    out = {"healthy": Fault("healthy"), "compute-1.1x": Fault("compute", 1.1, rng.randrange(n)),
           "compute-1.3x": Fault("compute", 1.3, rng.randrange(n)), "compute-3x": Fault("compute", 3.0, rng.randrange(n))}
    edges = [job.rank(d, s, j) for d in range(dp) for s in range(pp - 1) for j in range(tp)]  # stage s -> s + 1
    for where, same in (("in-node", True), ("across", False)):
        fit = [r for r in edges if (job.node(r) == job.node(r + tp)) == same]
        if fit:
            out[f"path-3x-{where}"] = Fault("link", 3.0, rng.choice(fit))
    out["nic-4x"] = Fault("nic", 4.0, rng.randrange(n))
    out["transient-1.5x"] = Fault("transient", 1.5, rng.randrange(n), rng.randint(5, 50))
    out["compute-1.3x-at-0"] = Fault("compute", 1.3, rng.randrange(n), start=0)  # a bad device from the start
    return out


@dataclass
class Cell:
    runs: int = 0
    false: int = 0
    host_load: int = 0  # fail-slow findings of ranks whose whole host was under co-tenant load
    imprecise: int = 0  # right findings that name ranks beside the fault's (a DP ring named whole)
    right: int = 0  # findings on the fault's ranks and cause
    faults: int = 0
    found: int = 0
    latency: list[int] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="runs per (noise, fault kind), layouts in turn")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default="", help="keep the traces and findings here")
    a = ap.parse_args(argv)
    print(json.dumps(check(a.runs, a.iterations, a.seed, a.out)))
    return 0


def check(runs_per_cell: int = 4, iterations: int = 300, base_seed: int = 2026, out: str = "") -> dict[str, object]:
    """Write, replay and score every (noise level, fault kind) cell; print the table and
    return the metrics (``bench/detect.py`` adds them to its own line)."""
    cells: dict[tuple[str, str], Cell] = {}
    for level, nz in NOISE.items():
        for i in range(runs_per_cell):
            tp, pp, dp, mbs, per_node = LAYOUTS[i % len(LAYOUTS)]
            seed = base_seed * 1000 + i
            budget = (8192, 16384, 32768)[i % 3]
            shape = Job(tp, pp, dp, mbs, per_node, budget, nz, Fault("healthy"), random.Random(0))
            for kind, fault in faults(random.Random(seed), shape).items():
                job = Job(tp, pp, dp, mbs, per_node, budget, nz, fault, random.Random(seed + 7))
                lines = list(write_trace(job, iterations))
                found = replay(lines)
                if out:
                    d = Path(out)
                    d.mkdir(parents=True, exist_ok=True)
                    (d / f"{level}-{kind}-{i}.jsonl").write_text("\n".join(lines) + "\n")
                    (d / f"{level}-{kind}-{i}.findings.jsonl").write_text(
                        "".join(json.dumps({**vars(f), "ranks": sorted(f.ranks)}) + "\n" for f in found))
                ranks, cause = expected(job)
                c = cells.setdefault((level, kind), Cell())
                c.runs += 1
                slow = [f for f in found if f.kind in ("fail-slow", "degraded")]
                # a host slowed by more than the effect floor is a fault by the detector's rules
                # (docs/detector.md): counted apart, neither false nor missed
                load = [f for f in slow if f.kind == "fail-slow" and f.cause == "compute"
                        and job.loaded(sorted(f.ranks), f.iteration) and not f.ranks <= ranks]
                c.host_load += len(load)
                wrong = [f for f in slow if f.kind == "fail-slow" and f not in load and not f.ranks & ranks]
                c.false += len(wrong)
                if kind == "healthy":
                    continue
                c.faults += 1
                on = [f for f in slow if f.ranks & ranks and f.cause == cause]
                c.right += len(on)
                c.imprecise += sum(not f.ranks <= ranks for f in on)
                start = job.fault.start
                hit = [f for f in on if start <= f.iteration < start + 60]
                if hit:
                    c.found += 1
                    c.latency.append(hit[0].iteration - start)
    print("false: fail-slow findings naming no rank of the fault; host: compute findings of a host under "
          "co-tenant load;\nwide: right findings naming ranks beside the fault's (a DP ring whose members "
          "look alike)\n")
    print(f"{'noise':10s} {'fault':17s} {'runs':>4s} {'false':>5s} {'host':>4s} {'wide':>4s} {'found':>6s} "
          "latency (iterations)")
    for (level, kind), c in cells.items():
        print(f"{level:10s} {kind:17s} {c.runs:4d} {c.false:5d} {c.host_load:4d} {c.imprecise:4d} "
              f"{f'{c.found}/{c.faults}':>6s} {sorted(c.latency)}")
    runs = sum(c.runs for c in cells.values())
    faulty = [c for c in cells.values() if c.faults]
    # faults from iteration 120 (the warmed-up detector); from the start apart: the first judged
    # iteration bounds those (a key needs its first samples before anything is judged)
    lat = sorted(x for (_, kind), c in cells.items() if not kind.endswith("at-0") for x in c.latency)
    at0 = [x for (_, kind), c in cells.items() if kind.endswith("at-0") for x in c.latency]
    worst_false = max(cells.items(), key=lambda kv: kv[1].false / kv[1].runs)
    worst_recall = min(((k, c) for k, c in cells.items() if c.faults), key=lambda kv: kv[1].found / kv[1].faults)
    return {
        "outsider_runs": runs,
        "outsider_false_alarms_per_run": round(sum(c.false for c in cells.values()) / runs, 3),
        "outsider_host_load_findings_per_run": round(sum(c.host_load for c in cells.values()) / runs, 3),
        "outsider_localisation": round(1 - sum(c.imprecise for c in faulty) / max(1, sum(c.right for c in faulty)), 3),
        "outsider_recall": round(sum(c.found for c in faulty) / sum(c.faults for c in faulty), 3),
        "outsider_latency_p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
        "outsider_from_start_found_at_max": max(at0) if at0 else None,
        "worst_false_cell": "/".join(worst_false[0]), "worst_recall_cell": "/".join(worst_recall[0]),
        "worst_recall": round(worst_recall[1].found / worst_recall[1].faults, 3),
    }


if __name__ == "__main__":
    raise SystemExit(main())
