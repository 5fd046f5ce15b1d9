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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

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


@dataclass
class _Beats:
    beats: int = 0
    recent: deque[tuple[bool, int]] = field(default_factory=lambda: deque(maxlen=MIN_BEATS))  # (free, counter)
    seq0: int | None = None  # the op counter when the iteration began (the latest before it)
    seq: int | None = None
    busy: int = 0  # beats of this iteration that found it inside a compute op
    busy_per_op: deque[float] = field(default_factory=lambda: deque(maxlen=8))  # latest iterations' seconds per op


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


class InFlight:
    """Per-rank beats of the running iteration (``beat``), reset when an iteration ends
    (``progress``) or the plan changes (``reset``)."""

    def __init__(self, replica_of: Mapping[int, int], min_iteration_s: float = 0.0) -> None:
        self.min_iteration_s = min_iteration_s  # a job whose usual iteration is shorter is not judged
        self._replica = dict(replica_of)
        self._ranks: dict[int, _Beats] = {r: _Beats() for r in self._replica}
        self._times: deque[float] = deque(maxlen=HISTORY)
        self._start: float | None = None
        self._judged = False  # one verdict per iteration
        self._since = 0  # beats since the latest judgement: judged once per round of beats

    def reset(self, replica_of: Mapping[int, int]) -> None:
        """A new plan: its iterations and each rank's ops per iteration are learnt afresh."""
        self._replica = dict(replica_of)
        self._ranks = {r: _Beats(seq0=self._ranks[r].seq if r in self._ranks else None,
                                 seq=self._ranks[r].seq if r in self._ranks else None) for r in self._replica}
        self._times.clear()

    def beat(self, rank: int, t: float, op: OpState) -> None:
        b = self._ranks.get(rank)
        if b is None:
            return
        self._since += 1
        if self._start is not None and t > self._start:
            b.beats += 1
            b.busy += op.kind == "compute" and not op.done
            b.recent.append((not op.waiting, op.seq))
        elif b.seq0 is None or op.seq >= b.seq0:
            b.seq0 = op.seq  # a beat from before the iteration began: where its counter started
        b.seq = op.seq

    def progress(self, now: float, time_s: float) -> None:
        """An iteration ended at ``now`` after ``time_s`` seconds."""
        for b in self._ranks.values():
            ops = (b.seq or 0) - (b.seq0 or 0)
            if self._start is not None and b.beats >= MIN_BEATS and ops > 0 and b.busy > 0:
                b.busy_per_op.append(b.busy * (now - self._start) / b.beats / ops)
            b.seq0, b.beats, b.busy = b.seq, 0, 0
            b.recent.clear()
        if np.isfinite(time_s) and time_s > 0:
            self._times.append(float(time_s))
        self._start = now
        self._judged = False

    def judge(self, now: float, exclude: Collection[int] = ()) -> InFlightVerdict | None:
        """The rank holding this iteration up, slow but moving; None (most of the time)."""
        if self._judged or self._start is None or len(self._times) < MIN_HISTORY or len(self._ranks) < 3:
            return None
        if self._since < len(self._ranks):  # (at 4096 ranks a judgement per beat cost seconds per second)
            return None
        self._since = 0
        times = np.asarray(self._times)
        usual = float(np.median(times))
        spread = 1.4826 * float(np.median(np.abs(times - usual))) / usual if usual > 0 else 0.0
        elapsed = now - self._start
        over = max(OVER_MIN, OVER_SPREADS * spread)
        if usual <= 0 or usual < self.min_iteration_s or elapsed <= (1.0 + over) * usual:
            return None
        heard = {r: b for r, b in self._ranks.items() if b.beats > 0}
        if len(heard) < len(self._ranks) or min(b.beats for b in heard.values()) < MIN_BEATS:
            return None
        free = {r: sum(f for f, _ in b.recent) / len(b.recent) for r, b in heard.items()}
        moved = {r: b.recent[-1][1] - b.recent[0][1] for r, b in heard.items()}
        busy = [r for r in heard if free[r] >= FREE_SHARE and moved[r] >= MIN_OPS]
        if len(busy) != 1 or busy[0] in exclude:
            return None  # none, or several (a whole replica busy: a heavy batch, or no single culprit)
        culprit = busy[0]
        others = [1.0 - free[r] for r in heard if r != culprit]
        waiting = float(np.median(others))
        if waiting < WAIT_SHARE:
            return None
        b = heard[culprit]
        if len(b.busy_per_op) < MIN_HISTORY - 1:
            return None
        usual_per_op = float(np.median(b.busy_per_op))
        ops = (b.seq or 0) - (b.seq0 or 0)
        if usual_per_op <= 0 or ops <= 0:
            return None
        # the op it is in counts whole but is half done (a whole iteration's ops are all done)
        done = ops - 0.5 if b.recent and b.recent[-1][0] else ops
        per_op = b.busy * elapsed / b.beats / max(done, 0.5)
        factor = min(MAX_FACTOR, per_op / usual_per_op)
        if factor < 1.0 + over:
            return None  # it computes at its usual pace: something else held the iteration up (a stall)
        self._judged = True
        return InFlightVerdict(culprit, factor, elapsed, usual, per_op, usual_per_op, free[culprit], waiting,
                               sum(1 for o in others if o >= WAIT_SHARE))


__all__ = ["InFlight", "InFlightVerdict"]
