"""What a garbage collection costs a training process, with and without resihp's settling
(trainer_hooks/runtime/gc_control.py).

    python bench/gc_pause.py

In one process that imported torch and built the runtime's GPT stage and AdamW: a full
collection (generation 2: what the collector runs when it decides it is due, at whatever
allocation tips it over), best and median of 5; the same after ``settle()`` (collect, then
freeze what lives); and a fail-stop recovery's reshard plan (8 ranks TP2xPP2xDP2 -> 7, its
first call in a process that has just built its model, as in a recovery that comes before any
switch; whether a full collection came due inside it is counted) without and with settling,
each in a fresh process.
Prints a table, then one JSON line: full_gc_ms, full_gc_settled_ms, reshard_plan_first_ms,
reshard_plan_first_settled_ms.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

CHILD = r"""
import gc, json, statistics, sys, time
import torch
from resihp.coordinator.model.plan import Plan, PipelinePlan
from resihp.coordinator.model.spec import preset
from resihp.trainer_hooks.reconfig.reshard import plan_reshard
from resihp.trainer_hooks.runtime.gc_control import settle
from resihp.trainer_hooks.runtime.groups import place_of
from resihp.trainer_hooks.runtime.layout import gpt_tensor_specs
from resihp.trainer_hooks.runtime.trainer import TrainConfig, build_stage, stage_parameters, new_optimizer

spec = preset("gpt-tiny")
old = Plan.uniform(2, 2, 2, spec.num_layers, 8)
stage = build_stage(spec, 64, place_of(old, 0))
opt = new_optimizer(stage_parameters(stage), TrainConfig(), None)
settled = sys.argv[1] == "settled"
if settled:
    settle()
new = Plan((PipelinePlan(((0,), (1,), (2,)), (3, 3, 2), 4), PipelinePlan(((3,), (4,), (6,)), (3, 3, 2), 4)),
           old.schedule, 1, 1, (7,))
specs = gpt_tensor_specs(spec, 64)
fired = []
gc.callbacks.append(lambda phase, info: fired.append(info["generation"]) if phase == "start" else None)
t = time.perf_counter()
plan_reshard(old, new, specs, (0, 1, 2, 3, 4, 6, 7), states=("param", "exp_avg", "exp_avg_sq"))
first = (time.perf_counter() - t) * 1000
gen2 = fired.count(2)
full = []
for _ in range(5):
    t = time.perf_counter(); gc.collect(); full.append((time.perf_counter() - t) * 1000)
print(json.dumps({"full": full, "first": first, "gen2": gen2, "frozen": gc.get_freeze_count()}))
"""


def child(mode: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    t0 = time.perf_counter()
    runs = {mode: [child(mode) for _ in range(3)] for mode in ("plain", "settled")}
    row = {}
    print(f"{'process':10s} {'full GC ms (best / median of 5)':>32s} {'reshard plan, 1st call ms (3 processes)':>42s}")
    for mode, rs in runs.items():
        full = [float(x) for r in rs for x in r["full"]]
        first = [float(r["first"]) for r in rs]
        row[mode] = (min(full), statistics.median(full), statistics.median(first))
        print(f"{mode:10s} {min(full):15.3f} / {statistics.median(full):8.3f} {'':6s}"
              f"{', '.join(f'{x:.1f}' for x in first):>36s}   (full collections inside: "
              f"{sum(int(r['gen2']) for r in rs)}; frozen objects: {rs[0]['frozen']})")
    print(f"(wall {time.perf_counter() - t0:.0f} s)")
    print(json.dumps({"full_gc_ms": round(row["plain"][1], 3), "full_gc_settled_ms": round(row["settled"][1], 3),
                      "reshard_plan_first_ms": round(row["plain"][2], 1),
                      "reshard_plan_first_settled_ms": round(row["settled"][2], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
