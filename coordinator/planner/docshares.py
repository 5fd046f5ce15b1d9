"""Data-parallel shares cut by the packed document, not the micro-batch.

A global batch is a set of packed documents; under the token-weighted mean gradient any
assignment of them to replicas trains the same step. So a replica running at 93 % speed can
take 93 % of a share, to within one document, where whole micro-batches leave it a full
share (or hand a healthy replica one more: +1/m per iteration).

Given a plan (its groups and layer splits fixed: no state moves), ``document_shares`` gives
every replica a number of documents d and packs them into m micro-batches, choosing per
replica between the two forms the schedule prices differently:

- *same count*: the micro-batch count a replica of an even split runs (⌈M / dp⌉), its
  micro-batches smaller or larger by the share (the pipeline bubble shrinks with them);
- *fewer*: as few micro-batches as the largest allowed micro-batch permits (fewer
  per-micro-batch latencies, a bubble of full-size micro-batches);

whichever ``Costs.pipeline_time`` prices lower. The largest micro-batch must fit: its
activations are checked against each stage's device memory, and it never exceeds
``PlannerConfig.max_microbatch_tokens``. Shares then minimise the makespan by the exact
greedy of planner.shares over documents (a replica's time is made non-decreasing in d by a
running maximum, an upper bound the chosen packing meets). Pure and deterministic.
"""
from __future__ import annotations

import math

from resihp.coordinator.model.plan import PipelinePlan, Plan
from resihp.coordinator.planner.cost import INF, Costs, PipeSig, cluster_tables, device_layers, evaluate_with
from resihp.coordinator.planner.shares import allocate_shares, max_m_search

_GAIN = 1e-9  # relative: a document split that prices no better keeps the plan as it is


class _ReplicaDocs:
    """One class of identical replicas: time and packing as functions of its documents."""

    def __init__(self, costs: Costs, sig: PipeSig, layers: tuple[int, ...], link: tuple[float, ...] | None,
                 n: int, same: int, cap: float) -> None:
        self.costs, self.sig, self.layers, self.link = costs, sig, layers, link
        self.n, self.same, self.cap = n, same, cap
        self._t: list[float] = [0.0]  # running maximum of the best time, by documents
        self._m: list[int] = [0]  # the micro-batch count that prices the best time

    def _price(self, d: int, m: int) -> float:
        frac = d / (self.n * m)
        peak = math.ceil(d / m) / self.n
        if peak > self.cap + 1e-12:
            return INF
        t = self.costs.pipeline_time(self.sig, self.layers, m, frac, peak)
        if self.link is not None:
            t += self.costs.link_extra_s(self.link, m) * frac
        return t

    def _extend(self, d: int) -> None:
        while len(self._t) <= d:
            k = len(self._t)
            fewer = max(1, math.ceil(k / (self.n * self.cap) - 1e-9))
            options = sorted({fewer, max(self.same, 1)})
            best_t, best_m = min((self._price(k, m), m) for m in options)
            self._t.append(max(best_t, self._t[-1]))
            self._m.append(best_m)

    def time(self, m: int) -> float:  # planner.shares.TimeModel, in documents
        self._extend(m)
        return self._t[m]

    def max_m(self, tau: float, limit: int) -> int:
        return max_m_search(self.time, tau, 0, limit)

    def microbatches(self, d: int) -> int:
        self._extend(d)
        return self._m[d] if d else 0


def document_cap(costs: Costs) -> float | None:
    """The largest micro-batch a document share may pack, as a fraction of the batch's
    (whole documents), or None when shares stay whole micro-batches (one document per
    micro-batch, an interleaved schedule, or a cap below one document)."""
    batch = costs.batch
    n = batch.documents_per_microbatch
    if n < 2 or costs.v > 1:
        return None
    cap_tokens = costs.config.max_microbatch_tokens or batch.tokens_per_microbatch
    cap = math.floor(cap_tokens * n / batch.tokens_per_microbatch) / n
    return cap if cap > 0.0 else None


