"""The initial layout: candidates, the choice rule, how the choice travels (pure and torch-free parts)."""
from __future__ import annotations

import math

import pytest

from resihp.coordinator.model.cluster import Cluster, GlobalBatch
from resihp.coordinator.model.spec import ModelSpec, SpecError, preset
from resihp.coordinator.planner.autolayout import Layout, choose, healthy_layouts, predicted_order
from resihp.trainer_hooks.runtime import autolayout as al


def L(text: str) -> Layout:
    return Layout.parse(text)


def test_healthy_layouts_of_eight_ranks_keep_tp_inside_a_node_and_heads_whole() -> None:
    tiny = preset("gpt-tiny")  # 8 layers, 4 heads
    got = {lay.describe() for lay in healthy_layouts(tiny, 8, 4, 8)}
    assert got == {"TP1xPP1xDP8", "TP1xPP2xDP4", "TP1xPP4xDP2", "TP1xPP8xDP1", "TP2xPP1xDP4", "TP2xPP2xDP2",
                   "TP2xPP4xDP1", "TP4xPP1xDP2", "TP4xPP2xDP1"}
    # two ranks per node: no TP4; four micro-batches: no DP8
    assert all(lay.tp <= 2 and lay.dp <= 4 for lay in healthy_layouts(tiny, 8, 2, 4))
    assert L("TP2xPP2xDP2") in healthy_layouts(tiny, 8, 2, 4)
    # three heads: only TP1 divides them; six ranks: PP and DP take the factors 2 and 3
    odd = ModelSpec("odd", num_layers=3, hidden=48, num_heads=3, ffn_hidden=96, vocab=64)
    assert {lay.describe() for lay in healthy_layouts(odd, 6, 6, 6)} == {
        "TP1xPP1xDP6", "TP1xPP2xDP3", "TP1xPP3xDP2"}


def test_no_layout_is_a_clear_error() -> None:
    one_layer = ModelSpec("one", num_layers=1, hidden=32, num_heads=1, ffn_hidden=64, vocab=64)
    with pytest.raises(SpecError, match="no layout of 4 ranks .* 1 micro-batches"):
        healthy_layouts(one_layer, 4, 4, 1)  # DP4 needs 4 micro-batches, PP needs layers, TP needs heads
    with pytest.raises(SpecError, match="need world >= 1"):
        healthy_layouts(one_layer, 0, 1, 1)


def test_layout_parse_round_trips_and_rejects_garbage() -> None:
    assert L("tp2 x pp1 x dp4") == Layout(2, 1, 4) and L(Layout(4, 2, 1).describe()) == Layout(4, 2, 1)
    for bad in ("TP2xPP2", "TP0xPP1xDP8", "2x2x2", ""):
        with pytest.raises(SpecError, match="expected TPaxPPbxDPc"):
            Layout.parse(bad)


def test_predicted_order_is_fastest_first_by_the_schedule_simulation() -> None:
    big = preset("gpt-tiny")
    order = predicted_order(healthy_layouts(big, 8, 4, 8), big, Cluster.uniform(2, 4), GlobalBatch(8, 128))
    times = [s for _, s in order]
    assert times == sorted(times) and len(order) == 9 and all(s > 0 for s in times)


def test_choose_takes_the_fastest_measured_and_keeps_a_replica_within_the_margin() -> None:
    got = choose({L("TP1xPP2xDP4"): 0.12, L("TP1xPP4xDP2"): 0.11, L("TP4xPP2xDP1"): 1.1})
    assert got.layout == L("TP1xPP4xDP2") and got.seconds == 0.11 and "fastest of 3 timed" in got.reason
    # DP1 fastest by 3 %: the DP2 layout is taken (a dead rank's state has a replica to come from)
    got = choose({L("TP1xPP8xDP1"): 0.100, L("TP1xPP4xDP2"): 0.103, L("TP2xPP1xDP4"): 0.2})
    assert got.layout == L("TP1xPP4xDP2") and "data-parallel replica" in got.reason
    # ... but not by 10 %
    assert choose({L("TP1xPP8xDP1"): 0.100, L("TP1xPP4xDP2"): 0.110}).layout == L("TP1xPP8xDP1")
    # untimed candidates (cut short, failed, NaN) do not count
    assert choose({L("TP1xPP8xDP1"): None, L("TP1xPP4xDP2"): math.nan, L("TP2xPP1xDP4"): 0.3}).layout == L(
        "TP2xPP1xDP4")
    with pytest.raises(SpecError, match="no candidate layout could be timed"):
        choose({L("TP1xPP8xDP1"): None})


def test_the_request_comes_from_init_or_from_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(al.LAYOUT_ENV, raising=False)
    monkeypatch.delenv(al.MICROBATCHES_ENV, raising=False)
    assert al.requested(None) is None and al.requested(al.AutoLayout(4)) == al.AutoLayout(4)
    monkeypatch.setenv(al.LAYOUT_ENV, "auto")
    assert al.requested(None) == al.AutoLayout(0) and al.AutoLayout(0).for_world(8).microbatches == 16
    monkeypatch.setenv(al.MICROBATCHES_ENV, "12")
    assert al.requested(None) == al.AutoLayout(12)
    monkeypatch.setenv(al.MICROBATCHES_ENV, "many")
    with pytest.raises(SpecError, match="RESIHP_MICROBATCHES='many': expected the global micro-batches"):
        al.requested(None)
    with pytest.raises(SpecError, match="cutoff must be a number > 1"):
        al.AutoLayout(8, cutoff=1.0)


def test_the_launchers_choice_travels_as_one_line_and_one_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    record = {"layout": "TP1xPP4xDP2", "candidates": [], "plan": {}}
    out = "some rank's warning\n" + al.choice_line(record) + "\nmpirun: done\n"
    assert al.read_choice(out) == record and al.read_choice("no choice here") is None
    assert al.read_choice(al.CHOICE_MARK + "{broken") is None
    tiny = preset("gpt-tiny")
    monkeypatch.delenv(al.LAYOUT_PLAN_ENV, raising=False)
    assert al.planned_by_launcher(tiny, 8, 8) is None
    monkeypatch.setenv(al.LAYOUT_PLAN_ENV, "TP1xPP4xDP2")
    plan = al.planned_by_launcher(tiny, 8, 8)
    assert plan is not None and plan.describe() == "TP1xPP4xDP2 mb 4,4"
    with pytest.raises(SpecError, match="4 ranks, but this job has 8"):
        monkeypatch.setenv(al.LAYOUT_PLAN_ENV, "TP1xPP2xDP2")
        al.planned_by_launcher(tiny, 8, 8)


def test_the_profile_table_marks_the_choice_and_the_candidates_cut_short() -> None:
    record = {"model": "gpt-tiny", "world": 8, "microbatches": 8, "profile_s": 14.9, "layout": "TP1xPP4xDP2",
              "reason": "TP1xPP4xDP2 ran 0.1153 s per iteration",
              "candidates": [{"layout": "TP1xPP4xDP2", "predicted_s": 3e-4, "measured_s": [0.12, 0.11],
                              "cut_short": False},
                             {"layout": "TP4xPP2xDP1", "predicted_s": 4.5e-3, "measured_s": [1.15],
                              "cut_short": True}]}
    text = al.table(record)
    assert "TP1xPP4xDP2" in text and "0.1150 <- chosen" in text and "1.1500 (cut short)" in text
    assert text.splitlines()[-1] == "  chosen: TP1xPP4xDP2 ran 0.1153 s per iteration"
