"""What a fail-slow finding costs the job: the schedule simulation with the slow ranks
stretched, against every device healthy (``FindingCost._impact``), and the finding's kind by
it — `degraded` below the impact floor (``_priced``). A part of ``IterationJudge``; the
in-flight path prices its findings the same way."""
from __future__ import annotations

from collections import deque

import numpy as np
import numpy.typing as npt

from resihp.coordinator.detector.config import DetectorConfig
from resihp.coordinator.detector.evidence import BWD, FWD, PlanIndex
from resihp.coordinator.detector.predictor import Predictor
from resihp.coordinator.detector.verdicts import FindingKind

FloatArray = npt.NDArray[np.float64]


class FindingCost:
    """Prices findings (module docstring)."""

    # the detector's state this part reads (set by Detector.__init__ and _alloc)
    config: DetectorConfig
    index: PlanIndex
    predictor: Predictor
    # the last judged iterations' predictions (per TP group) and observed iteration seconds
    _recent: deque[tuple[FloatArray, FloatArray, float]]

    def _priced(self, kind: FindingKind, cost: tuple[float, float] | None, reason: str,
                evidence: dict[str, float]) -> tuple[FindingKind, str]:
        """A slow finding with its cost (``_impact``) in its evidence and reason: `degraded`
        below the impact floor."""
        if cost is None:
            return kind, reason
        evidence["cost_s"], evidence["cost_share"] = cost
        reason += f"; it costs the job {cost[0] * 1e3:.1f} ms per iteration ({cost[1]:.1%})"
        if cost[1] < self.config.impact_floor:
            return "degraded", reason + f", below the {self.config.impact_floor:.0%} floor: degraded, not worth a re-plan"
        return kind, reason

    def _impact(self, members: list[int], factor: float, cause: str, ring: bool,
                dp_ratio: float = 1.0) -> tuple[float, float] | None:
        """(seconds per iteration the job loses to ``members`` running at ``factor``, that over
        the iteration the job runs without it), averaged over the last ``COST_WINDOW`` judged
        iterations' batches (which replica is the longest changes with the batch): the
        compiled schedule over the predicted op and transfer times, each rank's DP all-reduce
        and optimizer step after its own last op, with the members' ops (compute) or the
        transfers their NIC carries (link: in and out across nodes, and their DP rings by the
        ratio measured on them; DP ring: its all-reduce) stretched, against every device
        healthy. The share's denominator is the observed iteration less that cost (never under
        the healthy schedule): pauses and noise are part of the iteration a user waits for.
        None without per-op predictions (coarser evidence)."""
        if not self._recent or cause not in ("compute", "communication"):
            return None
        ix, pred = self.index, self.predictor
        idx = np.asarray(members, dtype=np.int64)
        # predictions are per TP group: a group's op lasts as long as its slowest member
        grp = ix.group_of[idx]
        dp, opt = np.nan_to_num(pred.dp()), np.nan_to_num(pred.opt())
        rings = np.isin(ix.ring, ix.ring[idx])  # an all-reduce is as slow as its slowest member
        link = self._link_transfers(idx)[:, None, :, None] if cause == "communication" and not ring else None
        costs, shares = [], []
        for p_comp, p_p2p, observed in self._recent:
            healthy = pred.iteration_by_rank(p_comp, p_p2p, dp, opt)
            if not np.isfinite(healthy) or healthy <= 0:
                continue
            if cause == "compute":
                c2 = p_comp.copy()
                c2[grp] *= factor
                slow = pred.iteration_by_rank(c2, p_p2p, dp, opt)
            elif link is None:
                slow = pred.iteration_by_rank(p_comp, p_p2p, np.where(rings, dp * factor, dp), opt)
            else:
                # a slow NIC slows its rank's DP ring as well, by the ratio measured on it
                ratio = dp_ratio if np.isfinite(dp_ratio) and dp_ratio > 1.0 else 1.0
                slow = pred.iteration_by_rank(p_comp, np.where(link, p_p2p * factor, p_p2p),
                                              np.where(rings, dp * ratio, dp), opt)
            costs.append(max(0.0, slow - healthy))
            runs = observed - costs[-1] if np.isfinite(observed) else healthy
            shares.append(costs[-1] / max(healthy, runs))
        if not costs:
            return None
        return float(np.mean(costs)), float(np.mean(shares))

    def _link_transfers(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """(TP group, direction) of the inbound transfers a slow NIC of ``idx`` slows: those
        that leave or enter its node, in and out (predictions are per TP group: a group's hop
        lasts as long as its slowest member's). Transfers inside a node, and a neighbour's
        transfers from its other side, keep their times. Every transfer of the members' groups
        where none crosses a node."""
        ix = self.index
        hit = np.zeros((ix.n, 2), dtype=np.bool_)
        # i receives forward from bwd_recv[i] and backward from fwd_recv[i]
        hit[idx, FWD] = ix.cross_bwd[idx]
        hit[idx, BWD] = ix.cross_fwd[idx]
        for nbr, d, cross in ((ix.fwd_recv, FWD, ix.cross_fwd), (ix.bwd_recv, BWD, ix.cross_bwd)):
            ok = (nbr[idx] >= 0) & cross[idx]
            hit[nbr[idx][ok], d] = True
        if not hit.any():
            hit[idx] = True
        rows = np.zeros((ix.n_groups, 2), dtype=np.bool_)
        np.logical_or.at(rows, ix.group_of, hit)
        return rows


__all__ = ["FindingCost"]
