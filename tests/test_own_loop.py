"""A loop that keeps its own model: init's model forms, learned micro-batches, the exit hook,
the context manager, step(loss, tokens) -> progress.jsonl, job.timed spans and what the
detector makes of them; torchrun's environment from Open MPI's."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resihp.coordinator.detector.detector import Detector, DetectorConfig, Finding
from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError, preset
from resihp.coordinator.model.trace import ChunkTiming, IterationRecord
from resihp.trainer_hooks.launch.rank_env import RankEnvError, torchrun_env
from resihp.trainer_hooks.launch.watch import summarise
from resihp.trainer_hooks.model_source import MODEL_ENV, check_launch_model, resolve_model, spec_json
from resihp.trainer_hooks.own_loop import ChunkRecorder

REPO = Path(__file__).resolve().parents[1]
SMALL = {"name": "own", "num_layers": 2, "hidden": 32, "num_heads": 4, "ffn_hidden": 64, "vocab": 256}


class _Module:
    """Duck-typed nn.Module: ``parameters`` and ``named_modules``, a ``config`` with a shape."""

    def __init__(self, config: object, names: tuple[str, ...] = ()) -> None:
        self.config = config
        self._names = names

    def parameters(self) -> list[object]:
        return []

    def named_modules(self) -> list[tuple[str, object]]:
        return [(n, object()) for n in self._names]


class _NanoGPTConfig:
    n_layer, n_head, n_embd, vocab_size, block_size = 6, 6, 384, 65, 256


class _HFConfig:
    num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads = 4, 256, 8, 2
    intermediate_size, vocab_size, model_type = 688, 32000, "llama"


def test_init_accepts_every_model_form(tmp_path: Path) -> None:
    spec = ModelSpec(**SMALL)  # type: ignore[arg-type]
    assert resolve_model(spec) is spec
    assert resolve_model("gpt-tiny") == preset("gpt-tiny")
    assert resolve_model(SMALL) == spec and resolve_model({"preset": "gpt-tiny"}) == preset("gpt-tiny")
    (tmp_path / "m.json").write_text(json.dumps(SMALL))
    (tmp_path / "m.yaml").write_text("model:\n" + "".join(f"  {k}: {v}\n" for k, v in SMALL.items()))
    assert resolve_model(str(tmp_path / "m.json")) == spec and resolve_model(tmp_path / "m.yaml") == spec

    nano = resolve_model(_Module(_NanoGPTConfig()))
    assert (nano.num_layers, nano.hidden, nano.num_heads, nano.ffn_hidden, nano.vocab, nano.gated_mlp) == \
        (6, 384, 6, 4 * 384, 65, False)
    hf = resolve_model(_Module(_HFConfig(), ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")))
    assert (hf.num_layers, hf.hidden, hf.num_heads, hf.kv_heads, hf.ffn_hidden, hf.vocab, hf.gated_mlp, hf.name) == \
        (4, 256, 8, 2, 688, 32000, True, "llama")

    class Partial:
        n_layer, n_embd = 2, 64

    with pytest.raises(SpecError, match=r"_Module.config \(Partial\): missing num_heads .*n_head.*; vocab"):
        resolve_model(_Module(Partial()))
    with pytest.raises(SpecError, match="unknown model preset 'gpt-huge'"):
        resolve_model("gpt-huge")
    with pytest.raises(SpecError, match=r"model file .*missing\.json"):
        resolve_model(str(tmp_path / "missing.json"))
    with pytest.raises(SpecError, match="got int"):
        resolve_model(3)


def test_a_launch_model_that_differs_from_the_scripts_names_both() -> None:
    spec = ModelSpec(**SMALL)  # type: ignore[arg-type]
    assert check_launch_model(spec, {}) is None
    same = {MODEL_ENV: spec_json(ModelSpec(**{**SMALL, "name": "other-name"}))}  # type: ignore[arg-type]
    launched = check_launch_model(spec, same)
    assert launched is not None and launched.name == "other-name"  # names may differ, shapes may not
    with pytest.raises(SpecError) as err:
        check_launch_model(spec, {MODEL_ENV: spec_json(preset("gpt-tiny"))})
    text = str(err.value)
    assert "'gpt-tiny' (layers=8 hidden=64" in text and "the script trains 'own' (layers=2 hidden=32" in text
    with pytest.raises(SpecError, match=r"\$RESIHP_MODEL holds no model spec"):
        check_launch_model(spec, {MODEL_ENV: "{not json"})
    assert ModelSpec.from_dict(json.loads(spec_json(spec))) == spec


def test_timed_spans_count_micro_batches_per_kind_and_refuse_misuse() -> None:
    rec = ChunkRecorder(origin=0.0)
    for _ in range(2):
        with rec.timed("F"):
            pass
        with rec.timed("B"):
            pass
    with rec.timed("F", mb=7):
        pass
    with rec.timed("OPT"):
        pass
    chunks = rec.take()
    assert [(k, mb, c) for k, mb, c, _, _ in chunks] == [
        ("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 7, 0), ("OPT", -1, 0)]
    starts = [s for _, _, _, s, _ in chunks]
    assert all(0.0 < s <= e for _, _, _, s, e in chunks) and starts == sorted(starts)
    rec.restart(chunks[-1][4])
    with rec.timed("F"):
        pass
    (again,) = rec.take()
    assert again[1] == 0 and 0.0 <= again[3] < chunks[0][3] + 1.0  # numbers and times start again
    with pytest.raises(SpecError, match="unknown kind; use one of F, B, W, OPT, DP"):
        rec.timed("FWD")
    with pytest.raises(SpecError, match=r"job.timed\('B'\) inside job.timed\('F'\): spans do not nest"):
        with rec.timed("F"):
            rec.timed("B")


def _sync_ddp_trace(slow_rank: int | None, factor: float = 1.3, onset: int = 15) -> list[Finding]:
    """Four DP ranks whose F/B spans come from ``job.timed``; rank ``slow_rank`` computes
    ``factor``× slower from ``onset``, and every rank's step takes the same wall time (a
    synchronous all-reduce), as in DDP."""
    spec = ModelSpec("own", 4, 64, 4, 256, 256)
    plan = Plan.uniform(1, 1, 4, spec.num_layers, 8)
    from resihp.trainer_hooks.reporting.trace_writer import make_header

    det = Detector(make_header(spec, plan, ("n0",) * 4, "t", 64, {}), DetectorConfig())
    rng = random.Random(1)
    found: list[Finding] = []
    now = 0.0
    for it in range(40):
        chunks: list[ChunkTiming] = []
        ends = {}
        for r in range(4):
            f = factor if (r == slow_rank and it >= onset) else 1.0
            s = 0.0
            for mb in range(2):
                for kind, cost in (("F", 0.010), ("B", 0.020)):
                    d = cost * f * rng.uniform(0.98, 1.02)
                    chunks.append(ChunkTiming(r, kind, mb, 0, s, s + d))
                    s += d
            ends[r] = s
        step = max(ends.values()) + 0.007  # everyone waits for the slowest, then the optimizer
        chunks += [ChunkTiming(r, "OPT", -1, 0, step - 0.002, step) for r in range(4)]
        rec = IterationRecord(it, now, step, tuple(((64,), (32, 32)) for _ in range(4)), tuple(chunks),
                              {r: step for r in range(4)})
        now += step
        found += det.observe(rec, now)
    return found


def test_the_detector_finds_the_rank_whose_timed_spans_are_slow_while_step_times_are_equal() -> None:
    assert _sync_ddp_trace(None) == []
    found = _sync_ddp_trace(2)
    assert found, "no finding for a rank computing 1.3x slower"
    assert {f.ranks for f in found} == {(2,)} and found[0].kind == "fail-slow"
    assert found[0].factor == pytest.approx(1.3, abs=0.05) and found[0].iteration >= 15


def test_torchrun_env_from_open_mpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RESIHP_JOB": "j"}
    out = torchrun_env(env)
    assert {k: out[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "j"}
    assert out["OMP_NUM_THREADS"] == "1"  # several ranks on the node: one thread each, as torchrun
    assert torchrun_env({**env, "OMP_NUM_THREADS": "3"}).get("OMP_NUM_THREADS") is None  # the user's stays
    assert "OMP_NUM_THREADS" not in torchrun_env({**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
                                                  "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    with pytest.raises(RankEnvError, match="start this under mpirun"):
        torchrun_env({})


def test_the_launch_summary_names_the_failed_rank_and_the_restart_command(tmp_path: Path) -> None:
    events = [
        {"event": "finding", "kind": "fail-stop", "ranks": [1], "iteration": 3, "time": 1.0e9,
         "reason": "the process of rank 1 exited with code 1 at t=4.000 s"},
        {"event": "finding", "kind": "fail-stop", "ranks": [0], "iteration": 3, "time": 1.0e9 + 1,
         "reason": "the process of rank 0 exited with code 1 at t=5.000 s"},
        {"event": "state", "to": "ABORTED", "time": 1.0e9 + 2, "reason": "no healthy device left"},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"half a li')
    rc, text = summarise(tmp_path, 0, finished=True, restart_cmd="cd /x && resihp launch -n 2 -- python t.py")
    lines = text.splitlines()
    assert rc == 1 and lines[0] == "resihp launch: job FAILED (exit status 1)"
    assert lines[1].startswith("  rank 1: the process of rank 1 exited with code 1") and "iteration 3" in lines[1]
    assert lines[2].startswith("  rank 0:") and "coordinator aborted the job" in lines[3]
    assert lines[-1] == "    cd /x && resihp launch -n 2 -- python t.py"
    (tmp_path / "events.jsonl").write_text("")
    assert summarise(tmp_path, 0)[0] == 0
    rc, text = summarise(tmp_path, 137)
    assert rc == 137 and "mpirun exited with status 137 before every rank said goodbye" in text
    assert summarise(tmp_path, 1, finished=True)[0] == 0  # every rank said goodbye: only finalisation was ended
    assert summarise(tmp_path, 0, interrupted=True)[0] == 130
    survived = [events[0], {"event": "rank-finished", "rank": 0}, {"event": "job-finished"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in survived))
    rc, text = summarise(tmp_path, 0, finished=True)
    assert rc == 0 and text.splitlines()[:2] == ["resihp launch: job finished; it survived 1 failed rank(s):",
                                                 f"  rank 1: {events[0]['reason']} (at {text[text.index('(at ') + 4:][:8]}, "
                                                 "iteration 3)"]
    assert summarise(tmp_path, 0, finished=False)[0] == 1  # not finished: the failure stands
    drained = [*survived, {"event": "state", "to": "ABORTED", "reason": "drained by the operator at iteration 9: x"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in drained))
    assert summarise(tmp_path, 0, finished=True)[0] == 0  # an operator's drain is no failure
    dead_last = [{"event": "rank-finished", "rank": 0}, events[0], {"event": "job-finished"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in dead_last))
    assert summarise(tmp_path, 0, finished=True)[0] == 1  # nobody trained on past the failure


def _own_loop(tmp_path: Path, mode: str, **extra_env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIHP_")}
    env.update(extra_env)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "mpi_scripts" / "own_loop_single.py"), str(tmp_path),
                           mode], env=env, capture_output=True, text=True, timeout=180)
    summary = tmp_path / "summary.json"
    return proc, json.loads(summary.read_text()) if summary.exists() else {}


def _progress(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]


def test_an_own_loop_that_never_closes_is_closed_at_exit_and_learns_its_micro_batches(tmp_path: Path) -> None:
    proc, out = _own_loop(tmp_path, "atexit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["closed_after_with"] is False and out["closed"] is True  # the exit hook said goodbye
    assert (out["microbatches_before"], out["microbatches_after"]) == (1, 3)  # learned at the first step
    assert [r["iteration"] for r in out["reports"]] == [0, 1, 2]
    for rep in out["reports"]:
        assert rep["seqlens"] == [[16], [16]]
        assert [(k, mb) for k, mb, _, _ in rep["chunks"]] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                                              ("B", 2), ("OPT", -1)]
    steps = [r for r in _progress(tmp_path) if r["type"] == "step"]
    assert [(r["step"], r["loss"], r["tokens"]) for r in steps] == [(0, 2.0, 1000), (1, 1.9, 1001), (2, 1.8, 1002)]
    assert [r["type"] for r in _progress(tmp_path)][-1] == "end"
    trace_header = json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[0])
    assert trace_header["plan"]["replicas"][0]["microbatches"] == 3  # the trace waited for the learned count
    report = subprocess.run([sys.executable, "-m", "resihp.cli", "report", str(tmp_path), "--no-png"],
                            capture_output=True, text=True, timeout=120)
    assert "3 steps (0-2)" in report.stdout + report.stderr, report.stdout + report.stderr


def test_the_context_manager_closes_and_a_failed_loop_says_no_goodbye(tmp_path: Path) -> None:
    (tmp_path / "with").mkdir()
    proc, out = _own_loop(tmp_path / "with", "with")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["closed_in_loop"] is False and out["closed_after_with"] is True
    (tmp_path / "raise").mkdir()
    proc, out = _own_loop(tmp_path / "raise", "raise")
    assert proc.returncode == 1 and "RuntimeError: the loop failed" in proc.stderr
    assert "leaving without a goodbye" in proc.stderr and out["closed"] is False
    assert len(out["reports"]) == 1


def test_the_scripts_own_group_is_reused_and_may_be_gone_before_the_exit_hook(tmp_path: Path) -> None:
    proc, out = _own_loop(tmp_path, "destroy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["adopted"] is True and out["closed"] is True and "closing at exit failed" not in proc.stderr
    assert [r["type"] for r in _progress(tmp_path)][-1] == "end"


def test_init_refuses_a_script_model_that_differs_from_the_launchs(tmp_path: Path) -> None:
    proc, _ = _own_loop(tmp_path, "atexit", RESIHP_MODEL=spec_json(preset("gpt-tiny")))
    assert proc.returncode == 1
    assert "`resihp launch --model` describes 'gpt-tiny' (layers=8" in proc.stderr
    assert "but the script trains 'own' (layers=2" in proc.stderr


def test_the_modules_own_forwards_and_backwards_are_timed_with_no_code_in_the_loop() -> None:
    """init(model=module) installs ForwardTimer: each training forward is an F span, the
    backward that follows it a B span (first output gradient to last parameter gradient);
    eval passes, no_grad passes and passes inside the loop's own job.timed are not spans; a
    (B, T) integer batch gives the seqlens."""
    import torch

    from resihp.trainer_hooks.own_loop import ForwardTimer

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16)

        def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.head(self.emb(idx))
            return logits, logits.float().logsumexp(-1).mean()

    net = Tiny()
    rec = ChunkRecorder()
    timer = ForwardTimer(rec, net)
    idx = torch.randint(0, 16, (3, 5))
    for _ in range(2):  # two micro-batches with gradient accumulation
        _, loss = net(idx)
        loss.backward()
    with torch.no_grad():
        net(idx)
    net.eval()
    net(idx)
    net.train()
    with rec.timed("F"):
        net(idx)  # the loop timed this one itself
    timer.flush_backward()
    chunks = rec.take()
    assert [(k, mb) for k, mb, *_ in chunks] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2)]
    assert all(end > start >= 0 for *_, start, end in chunks)
    f0, b0 = chunks[0], chunks[1]
    assert b0[3] >= f0[4]  # the backward starts after its forward ended
    assert timer.take_seqlens() == ((5, 5, 5), (5, 5, 5))
    timer.remove()
    net(idx)[1].backward()
    timer.flush_backward()
    assert rec.take() == ()


def test_the_throttle_stretches_the_modules_own_spans_not_the_step() -> None:
    """Fault injection on an own loop: the throttle stalls inside this rank's F span (after the
    forward) and B span (when the backward's gradients are computed), as behind a slower device;
    the spans include the stall."""
    import torch

    from resihp.trainer_hooks.own_loop import ForwardTimer

    class Stalls:
        factor = 1.5

        def __init__(self) -> None:
            self.asked: list[float] = []

        def stall_for(self, elapsed_s: float) -> float:
            self.asked.append(elapsed_s)
            return 0.0

    net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4))
    rec = ChunkRecorder()
    throttle = Stalls()
    timer = ForwardTimer(rec, net, throttle)
    net(torch.randint(0, 16, (2, 3))).sum().backward()
    timer.flush_backward()
    (f, b) = rec.take()
    assert [f[0], b[0]] == ["F", "B"] and len(throttle.asked) == 2 and timer.stretched
    assert 0 < throttle.asked[0] <= f[4] - f[3]  # asked for the forward's own time, inside its span
    assert 0 < throttle.asked[1] <= b[4] - b[3]
