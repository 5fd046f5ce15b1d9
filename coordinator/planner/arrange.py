"""How a shape's selected TP groups form pipelines: the three fixed arrangements the search
tries first, and the one-swap neighbourhood its local search climbs. Pure."""
from __future__ import annotations

from resihp.coordinator.planner.tables import StageKey


def arrange(sel: list[tuple[StageKey, int]], pp: int, dp: int, arrangement: str) -> list[tuple[list[StageKey], int]]:
    """The dp pipelines of pp groups each, as (group types, count), that an arrangement makes of
    ``sel`` (the selected groups as types with counts, fastest first): concentrated (slow
    groups share pipelines), spread (pipeline j gets the j-th, (j+dp)-th, ... fastest) or
    snaked (the fastest paired with the slowest)."""
    out: list[tuple[list[StageKey], int]] = []
    if arrangement == "concentrate":
        partial: list[StageKey] = []
        for key, count in sel:
            if partial:
                take = min(count, pp - len(partial))
                partial.extend([key] * take)
                count -= take
                if len(partial) == pp:
                    out.append((partial, 1))
                    partial = []
                if not count:  # all of this type went into the partial pipeline: keep it
                    continue
            full, rest = divmod(count, pp)
            if full:
                out.append(([key] * pp, full))
            partial = [key] * rest
        return out
    if arrangement == "snake":
        # row i of the dp × pp grid runs left-to-right on even i, right-to-left on odd i:
        # the fastest groups pair with the slowest ones
        flat = [key for key, count in sel for _ in range(count)]
        pipes: dict[tuple[StageKey, ...], int] = {}
        for j in range(dp):
            keys_j = tuple(flat[i * dp + (j if i % 2 == 0 else dp - 1 - j)] for i in range(pp))
            pipes[keys_j] = pipes.get(keys_j, 0) + 1
        return [(list(k), c) for k, c in pipes.items()]
    # spread: pipeline j gets the j-th, (j+dp)-th, ... fastest groups
    flat_bounds: list[tuple[int, StageKey]] = []
    start = 0
    for key, count in sel:
        flat_bounds.append((start, key))
        start += count
    cuts = {0, dp}
    for i in range(pp):
        for b, _ in flat_bounds:
            j = b - i * dp
            if 0 < j < dp:
                cuts.add(j)
    edges = sorted(cuts)
    starts = [b for b, _ in flat_bounds]
    for lo, hi in zip(edges, edges[1:]):
        keys = []
        for i in range(pp):
            idx = i * dp + lo
            t = max(x for x in range(len(starts)) if starts[x] <= idx)
            keys.append(flat_bounds[t][1])
        out.append((keys, hi - lo))
    return out


def swaps(pipes: list[list[StageKey]]) -> list[list[list[StageKey]]]:
    """Every layout one swap away: a group of pipeline i traded for one of another type in j."""
    out = []
    for i in range(len(pipes)):
        for j in range(i + 1, len(pipes)):
            for a in sorted(set(pipes[i])):
                for b in sorted(set(pipes[j])):
                    if a != b:
                        trial = [list(p) for p in pipes]
                        trial[i][trial[i].index(a)] = b
                        trial[j][trial[j].index(b)] = a
                        out.append(trial)
    return out
