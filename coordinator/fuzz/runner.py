"""Send adversarial cases at a live coordinator and agent and judge every answer.

Each case goes out as bytes on a generic call (identity serializers on the method's path),
so undecodable requests travel exactly like well-formed ones. A case fails when its answer
is INTERNAL or UNKNOWN (an unhandled exception), when a poisoned request is accepted, when
a refusal comes without a message, or when the daemon stops answering. Every
``check_every`` cases the runner checks that both daemons still live: the health service
answers SERVING, a well-formed request (Admin Status, an empty Hook Report) succeeds, and
the given pids are running processes; a failed check counts as a crash and ends the run.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from resihp.coordinator.fuzz.cases import ADMIN, COORD, HOOK, Case, CaseGenerator, Target
from resihp.coordinator.protocol.auth import HEADER, rank_token
from resihp.proto import resihp_pb2 as pb

CALL_TIMEOUT_S = 10.0
OPEN_STREAM_S = 0.05  # a Commands subscription still open after this is a good answer ("OPEN")
NEVER = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
_HEALTH = "/grpc.health.v1.Health/Check"


@dataclass
class FuzzResult:
    cases: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    daemon_crashes: int = 0
    seconds: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)  # what the cases were (valid, raw.random, report.rank ...)

    @property
    def cases_per_s(self) -> float:
        return self.cases / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "by_status": dict(sorted(self.by_status.items())),
                "unexpected": self.unexpected[:50], "unexpected_count": len(self.unexpected),
                "daemon_crashes": self.daemon_crashes, "seconds": round(self.seconds, 3),
                "cases_per_s": round(self.cases_per_s, 1)}


class _Endpoint:
    def __init__(self, address: str, credential: str, other: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                               ("grpc.max_receive_message_length", 64 << 20)])
        self.credential, self.other = credential, other

    def metadata(self, kind: str) -> tuple[tuple[str, str], ...]:
        if not self.credential:
            return ()
        value = {"good": f"Bearer {self.credential}", "wrong": "Bearer not-the-credential",
                 "other-service": f"Bearer {self.other}", "no-bearer": self.credential}.get(kind)
        return () if value is None else ((HEADER, value),)


def send(ep: _Endpoint, case: Case) -> tuple[str, str]:
    """Make the call; returns (status name, details). "OPEN": a server stream that kept serving."""
    md = ep.metadata(case.credential)
    ch = ep.channel
    try:
        if case.shape == "unary":
            ch.unary_unary(case.path)(case.requests[0], metadata=md, timeout=CALL_TIMEOUT_S)
            return "OK", ""
        if case.shape == "server_stream":
            call: Any = ch.unary_stream(case.path)(case.requests[0], metadata=md, timeout=CALL_TIMEOUT_S)
            try:  # a subscription that must be refused gets the whole deadline: a slow refusal is no "OPEN"
                call.exception(timeout=OPEN_STREAM_S if grpc.StatusCode.OK in case.expect else CALL_TIMEOUT_S)
            except grpc.FutureTimeoutError:
                call.cancel()
                return "OPEN", ""
            for _ in call:
                pass
            return "OK", ""
        release = threading.Event()

        def requests() -> Iterator[bytes]:
            yield from case.requests
            if case.cancel:
                release.wait(CALL_TIMEOUT_S)  # hold the stream open mid-way until it is cancelled

        try:
            if case.shape == "client_stream":
                fut: Any = ch.stream_unary(case.path).future(requests(), metadata=md, timeout=CALL_TIMEOUT_S)
                if case.cancel:
                    time.sleep(0.005)
                    fut.cancel()
                fut.result()
                return "OK", ""
            call = ch.stream_stream(case.path)(requests(), metadata=md, timeout=CALL_TIMEOUT_S)
            if case.cancel:
                time.sleep(0.005)
                call.cancel()
            for _ in call:
                pass
            return "OK", ""
        finally:
            release.set()
    except grpc.FutureCancelledError:
        return "CANCELLED", "cancelled by the fuzzer"
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
        return code.name, details or ""


def judge(case: Case, status: str, details: str) -> str | None:
    """Why this answer is wrong for this case; None when it is right."""
    ok = {c.name for c in case.expect} | ({"CANCELLED"} if case.cancel else set())
    if status in {c.name for c in NEVER} or ("OK" if status == "OPEN" else status) not in ok:
        return f"{case.path} [{case.what}, credential {case.credential}]: {status} {details[:300]!r}"
    if status not in ("OK", "OPEN", "CANCELLED") and not details.strip():
        return f"{case.path} [{case.what}]: {status} without a message saying what was wrong"
    return None


def alive(ep: _Endpoint, well_formed: tuple[str, bytes], pids: Sequence[int]) -> str | None:
    """None when the daemon answers health and a well-formed request and its pids run; else why not."""
    try:
        reply = ep.channel.unary_unary(_HEALTH)(b"", timeout=CALL_TIMEOUT_S)  # service "": the server as a whole
        if reply != b"\x08\x01":  # HealthCheckResponse(status=SERVING)
            return f"{ep.address}: health answers {reply!r}, not SERVING"
        ep.channel.unary_unary(well_formed[0])(well_formed[1], metadata=ep.metadata("good"), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return f"{ep.address}: {exc.code().name} {exc.details()}"
    for pid in pids:
        if not _running(pid):
            return f"{ep.address}: process {pid} is gone"
    return None


class Watch:
    """What a refused request may still break behind the server's back, read after each batch:
    an agent's uplink cut because the agent forwarded what the coordinator refuses (Admin
    Events), and handler failures the coordinator swallowed (``resihp_internal_errors_total``)."""

    def __init__(self, admin: _Endpoint | None, metrics_url: str | None) -> None:
        self.admin, self.metrics_url = admin, metrics_url
        self.after_seq = 0
        self.internal = self._internal_errors()

    def _internal_errors(self) -> float:
        if not self.metrics_url:
            return 0.0
        with urllib.request.urlopen(self.metrics_url, timeout=CALL_TIMEOUT_S) as fh:
            text = fh.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("resihp_internal_errors_total"))

    def problems(self) -> list[str]:
        out = []
        if self.admin is not None:
            raw = self.admin.channel.unary_unary(f"/{ADMIN}/Events")(
                pb.EventsRequest(after_seq=self.after_seq, limit=10000).SerializeToString(),
                metadata=self.admin.metadata("good"), timeout=CALL_TIMEOUT_S)
            for text in pb.EventsReply.FromString(raw).events_json:
                ev = json.loads(text)
                self.after_seq = max(self.after_seq, int(ev.get("seq", 0)))
                node, why = str(ev.get("node", "")), str(ev.get("reason", ""))
                if ev.get("event") == "agent-disconnected" and why.startswith("invalid") and not node.startswith("fz"):
                    out.append(f"the coordinator cut the uplink of the agent on {node}: {why[:300]}")
        internal = self._internal_errors()
        if internal > self.internal:
            out.append(f"the coordinator swallowed {internal - self.internal:g} handler failure(s) "
                       "(resihp_internal_errors_total; see its log)")
        self.internal = internal
        return out


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def fuzz_endpoints(coordinator_addr: str | None, agent_addr: str | None, token: str, n_cases: int, seed: int, *,
                   rank_credential: str | None = None, coordinator_pids: Sequence[int] = (),
                   agent_pids: Sequence[int] = (), mutate_state: bool = False, check_every: int = 200,
                   world: int | None = None, job: str | None = None, metrics_url: str | None = None) -> FuzzResult:
    """Send ``n_cases`` seeded cases at the daemons (either address may be None to skip it).

    ``token``: the job token (Coordinator and Admin); the Hook service takes ``rank_credential``,
    by default derived from it. ``world`` and ``job`` default to what Admin Status says;
    ``metrics_url`` (the coordinator's /metrics) lets the run count failures it swallowed.
    ``mutate_state=True`` also sends valid writes (drains, kills of fake pids, hellos): only for
    daemons that serve no real job."""
    rank_cred = rank_credential if rank_credential is not None else (rank_token(token) if token else "")
    eps: dict[str, _Endpoint] = {}
    if coordinator_addr:
        eps[COORD] = eps[ADMIN] = _Endpoint(coordinator_addr, token, rank_cred)
    if agent_addr:
        eps[HOOK] = _Endpoint(agent_addr, rank_cred, token)
    checks = {HOOK: (f"/{HOOK}/Report", b"", agent_pids), ADMIN: (f"/{ADMIN}/Status", b"", coordinator_pids)}
    if (world is None or job is None) and coordinator_addr:
        st = pb.StatusReply.FromString(eps[ADMIN].channel.unary_unary(f"/{ADMIN}/Status")(
            b"", metadata=eps[ADMIN].metadata("good"), timeout=CALL_TIMEOUT_S))
        world, job = world or st.world_size, job or st.job
    target = Target(world=world or 1, job=job or "job", hook_token=bool(rank_cred), coordinator_token=bool(token))
    if mutate_state and coordinator_addr:
        for node in ("fzr0", "fzr1"):  # agents of no rank, so Stream cases can name a registered agent id
            welcome = eps[COORD].channel.unary_unary(f"/{COORD}/Register")(
                pb.RegisterRequest(node=node, job=target.job).SerializeToString(), metadata=eps[COORD].metadata("good"),
                timeout=CALL_TIMEOUT_S)
            target.agent_ids.append(pb.RegisterReply.FromString(welcome).agent_id)
    gen = CaseGenerator(random.Random(seed), target, mutate_state=mutate_state,
                        services=tuple(s for s in (HOOK, COORD, ADMIN) if s in eps))
    watch = Watch(eps.get(ADMIN), metrics_url)
    result, statuses, kinds = FuzzResult(), Counter[str](), Counter[str]()
    started = time.monotonic()

    def check() -> bool:
        for svc in (HOOK, ADMIN):
            if svc in eps:
                path, body, pids = checks[svc]
                why = alive(eps[svc], (path, body), pids)
                if why is not None:
                    result.daemon_crashes += 1
                    result.unexpected.append(f"daemon check failed after {result.cases} cases: {why}")
                    return False
        result.unexpected.extend(f"after {result.cases} cases: {p}" for p in watch.problems())
        return True

    for i in range(n_cases):
        case = gen.case()
        status, details = send(eps[case.service], case)
        result.cases += 1
        statuses[status] += 1
        kinds[case.what.split(".")[0]] += 1
        bad = judge(case, status, details)
        if bad is not None:
            result.unexpected.append(f"case {i} (seed {seed}): {bad}")
        if (status == "UNAVAILABLE" or (i + 1) % check_every == 0) and not check():
            break
    else:
        check()
    result.seconds = time.monotonic() - started
    result.by_status, result.by_kind = dict(statuses), dict(kinds)
    return result
