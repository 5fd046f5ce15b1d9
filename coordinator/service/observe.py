"""Observe-only jobs: what the coordinator does for a job it must not reshape.

A rank's hello says whether its runtime applies a ReconfigCommand (``LocalRank.reshapes``):
a loop that keeps its own model (torch DDP, nanoGPT) says no. A job with such a rank, or
with a live rank that never said, is *observe-only*: its findings go to the event log, the
metrics, ``resihp admin status`` and, once each, to the trainers as a ``NoticeCommand``;
the planner is never asked and no ReconfigCommand is ever sent, so nothing can fail to
apply and the job is never aborted by resihp. A fail-stop becomes a ``peer-failure`` notice
to every rank: their process group is broken, and the hooks say so and end the survivors
instead of letting them hang in a collective. A part of ``CoordinatorCore``
(coordinator/service/core.py), kept in its own module; every method runs under the core's lock.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from resihp.coordinator.model.plan import Plan, relayer
from resihp.coordinator.model.spec import ModelSpec, SpecError, same_shape
from resihp.coordinator.protocol import messages as m
from resihp.coordinator.service.records import RankInfo

if TYPE_CHECKING:
    from resihp.coordinator.service.config import CoordinatorConfig
    from resihp.coordinator.service.engine import Engine
    from resihp.coordinator.service.joiner import Joiner
    from resihp.coordinator.service.journal import EventLog, Journal
    from resihp.coordinator.service.metrics import Registry
    from resihp.coordinator.service.records import AgentConn
    from resihp.coordinator.service.trace_sink import TraceSink

log = logging.getLogger(__name__)


def compact(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": a rank list that stays short at 1,024 ranks."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def observe_only_reason(ranks: dict[int, RankInfo]) -> str:
    """Why a job must not be reshaped ("" = every rank said it can be). Pure."""
    no = [r for r, i in ranks.items() if i.reshapes is False]
    if no:
        return (f"rank{'s' if len(no) > 1 else ''} {compact(no)} run{'' if len(no) > 1 else 's'} without live "
                "reconfiguration (a loop that keeps its own model): findings are reported, never acted on")
    unknown = [r for r, i in ranks.items() if i.reshapes is None and not i.dead and not i.finished]
    if unknown:
        return (f"rank{'s' if len(unknown) > 1 else ''} {compact(unknown)} ha{'ve' if len(unknown) > 1 else 's'} not "
                "said whether they can be reshaped (no hello yet): nothing is commanded until they do")
    return ""


def finding_text(f: m.FindingInfo) -> str:
    """A finding as the one line a trainer prints (after "resihp: ")."""
    who = f"rank{'s' if len(f.ranks) > 1 else ''} {compact(f.ranks)}"
    if f.kind == "recovered":
        return f"recovered: {who} back to normal ({f.reason})"
    return f"{f.kind} finding: {who} {f.cause} ×{f.factor:.2f} ({f.reason})"


def failure_text(rank: int, info: RankInfo, f: m.FindingInfo) -> str:
    """What happened to a dead rank, for its peers' summary."""
    where = f" on node {info.node}" if info.node else ""
    if f.cause == "process-exit" and info.exit_code is not None:
        return f"rank {rank} (pid {info.pid}){where} {m.describe_exit(info.exit_code)}"
    return f"rank {rank}{where}: {f.reason}"


