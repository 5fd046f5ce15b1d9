"""Agent pieces: GPU sampler degradation, pid watch, hook address policy, hook client."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
import types

import pytest

from resihp.agent.pidwatch import PidWatch, exit_code_of
from resihp.agent.sampler import NvmlSampler, ProcessSampler, make_sampler
from resihp.agent.server import CommandRelay, check_local_address
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reporting.agent_client import AgentClient, agent_address_from_env


def test_missing_nvml_is_degraded_not_a_crash() -> None:
    s = make_sampler("nvml", deadline_s=2.0)  # no driver here: NVMLError_LibraryNotFound (or a real GPU)
    degraded, status = s.status()
    if degraded:
        assert "NVML" in status and s.sample(1.0) == []
    else:
        assert s.sample(1.0)[0].sm_clock_hz > 0
    s.close()


def _fake_nvml(hang_in: str = "") -> types.SimpleNamespace:
    gate = threading.Event()

    def maybe_hang(name: str, value: object) -> object:
        if name == hang_in:
            gate.wait(30)
        return value

    return types.SimpleNamespace(
        nvmlInit=lambda: maybe_hang("init", None), nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}", nvmlDeviceGetName=lambda h: b"Fake H100",
        nvmlDeviceGetUUID=lambda h: "GPU-1", NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetClockInfo=lambda h, c: maybe_hang("clock", 1410), nvmlDeviceGetMaxClockInfo=lambda h, c: 1980,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x8, nvmlDeviceGetTemperature=lambda h, t: 71,
        nvmlDeviceGetPowerUsage=lambda h: 350000, NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        nvmlDeviceGetTotalEccErrors=lambda h, t, c: 2 if t == 0 else 0, nvmlShutdown=lambda: None,
        _gate=gate,
    )


def test_nvml_sampler_reads_clocks_power_and_reasons() -> None:
    s = NvmlSampler(deadline_s=1.0, nvml=_fake_nvml())
    [g] = s.sample(5.0)
    assert (g.sm_clock_hz, g.sm_clock_max_hz, g.clock_event_reasons) == (1.41e9, 1.98e9, 8)
    assert (g.temperature_celsius, g.power_watts, g.ecc_corrected_total, g.model_name) == (71, 350.0, 2, "Fake H100")
    assert s.status() == (False, "NVML ok: 1 GPU(s)")


def test_a_hung_nvml_call_degrades_within_its_deadline() -> None:
    nv = _fake_nvml(hang_in="clock")
    s = NvmlSampler(deadline_s=0.2, nvml=nv)
    t0 = time.monotonic()
    assert s.sample(1.0) == []
    assert time.monotonic() - t0 < 1.5
    degraded, status = s.status()
    assert degraded and "hung for more than 0.2 s" in status
    assert s.sample(2.0) == []  # never called again
    nv._gate.set()
    s.close()


def test_pidwatch_reports_a_sigkilled_process_at_once() -> None:
    got: list[tuple[int, int, int]] = []
    done = threading.Event()

    def on_exit(rank: int, pid: int, code: int) -> None:
        got.append((rank, pid, code))
        done.set()

    watch = PidWatch(on_exit)
    # threads, as a trainer has (gloo, the hook client): the status is read once every thread is gone
    proc = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                             "for _ in range(4): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                             "time.sleep(60)"])
    try:
        watch.watch(7, proc.pid)
        samples = ProcessSampler().sample({7: proc.pid}, 1.0)
        assert samples[0].rank == 7 and samples[0].rss_bytes > 0
        t0 = time.monotonic()
        proc.kill()
        assert done.wait(2.0), "exit not noticed"
        assert time.monotonic() - t0 < 0.5
        assert got[0] == (7, proc.pid, -9), got  # the real signal: SIGKILL is 9, never "signal 1"
    finally:
        proc.wait(5)
        watch.close()
    # once its parent has reaped it the status is gone: said as unknown, not as a signal
    assert exit_code_of(proc.pid) == m.EXIT_UNKNOWN
    assert "status unknown" in m.describe_exit(exit_code_of(proc.pid))


@pytest.mark.parametrize("addr", ["0.0.0.0:0", "10.0.0.5:7000", "example.com:80"])
def test_hook_server_refuses_non_loopback_addresses(addr: str) -> None:
    with pytest.raises(ValueError, match="loopback|127.0.0.1"):
        check_local_address(addr)
    for ok in ("127.0.0.1:0", "[::1]:0", "unix:/tmp/x.sock", "localhost:5"):
        check_local_address(ok)


def test_relay_redelivers_missed_commands_and_targets_ranks() -> None:
    relay = CommandRelay()
    relay.publish(m.ThrottleCommand(0, 2.0, 1, seq=1, ranks=(2,)))
    relay.publish(m.DrainCommand(0, 5, seq=2))
    relay.publish(m.DrainCommand(0, 5, seq=2))  # duplicate after a coordinator restart
    _, backlog = relay.subscribe(2, after_seq=0)
    assert [c.seq for c in backlog] == [1, 2]
    _, backlog = relay.subscribe(3, after_seq=0)
    assert [c.seq for c in backlog] == [2]


def test_hook_client_without_agent_warns_once_and_never_fails(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING)
    c = AgentClient(0, "127.0.0.1:1", connect_timeout_s=0.2, retry_s=0.05).start()  # nothing listens on port 1
    for i in range(50):
        c.report(i, 0.01, seqlens=[[4]])
    c.close()
    warnings = [r for r in caplog.records if "cannot reach its node agent" in r.getMessage()]
    assert len(warnings) == 1 and not c.connected.is_set()
    monkeypatch.delenv("RESIHP_AGENT_ADDR", raising=False)
    monkeypatch.setenv("RESIHP_AGENT_ADDRS", "a:1,b:2")
    monkeypatch.setenv("RESIHP_RANKS_PER_NODE", "4")
    assert agent_address_from_env(5) == "b:2" and agent_address_from_env(3) == "a:1"


def test_uplink_buffer_is_bounded_while_the_coordinator_is_away() -> None:
    from resihp.agent.uplink import Uplink

    up = Uplink("127.0.0.1:1", "t", lambda: m.Registration("n0", "job"), lambda b: None, lambda w: None,
                buffer_items=16, backoff_max_s=0.05)
    for i in range(20):
        up.send(m.AgentBatch(acks=(m.Ack(0, i, 0, i),)))
    assert up.pending() == 16 and up.dropped == 4
    up.start()
    try:
        from cp_helpers import wait_until

        wait_until(lambda: up.last_error, 10, "a failed connection attempt")
        assert not up.connected.is_set() and "UNAVAILABLE" in up.last_error
    finally:
        up.close()


def test_hook_flush_waits_for_its_tick_but_a_slow_step_and_close_cut_it_short() -> None:
    from cp_helpers import wait_until

    from resihp.agent.daemon import AgentConfig, AgentDaemon

    agent = AgentDaemon(AgentConfig(node="n0", coordinator="127.0.0.1:1", gpu_sampler="off", world_size=4))
    agent.start()
    # a flush tick an hour away: anything that arrives early was sent by the adaptive policy
    c = AgentClient(2, agent.hook_server.address, 2, flush_s=3600.0).start()
    try:
        c.report(0, 0.1, seqlens=[[4]])  # the first report after a quiet spell goes at once
        wait_until(lambda: agent.locals[2].iteration == 0, 10, "the first report")
        c.report(1, 0.1, seqlens=[[4]])
        c.report(2, 0.5, seqlens=[[4]])  # 5x the typical step: news, sent without the tick
        wait_until(lambda: agent.locals[2].iteration == 2, 10, "the slow step's report")
        c.report(3, 0.1, seqlens=[[4]])
    finally:
        c.close(timeout=5.0)  # close flushes what is queued
        agent.stop()
    assert agent.locals[2].iteration == 3 and c.sent == 4 and c.dropped == 0


def test_report_checks_name_the_bad_field() -> None:
    from resihp.coordinator.protocol import codec
    from resihp.proto import resihp_pb2 as pb

    good = pb.RankReport(rank=1, iteration=3, start_s=1.0, step_s=0.5, microbatches=[pb.MicroBatch(seqlens=[8])],
                         chunks=[pb.ChunkTiming(rank=1, kind="F", microbatch=0, start_s=1.0, end_s=1.2)])
    assert codec.check_report_pb(good) == (1, 3)
    cases = [({"step_s": float("nan")}, "reports[0].step_s must be a finite number >= 0 (seconds), got nan"),
             ({"start_s": float("inf")}, "reports[0].start_s must be a finite number >= 0 (seconds), got inf"),
             ({"epoch": -1}, "reports[0].epoch must be >= 0, got -1"),
             ({"rank": -2}, "reports[0].rank must be a rank in 0..")]
    for change, message in cases:
        bad = pb.RankReport()
        bad.CopyFrom(good)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(codec.ValidationError, match=re.escape(message)):
            codec.check_report_pb(bad, "reports[0]")
    bad = pb.RankReport()
    bad.CopyFrom(good)
    bad.chunks[0].end_s = float("inf")
    with pytest.raises(codec.ValidationError, match=r"chunks\[0\].end_s must be a finite number"):
        codec.check_report_pb(bad)
    bad.chunks[0].end_s = 0.5  # ends before it starts
    with pytest.raises(codec.ValidationError, match=r"chunks\[0\] ends \(0.5\) before it starts \(1.0\)"):
        codec.check_report_pb(bad)
    with pytest.raises(codec.ValidationError, match=r"heartbeats\[0\].time_s must be a finite number"):
        codec.check_heartbeat_pb(pb.RankHeartbeat(rank=1, time_s=float("nan")), "heartbeats[0]")
    assert codec.check_heartbeat_pb(pb.RankHeartbeat(rank=1, time_s=2.0, iteration=-1)) == (1, -1)


def test_probes_go_up_through_the_agent_and_a_bad_one_is_refused_by_name() -> None:
    import grpc
    from cp_helpers import wait_until

    from resihp.agent.daemon import AgentConfig, AgentDaemon
    from resihp.coordinator.protocol import codec
    from resihp.proto import resihp_pb2 as pb
    from resihp.proto import resihp_pb2_grpc as pbg

    agent = AgentDaemon(AgentConfig(node="n0", coordinator="127.0.0.1:1", gpu_sampler="off", world_size=4))
    agent.start()
    c = AgentClient(2, agent.hook_server.address, 2, flush_s=0.05).start()
    try:
        c.probe(0.0123)

        def forwarded() -> list[m.RankProbe]:
            with agent.uplink._lock:
                return [p for b in agent.uplink._buf for p in b.probes]

        wait_until(lambda: forwarded(), 10, "the probe in the uplink buffer")
        (got,) = forwarded()
        assert (got.rank, got.probe_s) == (2, 0.0123) and got.time_s > 0
        with grpc.insecure_channel(agent.hook_server.address) as ch:
            stub = pbg.HookStub(ch)
            for bad, message in ((pb.RankProbe(rank=2, time_s=1.0, probe_s=float("nan")),
                                  "probes[0].probe_s must be a finite duration > 0 seconds, got nan"),
                                 (pb.RankProbe(rank=2, time_s=1.0, probe_s=-1.0), "got -1.0"),
                                 (pb.RankProbe(rank=9, time_s=1.0, probe_s=0.01), "rank 9")):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Report(pb.HookReportBatch(probes=[bad]), timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
                assert message in err.value.details(), err.value.details()  # type: ignore[attr-defined]
        assert len(forwarded()) == 1  # the refused ones went nowhere
        assert codec.probe_from_pb(codec.probe_to_pb(got)) == got
    finally:
        c.close(timeout=5.0)
        agent.stop()


def test_the_op_a_rank_is_in_goes_up_with_the_agents_heartbeats() -> None:
    """The hooks' heartbeat names the op its rank is in (trainer_hooks/reporting/opcursor.py); a
    real agent keeps the latest and sends it with its own beats to the coordinator. A bad op
    kind is refused by name and changes nothing."""
    import grpc
    from cp_helpers import wait_until

    from resihp.agent.daemon import AgentConfig, AgentDaemon
    from resihp.coordinator.model.trace import OpState
    from resihp.proto import resihp_pb2 as pb
    from resihp.proto import resihp_pb2_grpc as pbg
    from resihp.trainer_hooks.reporting.opcursor import CURSOR

    agent = AgentDaemon(AgentConfig(node="n0", coordinator="127.0.0.1:1", gpu_sampler="off", world_size=4,
                                    heartbeat_interval_s=0.05))
    agent.start()
    agent.hook_hello(1, 1, 4242)
    c = AgentClient(1, agent.hook_server.address, 1, flush_s=0.05, heartbeat_s=0.05).start()
    try:
        CURSOR.enter("compute", "F mb7")

        def beats() -> list[m.RankHeartbeat]:
            with agent.uplink._lock:
                return [r for b in agent.uplink._buf if b.heartbeat is not None for r in b.heartbeat.ranks if r.rank == 1]

        wait_until(lambda: any(b.op is not None and b.op.name == "F mb7" for b in beats()), 10,
                   "the agent's beat naming rank 1's op")
        got = next(b.op for b in beats() if b.op is not None and b.op.name == "F mb7")
        assert got == OpState("compute", "F mb7", False, got.seq) and got.seq >= 1
        with grpc.insecure_channel(agent.hook_server.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pbg.HookStub(ch).Report(pb.HookReportBatch(heartbeats=[pb.RankHeartbeat(
                    rank=1, time_s=1.0, op_kind="kernel", op_name="x")]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "heartbeats[0]: op kind must be one of" in err.value.details()  # type: ignore[attr-defined]
        assert agent.locals[1].op is not None and agent.locals[1].op.kind == "compute"
    finally:
        CURSOR.done()
        c.close(timeout=5.0)
        agent.stop()
