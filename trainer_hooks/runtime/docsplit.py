"""Which documents of a global batch each replica trains, and how it packs them (pure).

A token-share plan (docs/plan-inputs.md, "Document shares") gives each replica a share of
the global batch's tokens, not a run of whole micro-batches. The data path meets it by the
document: the batch's documents, in stream order, are cut into one contiguous run per
replica; a document goes to the replica whose part of the token line holds its midpoint, so
each replica's tokens differ from its share by less than one document (half of one at each
end of its run). Every rank computes the same cut from the document lengths and the shares
alone: replicas agree without talking, and the batch itself never depends on the plan.

A replica then packs its run into its plan's micro-batch count (the coordinator's schedule
model and layout check read that count from its reports; data.py pads a replica that has
fewer documents than micro-batches): the longest document
first into the least-loaded micro-batch that holds it under the token cap, ties to the
lower index. Where the documents leave no room, one goes to the least-loaded micro-batch
anyway, which then exceeds the cap by less than one document: cutting the document instead
would change what its later tokens attend to, so the loss. The cap is a memory budget (the
planner prices share / count tokens per micro-batch), not a limit of the model: positions
restart in every document, so the position table bounds a document's length (at most the
stream's micro-batch), not a micro-batch's.
"""
from __future__ import annotations

from collections.abc import Sequence


def split_runs(lengths: Sequence[int], shares: Sequence[int]) -> list[range]:
    """One contiguous run of document indices per share (empty for a share of 0).

    Document ``i`` covers tokens ``[s, s + l)`` of the batch; it goes to replica ``r`` when
    its midpoint lies in ``[B(r-1), B(r))``, ``B(r) = total · (share_0 + … + share_r) / Σ share``.
    Exact integer arithmetic (twice the midpoint against twice the boundary), so every rank
    cuts alike whatever its float rounding.
    """
    if not shares or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"shares must be >= 0 with a positive sum, got {list(shares)}")
    if any(n < 1 for n in lengths):
        raise ValueError("every document needs at least one token")
    total, weight = sum(lengths), sum(shares)
    cum: list[int] = []
    acc = 0
    for s in shares:
        acc += s
        cum.append(acc)
    starts = [0] * len(shares)
    r, pos = 0, 0
    for i, n in enumerate(lengths):
        mid2 = 2 * pos + n  # twice the document's midpoint
        while r < len(shares) - 1 and mid2 * weight >= 2 * total * cum[r]:
            r += 1
            starts[r] = i
        pos += n
    for k in range(r + 1, len(shares)):  # replicas past the last document: empty runs at the end
        starts[k] = len(lengths)
    ends = [*starts[1:], len(lengths)]
    return [range(a, b) for a, b in zip(starts, ends)]


def pack(lengths: Sequence[int], count: int, cap: int) -> list[list[int]]:
    """Documents (indices into ``lengths``) packed into ``count`` micro-batches, each under
    ``cap`` tokens where the documents allow (then over it by less than one document), none
    left empty (fewer than ``count`` only when there are fewer documents). Longest first into
    the least-loaded micro-batch that holds it, so micro-batches come out near even (what the
    planner priced); each keeps its documents in stream order."""
    if count < 1 and lengths:
        raise ValueError(f"{len(lengths)} documents need at least one micro-batch")
    bins: list[list[int]] = [[] for _ in range(min(count, len(lengths)))]
    loads = [0] * len(bins)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        best, least = -1, 0
        for b, load in enumerate(loads):
            if load < loads[least]:
                least = b
            if load + n <= cap and (best < 0 or load < loads[best]):
                best = b
        best = least if best < 0 else best  # no room under the cap: the count holds, the cap gives
        bins[best].append(i)
        loads[best] += n
    return [sorted(b) for b in bins]
