"""``resihp plan``: search a new TP/PP/DP plan for a cluster, model and current plan.

    resihp plan --cluster C.json --model M.json --current P.json [--finding F.json]
                [--batch B.json | --tokens-per-microbatch N] [--now T] [--json] [--out FILE]

Prints a readable summary (what changes, why, predicted before/after) and then the decision
with the chosen plan as JSON (``--json``: only the JSON). Input formats: docs/plan-inputs.md.
Bad or infeasible input (malformed JSON, no healthy device, a model that cannot fit,
contradictory shapes) prints ``resihp plan: error: ...`` and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.coordinator.planner.planner import Decision, PlannerConfig, apply_finding, decide, simulate_plan

KINDS = ("fail-slow", "fail-stop", "recovered")


@dataclass(frozen=True)
class FindingInput:
    """The fields of a detector Finding the planner reads (a Finding's to_json() parses)."""

    kind: str
    ranks: tuple[int, ...]
    factor: float = 1.0
    cause: str = "unknown"
    time_s: float | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FindingInput:
        if not isinstance(data, Mapping):
            raise SpecError(f"finding must be a JSON object, got {type(data).__name__}")
        kind = data.get("kind")
        if kind not in KINDS:
            raise SpecError(f"finding: field 'kind' must be one of {list(KINDS)}, got {kind!r}")
        ranks = data.get("ranks")
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise SpecError(f"finding: field 'ranks' must be a non-empty list of integers, got {ranks!r}")
        factor = data.get("factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise SpecError(f"finding: field 'factor' must be a positive number, got {factor!r}")
        if kind == "fail-slow" and factor <= 1.0:
            raise SpecError(f"finding: a fail-slow needs factor > 1 (observed / predicted time), got {factor}")
        time_s = data.get("time_s")
        if time_s is not None and (isinstance(time_s, bool) or not isinstance(time_s, (int, float))):
            raise SpecError(f"finding: field 'time_s' must be a number, got {time_s!r}")
        return cls(kind, tuple(ranks), float(factor), str(data.get("cause") or "unknown"),
                   None if time_s is None else float(time_s))


def _load(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise SpecError(f"{what} file {path!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{what} file {path!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except OSError as exc:
        raise SpecError(f"cannot read {what} file {path!r}: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resihp plan", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--cluster", required=True, help="cluster JSON (devices, speeds, failures, links)")
    p.add_argument("--model", required=True, help="model JSON (a ModelSpec or {\"preset\": NAME})")
    p.add_argument("--current", required=True, help="current plan JSON (Plan.to_dict or tp/pp/dp shorthand)")
    p.add_argument("--finding", help="the finding that triggered planning (kind, ranks, factor)")
    p.add_argument("--batch", help="global batch JSON (microbatches, tokens_per_microbatch, seqlens)")
    p.add_argument("--tokens-per-microbatch", type=int, default=4096,
                   help="token budget of a micro-batch when --batch is not given (default 4096)")
    p.add_argument("--now", type=float, default=None, help="current time in seconds (default: the finding's time)")
    p.add_argument("--json", action="store_true", help="print only the decision JSON")
    p.add_argument("--out", help="also write the chosen plan JSON to this file")
    return p


def _shape(plan: Plan) -> str:
    tps = sorted({len(g) for rep in plan.replicas for g in rep.stages})
    tp = str(tps[0]) if len(tps) == 1 else "/".join(map(str, tps))
    return f"TP{tp} PP{plan.pp} DP{plan.dp} ({len(plan.ranks())} ranks, {len(plan.spares)} spares)"


def summary(current: Plan, d: Decision, simulated_s: float | None) -> list[str]:
    lines = [f"decision: {'RE-PLAN' if d.act else 'keep the current plan'} (level: {d.level})", f"why: {d.reason}"]
    before = "cannot run" if d.predicted_iteration_s_before == float("inf") else f"{d.predicted_iteration_s_before:.3f} s"
    lines.append(f"predicted iteration: {before} -> {d.predicted_iteration_s_after:.3f} s (closed form)")
    if simulated_s is not None:
        tokens = d.tokens_per_s_after * d.predicted_iteration_s_after
        lines.append(f"schedule simulator: {simulated_s:.3f} s per iteration, {tokens / simulated_s:,.0f} tokens/s")
    if not d.act:
        return lines
    new = d.plan
    lines.append(f"shape: {_shape(current)} -> {_shape(new)}")
    dropped = sorted(set(current.ranks()) - set(new.ranks()))
    added = sorted(set(new.ranks()) - set(current.ranks()))
    if dropped:
        lines.append(f"ranks leaving the layout: {dropped[:32]}{' ...' if len(dropped) > 32 else ''}")
    if added:
        lines.append(f"ranks joining the layout: {added[:32]}{' ...' if len(added) > 32 else ''}")
    old_reps = {rep.stages: rep for rep in current.replicas}
    same = sum(1 for rep in new.replicas if rep.stages in old_reps)
    resplit = sum(1 for rep in new.replicas if rep.stages in old_reps and old_reps[rep.stages].layers != rep.layers)
    reshared = sum(
        1 for rep in new.replicas if rep.stages in old_reps and old_reps[rep.stages].microbatches != rep.microbatches
    )
    lines.append(
        f"replicas: {same} of {new.dp} keep their TP groups ({resplit} with a new layer split, {reshared} with a new "
        f"micro-batch share); {new.dp - same} newly formed"
    )
    for i, rep in enumerate(new.replicas[:8]):
        lines.append(f"  replica {i}: TP sizes {[len(g) for g in rep.stages]} layers {list(rep.layers)} micro-batches {rep.microbatches}")
    if new.dp > 8:
        lines.append(f"  ... {new.dp - 8} more replicas")
    lines.append(f"state to move: {d.move_bytes / 2**30:.2f} GiB, {d.move_s:.2f} s")
    return lines


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster = Cluster.from_dict(_load(args.cluster, "cluster"))
        model = ModelSpec.from_dict(_load(args.model, "model"))
        current = Plan.from_dict(_load(args.current, "current plan"))
        finding = FindingInput.from_dict(_load(args.finding, "finding")) if args.finding else None
        if args.batch:
            batch = GlobalBatch.from_dict(_load(args.batch, "batch"))
            # a token-share plan's shares count in tokens (its micro-batch counts may differ)
            if batch.microbatches != current.batch_microbatches(batch.tokens_per_microbatch):
                raise SpecError(
                    f"contradictory input: the batch has {batch.microbatches} micro-batches but the current plan's "
                    f"shares sum to {current.batch_microbatches(batch.tokens_per_microbatch)}"
                )
        else:
            if args.tokens_per_microbatch < 1:
                raise SpecError(f"--tokens-per-microbatch must be >= 1, got {args.tokens_per_microbatch}")
            if current.global_microbatches < 1:
                raise SpecError("current plan: its micro-batch shares sum to 0; give every replica its share")
            batch = GlobalBatch(current.batch_microbatches(args.tokens_per_microbatch), args.tokens_per_microbatch)
        if not cluster.healthy():
            raise SpecError("cluster: every device has failed; there is no healthy device to plan for")
        now = args.now if args.now is not None else (finding.time_s if finding and finding.time_s is not None else 0.0)
        config = PlannerConfig()
        decision = decide(cluster, model, batch, current, finding, now, config)
        simulated = simulate_plan(decision.plan, apply_finding(cluster, finding), model, batch, config).iteration_s
    except SpecError as exc:
        print(f"resihp plan: error: {exc}", file=sys.stderr)
        return 2
    out = decision.to_dict()
    out["simulated_iteration_s"] = simulated
    if not args.json:
        print("\n".join(summary(current, decision, simulated)))
        print()
    print(json.dumps(out, indent=None if args.json else 2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(decision.plan.to_dict(), fh, indent=2)
            fh.write("\n")
    return 0