class ObserveFlow:
    """Mixed into ``CoordinatorCore``: the methods below use its state."""

    config: CoordinatorConfig
    clock: Callable[[], float]
    events: EventLog
    metrics: Registry
    ranks: dict[int, RankInfo]
    agents: dict[str, AgentConn]
    epoch: int
    seq: int
    t0: float
    model_json: str
    _own_loop_detection: bool
    plan: Plan
    resumed: bool
    last_iteration: int
    joiner: Joiner
    journal: Journal
    engine: Engine
    trace: TraceSink | None

    if TYPE_CHECKING:  # the core's methods these use (coordinator/service/core.py, planning.py)
        def _send_all(self, batch: m.CoordinatorBatch) -> None: ...
        def _notify(self, kind: str, payload: Any) -> None: ...
        def _journal_command(self, cmd: m.Command, await_acks: bool) -> None: ...

    def observe_only(self) -> str:
        """Why this job is only observed ("" = it can be reshaped)."""
        return observe_only_reason(self.ranks)

    def _capability(self, lr: m.LocalRank) -> None:
        """Record what a joining rank said: whether it reshapes, and the model it trains."""
        info = self.ranks[lr.rank]
        said_no = info.reshapes is not False and not lr.reshapes
        info.reshapes = lr.reshapes
        if lr.model_json and lr.model_json != self.model_json:
            try:
                name = str(json.loads(lr.model_json).get("name", "?"))
            except (ValueError, AttributeError):
                name = "?"
            first = not self.model_json
            self.model_json = lr.model_json
            self.events.emit("trainer-model", rank=lr.rank, model=json.loads(lr.model_json),
                             reason=f"rank {lr.rank} trains model {name!r}"
                                    + ("" if first else " (it differs from what another rank said)"))
            if first:
                self._adopt_model(lr.model_json)
        why = self.observe_only()
        self.metrics.set("resihp_observe_only", 1 if why else 0, {"job": self.config.job})
        if said_no and not self._own_loop_detection:
            self._adaptive_detection()
        if said_no:  # once per rank process that says it cannot be reshaped (not for a hello still to come)
            self.events.emit("observe-only", rank=lr.rank, reason=f"rank {lr.rank} runs without live reconfiguration; "
                                                                  f"the job is observe-only: {why}")

    def _adaptive_detection(self) -> None:
        """An observe-only job is a loop resihp does not run (DDP, nanoGPT): its evidence is each
        rank's own forward spans, which on shared hosts swing by tens of per cent from one
        iteration to the next. Judge them against each rank's own healthy spread
        (coordinator/detector/noise.py), unless the operator chose (policy ``adaptive``)."""
        self._own_loop_detection = True
        if "adaptive" in self.config.policy:
            return
        try:
            self.engine.set_policy({"adaptive": "on"})
        except ValueError as exc:  # an engine without the option (the rule engine)
            log.info("observe-only job: no noise-adaptive detection (%s)", exc)
            return
        self.events.emit("detection-policy", policy={"adaptive": "on"},
                         reason="observe-only job: each rank's timings are judged against its own healthy spread "
                                "(noise-adaptive detection; `resihp admin policy adaptive=off` to turn it off)")

    def _adopt_model(self, text: str) -> None:
        """Price the job as the model the trainers said they train (their first hello), not the
        one the coordinator was started with, while nothing has been judged or commanded: the
        detector's cost model, the planner and the trace header follow it. Later, a different
        model is said loudly and left alone (the job's history was priced by the other)."""
        try:
            spec = ModelSpec.from_dict(json.loads(text))
        except (SpecError, ValueError, TypeError) as exc:
            self.events.emit("model-mismatch", reason=f"the trainers' model spec cannot be read ({exc}); this "
                                                      f"coordinator keeps pricing {self.engine.header.model.name}")
            return
        header = self.engine.header
        if same_shape(spec, header.model):
            return
        was = f"{header.model.name} ({header.model.num_layers} layers, hidden {header.model.hidden})"
        said = f"{spec.name} ({spec.num_layers} layers, hidden {spec.hidden})"
        if self.resumed or self.seq or self.last_iteration >= 0:
            self.events.emit("model-mismatch", reason=f"the trainers train {said}, this coordinator prices {was} and "
                                                      "has judged iterations by it; restart the job with "
                                                      f"`resihp launch --model` naming the trainers' model")
            return
        try:
            # the same depth keeps the plan's own layer split (a --plan file's may be uneven)
            plan = self.plan if spec.num_layers == header.model.num_layers else relayer(self.plan, spec)
        except SpecError as exc:
            self.events.emit("model-mismatch", reason=f"the trainers train {said}, which the coordinator's layout "
                                                      f"{self.plan.describe()} cannot hold ({exc}); it keeps pricing {was}")
            return
        if plan is not self.plan:
            self.plan = plan
            self.joiner.add_plan(plan)
            self.journal.plan(plan)
        new = replace(header, model=spec, plan=plan)
        self.engine.set_model(new)
        if self.trace is not None:
            self.trace.replace_header(new)
        self.events.emit("model-adopted", model=spec.to_dict(), plan=plan.to_dict(),
                         reason=f"the trainers train {said}; this coordinator was started with {was}: it prices "
                                "the trainers' model")

    def _observe(self, f: m.FindingInfo, why: str) -> None:
        """A finding on an observe-only job: logged as a decision that does not act, and told to
        the trainers once (a fail-stop as a peer-failure notice, one per dead rank)."""
        self.events.emit("decision", epoch=self.epoch, act=False, level="observe-only",
                         reason=f"observe-only ({why}); {f.kind} on ranks {list(f.ranks)} reported to the trainers")
        if f.kind != "fail-stop":
            self._send_notice(m.NoticeCommand(self.epoch, finding_text(f), kind="finding"))
            return
        for r in f.ranks:
            info = self.ranks[r]
            self._send_notice(m.NoticeCommand(
                self.epoch, failure_text(r, info, f), kind="peer-failure", rank=r, cause=f.cause,
                code=info.exit_code if info.exit_code is not None else m.EXIT_UNKNOWN, time_s=self.t0 + f.time_s,
                iteration=info.iteration))

    def _send_notice(self, notice: m.NoticeCommand) -> None:
        self.seq += 1
        cmd = m.NoticeCommand(notice.epoch, notice.text, reason=notice.text, seq=self.seq, issued_s=self.clock(),
                              kind=notice.kind, rank=notice.rank, cause=notice.cause, code=notice.code,
                              time_s=notice.time_s, iteration=notice.iteration)
        self._journal_command(cmd, await_acks=False)  # its seq must never be reused after a restart
        self.metrics.inc("resihp_notices_total", 1, {"kind": cmd.kind, "job": self.config.job})
        self.events.emit("notice", command_seq=cmd.seq, kind=cmd.kind, rank=cmd.rank, reason=cmd.text)
        self._send_all(m.CoordinatorBatch(commands=(cmd,)))
        self._notify("notice", cmd)
