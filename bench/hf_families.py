"""Hugging Face decoder families with no layout spec, split over TP 2: equal to the unsharded model?

    python bench/hf_families.py [--families Llama,Qwen3,...]

For each family a tiny random config (vocabulary 256, hidden 64, 4 blocks, 8 heads, 4 KV heads,
rows of 32 tokens, a sliding window of 8 where the family has one) is read by ``hf_layout`` (its declared TP and pipeline plans, nothing
written by hand; ``init``'s check against the model's own forward included) and run as one
stage split over TP 2 on two gloo processes: one row of two packed documents, forward and
backward, against the unsharded ``transformers`` model on each document alone. Prints a table
(largest logit and loss differences, the worst parameter gradient's relative difference, the
TP styles the family declares) and one JSON line: ``families_ok`` / ``families`` and the worst
differences. A family fails when its logits differ by more than 1e-5 or a gradient by more
than 1e-4 (relative), or when the reading is refused.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Phi", "Phi3", "Olmo", "Olmo2", "Granite",
            "Cohere", "Cohere2", "Glm", "GPTNeoX", "Starcoder2", "SmolLM3", "Exaone4", "Apertus", "Arcee", "Helium",
            "Ministral", "Mixtral", "Qwen3Moe")
SEQ = 32
LOGIT_TOL, GRAD_TOL = 1e-5, 1e-4


def factory(family: str) -> Any:
    import transformers

    shape: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": SEQ}
    if family == "GPTNeoX":
        shape.pop("num_key_value_heads")  # multi-head attention only
    if family in ("Ministral", "Qwen3"):
        shape["head_dim"] = 16  # heads x head_dim != hidden (their default head width is 128)
    if family == "Helium":
        shape["head_dim"] = 8  # Helium's own forward needs heads x head_dim == hidden
    if family in ("Mixtral", "Qwen3Moe"):
        shape.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    cfg = getattr(transformers, f"{family}Config")(**shape)
    if isinstance(getattr(cfg, "sliding_window", None), int):
        cfg.sliding_window = 8  # shorter than the documents: the sliding layers' masks matter
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = None, 1, 2  # ids inside the tiny vocabulary
    model_class = getattr(transformers, f"{family}ForCausalLM")
    return lambda: model_class(cfg)


def worker(rank: int, port: int, family: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from resihp.trainer_hooks.runtime.layout import shard_slice
    from resihp.trainer_hooks.runtime.model import PackedMeta, loss_sum
    from resihp.trainer_hooks.runtime.tp_layers import TPContext
    from resihp.trainer_hooks.runtime.trainer import stage_parameters
    from resihp.trainer_hooks.usermodel.recipe import UserModelRecipe

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    recipe = UserModelRecipe(factory(family))
    full = recipe.template()
    tokens = torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(7))
    targets = torch.roll(tokens, -1)
    seqlens = [20, SEQ - 20]
    stage = recipe.build_stage((0, recipe.num_layers), True, True, TPContext(dist.group.WORLD, rank, 2))
    logits = stage(tokens, PackedMeta.from_seqlens(seqlens))
    loss = loss_sum(logits, targets) / SEQ
    loss.backward()
    parts, start = [], 0
    for n in seqlens:
        parts.append(full(input_ids=tokens[None, start:start + n]).logits[0])
        start += n
    ref = torch.cat(parts)
    ref_loss = F.cross_entropy(ref.float(), targets, reduction="sum") / SEQ
    ref_loss.backward()
    specs = {s.name: s for s in recipe.layout().tensor_specs()}
    grads: dict[str, float] = {}
    for name, p in stage_parameters(stage).items():
        want_full = full.get_parameter(name).grad
        if p.grad is None or want_full is None:
            grads[name] = 0.0 if p.grad is None and want_full is None else float("inf")
            continue
        want = want_full.reshape(specs[name].shape)[shard_slice(specs[name], rank, 2)]
        grads[name] = float((p.grad - want).abs().max()) / max(float(want.abs().max()), 1e-12)
    worst = max(grads, key=lambda k: grads[k])
    styles = sorted({str(v) for v in recipe.layout_spec.tp_plan.values()})
    out.write_text(json.dumps({"logits": float((logits - ref).abs().max()), "loss": abs(float(loss) - float(ref_loss)),
                               "grad": grads[worst], "worst": worst, "styles": styles,
                               "split": sum(1 for s in specs.values() if s.tp_dim is not None)}))
    dist.destroy_process_group()


def run_family(family: str, work: Path) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [work / f"{family}.{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), family, str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs) or not all(o.exists() for o in outs):
        last = [line for line in logs[0].splitlines() if line.strip() and not line.startswith("[transformers]")]
        return {"ok": False, "error": (last[-1] if last else "no output")[:300]}
    got = [json.loads(o.read_text()) for o in outs]
    res = {"logits": max(g["logits"] for g in got), "loss": max(g["loss"] for g in got),
           "grad": max(g["grad"] for g in got), "worst": max(got, key=lambda g: g["grad"])["worst"],
           "styles": got[0]["styles"], "split": got[0]["split"]}
    res["ok"] = res["logits"] <= LOGIT_TOL and res["grad"] <= GRAD_TOL
    return res


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), int(argv[2]), argv[3], Path(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated transformers class prefixes")
    a = ap.parse_args(argv)
    import transformers

    families = [f for f in a.families.split(",") if f]
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    print(f"transformers {transformers.__version__}; TP 2 on two gloo processes, one row of two packed documents")
    print(f"{'family':12s} {'ok':3s} {'logits':>9s} {'loss':>9s} {'grad rel':>9s}  styles / error")
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            r = rows[family] = run_family(family, Path(tmp))
            if "error" in r:
                print(f"{family:12s} no  {'':>9s} {'':>9s} {'':>9s}  {r['error']}", flush=True)
            else:
                print(f"{family:12s} {'yes' if r['ok'] else 'no':3s} {r['logits']:9.1e} {r['loss']:9.1e} {r['grad']:9.1e}  "
                      f"{', '.join(r['styles'])} ({r['split']} split tensors)", flush=True)
    done = [r for r in rows.values() if "error" not in r]
    print(json.dumps({"families_ok": sum(1 for r in rows.values() if r["ok"]), "families": len(rows),
                      "failed": sorted(f for f, r in rows.items() if not r["ok"]),
                      "max_logit_diff": max((r["logits"] for r in done), default=None),
                      "max_grad_rel_diff": max((r["grad"] for r in done), default=None),
                      "transformers": transformers.__version__, "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0 if all(r["ok"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