def busiest_microbatches(microbatches: int, dp: int, documents: bool) -> tuple[float, float]:
    """For a makespan's lower bound: (micro-batches the busiest of ``dp`` replicas runs beyond
    its first, the size of that first as a fraction of a micro-batch). Whole shares: some
    replica runs ⌈M/dp⌉ full micro-batches. Document shares: some replica holds ≥ M/dp
    micro-batches' tokens in micro-batches of at most one's, so at least M/dp − 1 of them
    beyond its first, and that first is ≥ min(1, M/dp) of one."""
    if documents:
        return max(microbatches / dp - 1.0, 0.0), min(1.0, microbatches / dp)
    return float(math.ceil(microbatches / dp) - 1), 1.0


def document_makespan(costs: Costs, classes: list[tuple[PipeSig, tuple[int, ...]]], counts: list[int],
                      dp: int) -> float | None:
    """The makespan of replica classes (each a stage signature and its layers per device,
    ``counts`` copies) under document-granular shares: what a shape search ranks a shape by
    when ``document_shares`` will cut its batch by the document. None when shares stay whole
    or nothing fits."""
    cap = document_cap(costs)
    if cap is None:
        return None
    batch = costs.batch
    n = batch.documents_per_microbatch
    same = math.ceil(batch.microbatches / dp)
    models = [_ReplicaDocs(costs, sig, layers, None, n, same, cap) for sig, layers in classes]
    got = allocate_shares(models, counts, batch.microbatches * n)
    if got is None or got[0] == INF:
        return None
    return got[0]


def document_shares(costs: Costs, plan: Plan) -> Plan | None:
    """``plan`` with document-granular shares, or None when they price no better (or the
    batch has one document per micro-batch, or the schedule is interleaved: its micro-batch
    counts are tied to the pipeline depth)."""
    batch = costs.batch
    n = batch.documents_per_microbatch
    b = batch.tokens_per_microbatch
    cap = document_cap(costs)
    if cap is None or not plan.replicas:
        return None
    tab = cluster_tables(costs.cluster)
    same = math.ceil(batch.microbatches / plan.dp)
    classes: dict[tuple[object, ...], _ReplicaDocs] = {}
    order: list[tuple[object, ...]] = []
    for rep in plan.replicas:
        sig = costs.sig(rep.stages)
        layers = tuple(device_layers(rep.layers, rep.pp))
        link = None
        if tab.slow_links and any(r in tab.slow_links for g in rep.stages for r in g):
            link = tuple(max(tab.slow_links.get(r, 1.0) for r in g) for g in rep.stages)
        key = (sig.stages, layers, link)
        if key not in classes:
            classes[key] = _ReplicaDocs(costs, sig, layers, link, n, same, cap)
        order.append(key)
    keys = list(classes)
    counts = [order.count(k) for k in keys]
    got = allocate_shares([classes[k] for k in keys], counts, batch.microbatches * n)
    if got is None or got[0] == INF:
        return None
    pending = {k: list(row) for k, row in zip(keys, got[1])}
    docs = [pending[k].pop(0) for k in order]  # members of a class are interchangeable
    total = batch.microbatches * b
    tokens = [d * b // n for d in docs]
    tokens[max(range(len(docs)), key=lambda i: docs[i])] += total - sum(tokens)  # integer rounding
    reps = tuple(
        PipelinePlan(rep.stages, rep.layers, classes[k].microbatches(d), t if d else 0)
        for rep, k, d, t in zip(plan.replicas, order, docs, tokens)
    )
    out = Plan(reps, plan.schedule, plan.virtual_chunks, plan.epoch, plan.spares, plan.reason)
    before = evaluate_with(costs, plan).iteration_s
    after = evaluate_with(costs, out).iteration_s
    if not after < before * (1.0 - _GAIN):
        return None
    return out
