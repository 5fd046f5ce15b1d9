"""A compute slowdown found within the iteration it slows, from the heartbeats' op states.

A large job's iteration lasts tens of seconds (LLaMA2-70B on 256 GPUs: about 30 s; 70-110 s
while one GPU runs 2-4x slow). Judged from iteration records, a slowdown is found when its
second slowed iteration ends: minutes of a job at half speed. The heartbeats say more, every
second: each rank's op — computing, or waiting inside a p2p or collective op — and its op
counter (docs/trace-format.md). When one device is slow its iteration outlasts the usual one
while that rank computes on, op after op, and every other rank waits for it: its TP mates in
the layer's collectives, the other stages for its activations or gradients, the other
replicas in the DP all-reduce.

The rule (``InFlight.judge``), all of:

- the usual iteration (the median of the latest ``HISTORY``) lasts at least
  ``min_iteration_s`` (DetectorConfig.in_flight_min_iteration_s, 5 s), and the running one has
  lasted more than (1 + over) x it, with over = max(``OVER_MIN``, ``OVER_SPREADS`` x their relative
  spread), and every rank has beaten ``MIN_BEATS`` times in it: a heavy batch, a GC pause
  or a data-loader stall is shorter, and a short iteration is judged by its record anyway;
- over each rank's latest ``MIN_BEATS`` beats (by then the other replicas have finished
  their pipelines and wait in the DP all-reduce): exactly one rank was free — computing, or
  between ops — in at least ``FREE_SHARE`` of them and moved on (its counter advanced by
  ``MIN_OPS``: a rank that holds one op is stuck, which is the no-progress rule's case),
  while the others waited in at least ``WAIT_SHARE`` of theirs (their median). An expensive
  batch keeps a whole replica busy (every stage and TP member), a slow device one rank.

Its factor: the seconds it computed per op counted in this iteration (its beats inside a
compute op times the beat interval, over the ops its counter advanced by) against the same in
its latest iterations (their median); it must be above 1 + over too. Self-calibrated: whatever
the counter counts (the runtime counts p2p and collective ops too), a slower device stretches
the time its ops keep it busy. A rank that loaded its batch for seconds (between ops) and
then computed at its usual pace is not slow.
Pure and deterministic: times are the beats' own.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np

from resihp.coordinator.model.trace import OpState

HISTORY = 16  # iterations whose times make the usual one
MIN_HISTORY = 4  # iterations of the current plan before the rule judges
OVER_MIN = 0.25  # the iteration must outlast the usual one by at least this share ...
OVER_SPREADS = 4.0  # ... and by this many of the iterations' relative spreads
MIN_BEATS = 5  # beats of every rank within the iteration
FREE_SHARE = 0.7
WAIT_SHARE = 0.5
MIN_OPS = 2
MAX_FACTOR = 20.0
HISTORY_OPS = 8  # iterations whose compute per op makes a rank's usual one


@dataclass(frozen=True)
class InFlightVerdict:
    rank: int
    factor: float
    elapsed_s: float
    usual_s: float
    busy_per_op_s: float  # seconds it computed per counted op in this iteration
    usual_busy_per_op_s: float  # the same in its latest iterations
    free_share: float
    peers_waiting_share: float
    waiting_peers: int

    def evidence(self) -> dict[str, float]:
        return {"elapsed_s": self.elapsed_s, "usual_iteration_s": self.usual_s, "busy_per_op_s": self.busy_per_op_s,
                "usual_busy_per_op_s": self.usual_busy_per_op_s, "free_share": self.free_share,
                "peers_waiting_share": self.peers_waiting_share, "waiting_peers": float(self.waiting_peers)}

    def describe(self) -> str:
        return (f"compute, in flight: the iteration has run {self.elapsed_s:.1f} s against its usual "
                f"{self.usual_s:.1f} s while rank {self.rank} computed op after op ({self.free_share:.0%} of its "
                f"latest beats; {self.busy_per_op_s * 1e3:.0f} ms of compute per op against its usual "
                f"{self.usual_busy_per_op_s * 1e3:.0f} ms) and {self.waiting_peers} peers waited for it: "
                f"{self.factor:.2f}x slower")


class InFlight:
    """Per-rank beats of the running iteration (``beat``), reset when an iteration ends
    (``progress``) or the plan changes (``reset``). Arrays over the ranks: an iteration's end
    costs a few vector operations, not a loop over thousands of ranks."""

    def __init__(self, ranks: Sequence[int], min_iteration_s: float = 0.0) -> None:
        self.min_iteration_s = min_iteration_s  # a job whose usual iteration is shorter is not judged
        self._times: deque[float] = deque(maxlen=HISTORY)
        self._start: float | None = None
        self._judged = False  # one verdict per iteration
        self._since = 0  # beats since the latest judgement: judged once per round of beats
        self._heard = False  # an op state has arrived at all (most traces have none)
        self._alloc(ranks, None)

    def _alloc(self, ranks: Sequence[int], old: dict[int, int] | None) -> None:
        self.ranks = list(ranks)
        self.pos = {r: i for i, r in enumerate(self.ranks)}
        n = len(self.ranks)
        self.beats = np.zeros(n, dtype=np.int64)
        self.busy = np.zeros(n, dtype=np.int64)  # beats of this iteration inside a compute op
        self.seq = np.full(n, -1, dtype=np.int64)  # the latest op counter (-1: none yet)
        if old is not None:
            self.seq[:] = [old.get(r, -1) for r in self.ranks]
        self.seq0 = self.seq.copy()  # the counter when the iteration began (the latest before it)
        self.recent_free = np.zeros((n, MIN_BEATS), dtype=np.bool_)  # the latest beats, a ring per rank
        self.recent_seq = np.zeros((n, MIN_BEATS), dtype=np.int64)
        self.per_op = np.full((n, HISTORY_OPS), np.nan)  # latest iterations' compute seconds per op
        self.per_op_at = 0

    def reset(self, ranks: Sequence[int]) -> None:
        """A new plan: its iterations and each rank's compute per op are learnt afresh."""
        self._alloc(ranks, {r: int(self.seq[i]) for i, r in enumerate(self.ranks)})
        self._times.clear()

    def beat(self, rank: int, t: float, op: OpState) -> None:
        i = self.pos.get(rank)
        if i is None:
            return
        self._heard = True
        self._since += 1
        if self._start is not None and t > self._start:
            k = int(self.beats[i]) % MIN_BEATS
            self.beats[i] += 1
            self.busy[i] += op.kind == "compute" and not op.done
            self.recent_free[i, k] = not op.waiting
            self.recent_seq[i, k] = op.seq
        elif op.seq >= self.seq0[i]:
            self.seq0[i] = op.seq  # a beat from before the iteration began: where its counter started
        self.seq[i] = op.seq

    def progress(self, now: float, time_s: float) -> None:
        """An iteration ended at ``now`` after ``time_s`` seconds."""
        if self._heard and self._start is not None:
            ops = self.seq - self.seq0
            ok = (self.beats >= MIN_BEATS) & (ops > 0) & (self.busy > 0) & (self.seq0 >= 0)
            if ok.any():
                got = self.busy * (now - self._start) / np.maximum(self.beats, 1) / np.maximum(ops, 1)
                self.per_op[:, self.per_op_at] = np.where(ok, got, np.nan)
                self.per_op_at = (self.per_op_at + 1) % HISTORY_OPS
            self.seq0[:] = self.seq
            self.beats[:] = 0
            self.busy[:] = 0
        if np.isfinite(time_s) and time_s > 0:
            self._times.append(float(time_s))
        self._start = now
        self._judged = False

    def judge(self, now: float, exclude: Container[int] = ()) -> InFlightVerdict | None:
        """The rank holding this iteration up, slow but moving; None (most of the time)."""
        n = len(self.ranks)
        if self._judged or not self._heard or self._start is None or len(self._times) < MIN_HISTORY or n < 3:
            return None
        if self._since < n:  # (at 4096 ranks a judgement per beat cost seconds per second)
            return None
        self._since = 0
        times = np.asarray(self._times)
        usual = float(np.median(times))
        spread = 1.4826 * float(np.median(np.abs(times - usual))) / usual if usual > 0 else 0.0
        elapsed = now - self._start
        over = max(OVER_MIN, OVER_SPREADS * spread)
        if usual <= 0 or usual < self.min_iteration_s or elapsed <= (1.0 + over) * usual:
            return None
        if int(self.beats.min()) < MIN_BEATS:
            return None  # some rank has not beaten enough in this iteration
        free = self.recent_free.mean(axis=1)
        moved = self.recent_seq.max(axis=1) - self.recent_seq.min(axis=1)
        busy = np.nonzero((free >= FREE_SHARE) & (moved >= MIN_OPS))[0]
        if len(busy) != 1 or self.ranks[int(busy[0])] in exclude:
            return None  # none, or several (a whole replica busy: a heavy batch, or no single culprit)
        i = int(busy[0])
        others = np.delete(1.0 - free, i)
        waiting = float(np.median(others))
        if waiting < WAIT_SHARE:
            return None
        history = self.per_op[i][np.isfinite(self.per_op[i])]
        if len(history) < MIN_HISTORY - 1:
            return None
        usual_per_op = float(np.median(history))
        ops = int(self.seq[i] - self.seq0[i])
        if usual_per_op <= 0 or ops <= 0:
            return None
        # the op it is in counts whole but is half done (a whole iteration's ops are all done)
        latest = (int(self.beats[i]) - 1) % MIN_BEATS
        done = ops - 0.5 if self.recent_free[i, latest] else ops
        per_op = int(self.busy[i]) * elapsed / int(self.beats[i]) / max(done, 0.5)
        factor = min(MAX_FACTOR, per_op / usual_per_op)
        if factor < 1.0 + over:
            return None  # it computes at its usual pace: something else held the iteration up (a stall)
        self._judged = True
        return InFlightVerdict(self.ranks[i], factor, elapsed, usual, per_op, usual_per_op, float(free[i]), waiting,
                               int(np.sum(others >= WAIT_SHARE)))


__all__ = ["InFlight", "InFlightVerdict"]
