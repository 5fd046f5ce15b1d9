"""The real decision engine: coordinator/detector/detector.py + the planner, behind ``Engine``.

Detection is the workload-aware ``Detector`` as its owner wrote it (its findings are
converted to ``FindingInfo``). Planning is ``planner.decide`` over a ``Cluster`` built from
the ranks the coordinator knows (node of each rank, the detector's speed estimate, dead
and excluded ranks marked failed) when that module is importable; until it is, the rule
planner of ``coordinator/service/engine.py`` plans, and ``name`` says which pair is running.
The planner's device FLOP/s and link speeds are measured from the job's healthy iterations
(``planner.profile.ProfileFitter``, policy ``profile=measured``, the default) once
``MIN_PROFILE_ITERATIONS`` were seen; until then, or with ``profile=configured``, they are
the configured ``links`` (``--cluster`` / ``--device-flops``).
Pure: no grpc, time passed in.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields, replace
from typing import Any

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.model.cluster import Cluster
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.coordinator.model.trace import (
    IterationRecord,
    OpState,
    PlanChange,
    Record,
    TraceError,
    TraceHeader,
    read_trace,
    trace_tail,
)
from resihp.coordinator.planner.decision import earlier_layouts
from resihp.coordinator.planner.profile import Profile, ProfileFitter, fit_trace
from resihp.coordinator.protocol.messages import FindingInfo
from resihp.coordinator.service.engine import EngineDecision, RuleEngine, parse_float

log = logging.getLogger(__name__)

MIN_PROFILE_ITERATIONS = 8  # healthy iterations before the measured profile prices plans
WARM_START_ITERATIONS = 128  # a restarted coordinator's profile replays this much of the trace's end (64 fill its window)


def to_info(f: Finding) -> FindingInfo:
    extra: dict[str, Any] = {"tp_group": None if f.tp_group is None else list(f.tp_group),
                             "evidence": {k: round(float(v), 6) for k, v in f.evidence.items()}}
    return FindingInfo(f.iteration, f.kind, tuple(f.ranks), f.cause, float(f.factor), f.reason, f.time_s,
                       f.stage, f.replica, extra)


def _until_error(records: Iterator[Record]) -> Iterator[Record]:
    try:
        yield from records
    except TraceError as exc:
        log.warning("trace: %s; the planner profile uses the records before it", exc)


def _planner() -> Any | None:
    try:
        mod = importlib.import_module("resihp.coordinator.planner.planner")
    except ImportError:
        return None
    return mod if hasattr(mod, "decide") else None


class RealEngine:
    def __init__(self, header: TraceHeader, config: DetectorConfig | None = None,
                 links: Mapping[str, float] | None = None) -> None:
        self.header = header
        self.links = dict(links or {})  # Cluster link / device_flops fields for the planner
        self.detector = Detector(header, config)
        self._rules = RuleEngine(header)  # planning fallback only
        self._planner = _planner()
        self.name = "detector+planner" if self._planner is not None else "detector+rule-planner"
        self._raw: dict[tuple[str, tuple[int, ...], int], Finding] = {}
        self._last: IterationRecord | None = None
        self._plan = header.plan  # the plan the records come from
        self._earlier: tuple[Plan, ...] = ()  # layouts run before it, most recent first (the planner's ``earlier``)
        self._tpm = header.tokens_per_microbatch  # the batch's tokens per micro-batch, else learned
        self.detection = True
        # links=off: no communication findings and no link factors for the planner (a CPU job
        # over loopback, where a P2P receive also waits for a slow sender)
        self.link_detection = True
        self.measured_profile = True
        # shares=whole: the planner keeps DP shares whole micro-batches (PlannerConfig.document_shares)
        self.document_shares = True
        self.fitter = self._fitter(header)

    def _fitter(self, header: TraceHeader) -> ProfileFitter:
        cfg = {**{f.name: f.default for f in fields(Cluster) if f.name != "devices"}, **self.links}
        return ProfileFitter(header.model, header.plan, intra_node_bw_Bps=cfg["intra_node_bw_Bps"],
                             inter_node_bw_Bps=cfg["inter_node_bw_Bps"], inter_node_latency_s=cfg["inter_node_latency_s"],
                             intra_node_latency_s=cfg["intra_node_latency_s"],
                             nodes=header.known_nodes())

    def hang_after_s(self) -> float:
        return self.detector.hang_after_s()

    def set_model(self, header: TraceHeader) -> None:
        """Price the job as the trainers' model (their hello), before any iteration is judged:
        detector, planner profile and rule fallback start afresh; the policy is kept."""
        self.header = header
        self.detector = Detector(header, self.detector.config)
        self._rules = RuleEngine(header)
        self.fitter = self._fitter(header)
        self._last = None
        self._plan = header.plan
        self._earlier = ()
        self._tpm = header.tokens_per_microbatch

    # --- detection -------------------------------------------------------------------------
    def _convert(self, found: list[Finding]) -> list[FindingInfo]:
        out = []
        for f in found:
            if not self.link_detection and f.cause == "communication":
                continue
            self._raw[(f.kind, tuple(f.ranks), f.iteration)] = f
            out.append(to_info(f))
        if len(self._raw) > 256:
            for key in list(self._raw)[:-64]:
                del self._raw[key]
        return out

    def observe(self, record: Record, now: float) -> list[FindingInfo]:
        if isinstance(record, IterationRecord):
            self._last = record
            if not self._tpm:
                self._learn_tokens_per_microbatch(record)
            if not self.detection:
                return []
        if isinstance(record, PlanChange):
            self._adopt(record.plan)
            self._rules.set_plan(record.plan, record.iteration)
            self.fitter.set_plan(record.plan)
        out = self._convert(self.detector.observe(record, now))
        # the profile learns from iterations every rank of the plan ran healthy
        if isinstance(record, IterationRecord) and self.detector.all_healthy():
            self.fitter.add(record)
        return out

    def _learn_tokens_per_microbatch(self, record: IterationRecord) -> None:
        """Under whole shares every micro-batch holds the batch's tokens per micro-batch (the
        packing fills each): learned once, it sizes the global batch of a later token-share
        plan, whose micro-batches hold any number (a coordinator not told it by its config)."""
        if self._plan.document_shares:
            return
        sums = {sum(mb) for rep in record.seqlens for mb in rep}
        if len(sums) == 1:
            self._tpm = sums.pop()

    def profile(self) -> Profile:
        """The measured profile (whether or not the policy lets it price plans)."""
        return self.fitter.profile()

    def profile_text(self) -> str:
        prof = self.fitter.profile()
        if not self.measured_profile:
            return f"configured (policy profile=configured); {prof.describe()}"
        if prof.iterations < MIN_PROFILE_ITERATIONS or not prof.cluster_fields():
            return (f"configured until {MIN_PROFILE_ITERATIONS} healthy iterations are measured "
                    f"({prof.iterations} so far)")
        return prof.describe()

    def warm_start(self, trace_lines: Iterable[str]) -> int:
        """A restarted coordinator's profile: the end of the job's trace replayed through a
        detector of the same config (the live one keeps its own state and re-warms from the
        reports), its healthy iterations fed to the fitter, so that the first plans after a
        restart are priced as before it. Returns the healthy iterations it found; a torn or
        malformed line ends the replay there (a SIGKILLed coordinator can leave half a line)."""
        tail = trace_tail(trace_lines, WARM_START_ITERATIONS)
        if not tail:
            return 0
        plan = self.fitter.plan
        try:
            header, records = read_trace(tail)
            found = fit_trace(_until_error(records), Detector(header, self.detector.config), self.fitter)
        except TraceError as exc:
            log.warning("trace: %s; the planner profile is measured afresh", exc)
            found = 0
        self.fitter.set_plan(plan)
        return found

    def observe_op(self, rank: int, t: float, op: OpState) -> None:
        if self.detection:
            self.detector.observe_op(rank, t, op)

    def tick(self, now: float) -> list[FindingInfo]:
        return self._convert(self.detector.tick(now))

    def observe_probe(self, rank: int, probe_s: float, now: float) -> list[FindingInfo]:
        if not self.detection:
            return []
        return self._convert(self.detector.observe_probe(rank, probe_s, now))

    def suspects(self) -> dict[int, str]:
        return self.detector.suspects()

    def probe_ratios(self) -> dict[int, float]:
        return self.detector.probe_ratios()

    def rank_speed(self) -> dict[int, float]:
        return self.detector.rank_speed()

    def readmit(self, rank: int) -> bool:
        return self.detector.readmit(rank)

    def set_plan(self, plan: Plan, iteration: int) -> None:
        self._adopt(plan)
        self.detector.set_plan(plan, iteration)  # its first iteration: the detector re-warms from there
        self._rules.set_plan(plan, iteration)
        self.fitter.set_plan(plan)

    def _adopt(self, plan: Plan) -> None:
        """The job runs ``plan`` now; the layout it leaves stays a candidate for later
        decisions (the undo of a fault's re-plan once the fault ends)."""
        self._earlier = earlier_layouts(self._earlier, self._plan, plan)
        self._plan = plan

    # --- planning ----------------------------------------------------------------------------
    def decide(self, current: Plan, finding: FindingInfo | None, unavailable: frozenset[int], now: float,
               nodes: Mapping[int, str]) -> EngineDecision:
        speeds = self.rank_speed()
        if self._planner is None:
            self._rules._tracks.clear()
            for r, s in speeds.items():  # the rule planner reads speeds from its own tracks
                tr = self._rules._track(r)
                tr.state, tr.ratio = ("dead", 1.0) if s <= 0 else ("slow", 1.0 / s) if s < 1 else ("healthy", 1.0)
            return self._rules.decide(current, finding, unavailable, now, nodes)
        return self._planner_decide(current, finding, unavailable, now, nodes, speeds)

    def _planner_decide(self, current: Plan, finding: FindingInfo | None, unavailable: frozenset[int], now: float,
                        nodes: Mapping[int, str], speeds: Mapping[int, float]) -> EngineDecision:
        from resihp.coordinator.model.cluster import DeviceState, GlobalBatch

        pl = self._planner
        assert pl is not None
        world = [d.rank for d in self.header.devices]
        # A rank slow because of its links keeps its compute speed and gets a link factor:
        # the planner prices slow links in p2p / DP traffic, not as slower compute.
        compute = self.detector.compute_speed()
        links = self.detector.link_factor() if self.link_detection else {}
        devices = tuple(DeviceState(rank=r, node=nodes.get(r) or "node0",
                                    speed=max(compute.get(r, speeds.get(r, 1.0)), 1e-3),
                                    failed=r in unavailable or speeds.get(r, 1.0) <= 0,
                                    link_factor=links.get(r, 1.0)) for r in world)
        fields, priced = self._profile_fields()
        cluster = Cluster(devices=devices, **fields)
        rec = self._last
        # a token-share plan's replicas run other micro-batch counts than the batch has
        mbs = max(1, current.batch_microbatches(self._tpm))
        if rec is not None and rec.seqlens and rec.seqlens[0]:
            sample = list(rec.seqlens[0][0])
            tokens = max(self.header.tokens_per_microbatch, sum(sample))
            if current.document_shares and self._tpm:
                # a re-packed micro-batch may hold more than the batch's: the documents that fit
                tokens = self._tpm
                while sum(sample) > tokens:
                    sample.pop()
            batch = GlobalBatch(mbs, tokens, tuple(sample))
        else:
            batch = GlobalBatch(mbs, self.header.tokens_per_microbatch or 2048)
        raw = None
        if finding is not None:
            raw = self._raw.get((finding.kind, tuple(finding.ranks), finding.iteration))
            if raw is None:  # a finding the coordinator made itself (pid exit, its own heartbeat clock)
                raw = Finding(finding.iteration, finding.kind, tuple(finding.ranks), finding.stage,  # type: ignore[arg-type]
                              finding.replica, None, finding.factor, finding.cause, finding.reason, {}, finding.time_s)
        # the runtime sums a layer's gradients by coarse shard where replicas split it over
        # different TP sizes (Runtime._sync_mixed), so mixed-TP plans are open to the planner
        config = pl.PlannerConfig(document_shares=self.document_shares) \
            if hasattr(pl, "PlannerConfig") else None
        if config is not None and priced is not None and priced.hbm_bw_Bps:
            config = replace(config, hbm_bw_Bps=priced.hbm_bw_Bps)
        # unavailable = excluded by the operator or dead; the detector is told of every
        # death (exit events, heartbeat timeouts), so an unavailable rank it has alive was
        # excluded: the planner says so instead of calling it failed
        excluded = frozenset(r for r in unavailable if speeds.get(r, 1.0) > 0)
        try:
            d = pl.decide(cluster, self.header.model, batch, current, raw, now, config, excluded=excluded,
                          earlier=self._earlier)
        except SpecError as exc:  # no layout of the healthy devices can run the model
            broken = any(r in unavailable or speeds.get(r, 1.0) <= 0 for r in current.ranks())
            return EngineDecision(False, current, f"planner: {exc}", "none", fatal=broken)
        plan = d.plan if d.act else current
        fatal = bool(getattr(d, "fatal", False)) or (not d.act and any(r in unavailable for r in current.ranks()))
        reason = str(d.reason) + (f" [profile {priced.describe()}]" if priced is not None else " [profile configured]")
        return EngineDecision(bool(d.act), plan, reason, str(getattr(d, "level", "none")), fatal)

    def _profile_fields(self) -> tuple[dict[str, float], Profile | None]:
        """Cluster link / FLOP fields for the planner, and the measured profile when it set them."""
        if not self.measured_profile:
            return dict(self.links), None
        prof = self.fitter.profile()
        if prof.iterations < MIN_PROFILE_ITERATIONS or not prof.cluster_fields():
            return dict(self.links), None
        return {**self.links, **prof.cluster_fields()}, prof

    # --- policy ------------------------------------------------------------------------------
    def policy(self) -> dict[str, str]:
        c = self.detector.config
        out = {f.name: _policy_text(getattr(c, f.name)) for f in fields(c)}
        out["detection"] = "on" if self.detection else "off"
        out["links"] = "on" if self.link_detection else "off"
        out["profile"] = "measured" if self.measured_profile else "configured"
        out["shares"] = "documents" if self.document_shares else "whole"
        return out

    def set_policy(self, updates: Mapping[str, str]) -> dict[str, str]:
        c = self.detector.config
        known = {f.name: f for f in fields(c)}
        changes: dict[str, Any] = {}
        detection, links, measured = self.detection, self.link_detection, self.measured_profile
        documents = self.document_shares
        for key, value in updates.items():
            if key == "shares":
                documents = _either(key, value, ("documents", "DP shares cut by the packed document"),
                                    ("whole", "whole micro-batches"))
                continue
            if key == "profile":
                measured = _either(key, value, ("measured", "device and link speeds from the job's healthy iterations"),
                                   ("configured", "--cluster"))
                continue
            if key not in known and key not in ("detection", "links"):
                raise ValueError(f"unknown policy key {key!r}; known: "
                                 f"{sorted(list(known) + ['detection', 'links', 'profile', 'shares'])}")
            if key in ("detection", "links") or isinstance(getattr(c, key), bool):
                if value not in ("on", "off"):
                    raise ValueError(f"policy {key} must be 'on' or 'off', got {value!r}")
                if key == "detection":
                    detection = value == "on"
                elif key in ("links", "link_detection"):  # one switch, two names (policy() shows both)
                    links = value == "on"
                else:
                    changes[key] = value == "on"
            elif isinstance(getattr(c, key), int):
                changes[key] = int(parse_float(key, value, 0))
            else:
                changes[key] = parse_float(key, value, 0)
        if hasattr(c, "link_detection"):
            changes["link_detection"] = links
        new = replace(c, **changes)  # DetectorConfig validates itself (ValueError with its message)
        self.detector.config = new
        self.detection, self.link_detection, self.measured_profile = detection, links, measured
        self.document_shares = documents
        return self.policy()


def _either(key: str, value: str, first: tuple[str, str], second: tuple[str, str]) -> bool:
    """A two-valued policy key: True for ``first``'s name, False for ``second``'s, else a
    ValueError naming both with what they mean."""
    if value not in (first[0], second[0]):
        raise ValueError(f"policy {key} must be '{first[0]}' ({first[1]}) or '{second[0]}' ({second[1]}), "
                         f"got {value!r}")
    return value == first[0]


def _policy_text(value: Any) -> str:
    """A policy value as `resihp admin policy` takes it back: booleans are on / off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
