"""The timeline PNG of a run: iteration time (observed and predicted), throughput and loss
against the reference, on one time axis (seconds since job start), with the injections
(red), findings (orange) and reconfigurations (blue) marked across every panel.

matplotlib is imported here only, lazily (inside ``render_timeline``), with the Agg backend,
so the summary path never pays for it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from resihp.report.data import RunData, StepRow, load_run
from resihp.report.trace import PredictedSeries, predicted_times

ROLLING_STEPS = 4  # throughput window: tokens of the last N steps over the time they took


def rolling_tokens_per_s(steps: list[StepRow], window: int = ROLLING_STEPS) -> list[tuple[float, float]]:
    """(step end time, tokens/s over the last ``window`` steps); downtime inside the window counts."""
    out: list[tuple[float, float]] = []
    for i in range(1, len(steps)):
        j = max(0, i - window)
        dt = steps[i].time - steps[j].time
        if dt > 0:
            out.append((steps[i].time, sum(s.tokens for s in steps[j + 1:i + 1]) / dt))
    return out


def _markers(ax: Any, data: RunData, label: bool) -> None:
    t0 = data.t0
    first = True
    for inj in data.injections:
        text = f"inject slow x{inj.factor:g} r{inj.rank}" if inj.kind == "slow" else f"inject kill r{inj.rank}"
        ax.axvline(inj.time - t0, color="red", lw=1.6, label="injection" if label and first else None)
        if label:
            ax.annotate(text, (inj.time - t0, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=7, color="red")
        first = False
    first = True
    for f in data.findings:
        if f.kind not in ("fail-slow", "fail-stop"):
            continue
        ax.axvline(f.time - t0, color="orange", lw=1.2, ls="--", label="finding" if label and first else None)
        if label:
            ax.annotate(f"{f.kind} {list(f.ranks)}", (f.time - t0, 0.55), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color="darkorange")
        first = False
    first = True
    for rc in data.progress.reconfigs:
        ax.axvline(rc.time - t0, color="tab:blue", lw=1.2, label="reconfiguration" if label and first else None)
        if rc.downtime_s > 0:  # ``time`` is when the new plan was in place: the downtime lies before it
            ax.axvspan(rc.time - t0 - rc.downtime_s, rc.time - t0, color="tab:blue", alpha=0.12,
                       label="downtime" if label and first else None)
        if label:
            ax.annotate(f"epoch {rc.epoch}: {rc.plan}", (rc.time - t0, 0.02), xycoords=("data", "axes fraction"),
                        rotation=90, va="bottom", ha="left", fontsize=7, color="tab:blue")
        first = False
    if not data.progress.reconfigs:  # commands only (the trainer wrote no reconfig lines)
        for c in data.commands:
            ax.axvline(c.time - t0, color="tab:blue", lw=1.0, ls=":", label="command" if label and first else None)
            if label:
                ax.annotate(f"epoch {c.epoch}: {c.plan}", (c.time - t0, 0.02), xycoords=("data", "axes fraction"),
                            rotation=90, va="bottom", ha="left", fontsize=7, color="tab:blue")
            first = False


def render_timeline(run_dir: Path | str, png_path: Path | str | None = None, *,
                    data: RunData | None = None, predicted: PredictedSeries | None = None) -> Path:
    """Write the timeline PNG (default RUN_DIR/timeline.png) and return its path.
    ``data`` / ``predicted`` may be passed in when the caller already loaded them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = data if data is not None else load_run(run_dir)
    run = Path(run_dir)
    out = Path(png_path) if png_path is not None else run / "timeline.png"
    pred = predicted if predicted is not None else predicted_times(run / "trace.jsonl")
    steps = data.progress.steps
    t0 = data.t0
    x = [s.time - t0 for s in steps]
    has_ref = data.reference is not None and bool(data.reference.steps)
    fig, axes = plt.subplots(3 if has_ref else 2, 1, sharex=True, figsize=(14, 9 if has_ref else 6.5))
    ax_t, ax_tp = axes[0], axes[1]

    ax_t.plot(x, [s.step_s for s in steps], ".-", color="black", lw=1, ms=3, label="observed (trainer step_s)")
    time_of = {s.step: s.time - t0 for s in steps}
    # an iteration traced twice (re-run after a rollback) keeps its last prediction, like its step line
    pts = sorted((time_of[i], p) for i, p in pred.by_iteration().items() if i in time_of)
    if pts:
        ax_t.plot([a for a, _ in pts], [b for _, b in pts], "-", color="tab:green", lw=1.5,
                  label="predicted healthy (detector cost model, replayed)")
    ax_t.set_ylabel("iteration time (s)")
    ax_t.set_title("iteration time: observed vs predicted" + ("" if pts else f"  [{pred.note}]"), fontsize=10)

    roll = rolling_tokens_per_s(steps)
    ax_tp.plot([t - t0 for t, _ in roll], [v for _, v in roll], "-", color="tab:purple", lw=1.5,
               label=f"tokens/s (rolling {ROLLING_STEPS} steps)")
    ax_tp.set_ylabel("tokens/s")
    ax_tp.set_title("training throughput", fontsize=10)

    if has_ref and data.reference is not None:
        ax_l = axes[2]
        ax_l.plot(x, [s.loss for s in steps], "-", color="black", lw=1.2, label="loss (this run)")
        ref = [(time_of[r.step], r.loss) for r in data.reference.steps if r.step in time_of]
        ax_l.plot([a for a, _ in ref], [b for _, b in ref], "--", color="tab:gray", lw=1.2,
                  label="reference loss (same step, no faults)")
        ax_l.set_ylabel("loss")
        ax_l.set_title("loss vs the uninterrupted reference run (at the same step)", fontsize=10)
    for i, ax in enumerate(axes):
        _markers(ax, data, label=i == 0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)  # outside: never over the data
    for ax in (ax_t, ax_tp):  # times and rates from zero, so a 2x slowdown looks like one
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("seconds since job start")
    fig.suptitle(f"resihp run {run.name}: {len(steps)} steps, epochs {sorted({s.epoch for s in steps})}", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
