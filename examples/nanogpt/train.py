"""Train a small character-level GPT, in the shape of nanoGPT's ``train.py`` (written fresh; it
follows nanoGPT's structure and names).

``train_plain.py`` is the plain script, without resihp; ``train.py`` is the same file with
resihp's calls added and nothing else changed (README.md shows the diff). Either one runs as one
process or under a launcher:

    python examples/nanogpt/train_plain.py --max_iters=50
    torchrun --standalone --nproc_per_node=4 examples/nanogpt/train_plain.py
    resihp launch -n 4 -- python examples/nanogpt/train.py

Nothing is downloaded: the corpus is the bytes of Python standard-library source files (vocab
256). Any module-level setting below can be overridden as ``--key=value``.
"""
import glob
import math
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext

import numpy as np
import torch
from model import GPT, GPTConfig
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

import resihp.trainer_hooks as resihp_hooks

# -----------------------------------------------------------------------------
# default config values: a tiny model that trains on a CPU in seconds
eval_interval = 50  # 0: no evaluation
eval_iters = 5
log_interval = 10
# data
corpus_bytes = 1_000_000  # how much standard-library source to read
gradient_accumulation_steps = 4  # micro-steps per iteration, over all ranks together
batch_size = 4  # sequences per micro-step
block_size = 64
# model
n_layer = 2
n_head = 4
n_embd = 64
dropout = 0.0
bias = False
# AdamW
learning_rate = 1e-3
max_iters = 150
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0  # 0.0: no clipping
# learning-rate schedule
decay_lr = True
warmup_iters = 10
lr_decay_iters = 150
min_lr = 1e-4
# system
device = "cpu"  # 'cpu', 'cuda', 'cuda:0', 'mps'
dtype = "float32"  # 'float32' or 'bfloat16'
compile = False
seed = 1337
# -----------------------------------------------------------------------------
# the configurator: --key=value overrides of the settings above (nanoGPT keeps it in configurator.py)
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
for arg in sys.argv[1:]:
    assert arg.startswith("--") and "=" in arg, f"expected --key=value, got {arg!r}"
    key, val = arg[2:].split("=", 1)
    assert key in config_keys, f"unknown config key {key!r}"
    try:
        attempt = literal_eval(val)
    except (SyntaxError, ValueError):
        attempt = val  # a bare string, e.g. --device=cuda
    if isinstance(globals()[key], float) and type(attempt) is int:
        attempt = float(attempt)
    assert type(attempt) is type(globals()[key]), f"{key}: expected {type(globals()[key]).__name__}, got {val!r}"
    print(f"Overriding: {key} = {attempt!r}")
    globals()[key] = attempt
# -----------------------------------------------------------------------------

# various inits, derived attributes, I/O setup
ddp = int(os.environ.get("RANK", -1)) != -1  # is this a DDP run (torchrun sets RANK)?
if ddp:
    init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # this process logs
    seed_offset = ddp_rank  # each process draws different batches
    # the world size splits the accumulation steps: the global batch stays the same
    assert gradient_accumulation_steps % ddp_world_size == 0, "gradient_accumulation_steps must divide by the world size"
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
torch.manual_seed(seed + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
ctx = nullcontext() if device_type == "cpu" or dtype == "float32" else torch.autocast(device_type, dtype=ptdtype)

# data: the bytes of standard-library source files, in sorted order (the same on every rank)
stdlib_dir = os.path.dirname(os.__file__)
chunks: list[bytes] = []
for path in sorted(glob.glob(os.path.join(stdlib_dir, "*.py"))):
    with open(path, "rb") as f:
        chunks.append(f.read())
    if sum(map(len, chunks)) >= corpus_bytes:
        break
corpus = np.frombuffer(b"".join(chunks)[:corpus_bytes], dtype=np.uint8)
n_train = int(0.9 * len(corpus))
data = {"train": corpus[:n_train], "val": corpus[n_train:]}
# one generator per split and rank: batches depend only on the seed, the rank and the step
generators = {split: torch.Generator().manual_seed(seed + seed_offset + (0 if split == "train" else 1_000_000))
              for split in data}


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = data[split]
    ix = torch.randint(len(d) - block_size, (batch_size,), generator=generators[split])
    x = torch.stack([torch.from_numpy(d[i:i + block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(d[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix.tolist()])
    return x.to(device), y.to(device)


# model init
iter_num = 0
gptconf = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                    vocab_size=256, dropout=dropout)  # bytes: 256 tokens
model = GPT(gptconf)
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if compile:
    print("compiling the model...")
    model.compile()  # in place: model stays a GPT (torch.compile(model) would return a wrapper)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
raw_model = model.module if isinstance(model, DDP) else model  # the GPT itself, unwrapped
job = resihp_hooks.init(model=raw_model)  # resihp: joins this process group, reports to the node's agent


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    """Mean loss over eval_iters batches of each split."""
    out = {}
    model.eval()
    for split in data:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int) -> float:
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (learning_rate - min_lr)


# training loop
X, Y = get_batch("train")  # the first batch
t0 = time.time()
lossf = float("nan")
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if eval_interval > 0 and iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")

    # forward and backward, with gradient accumulation over micro-steps
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            assert isinstance(model, DDP)
            # DDP all-reduces the gradients on the last micro-step only
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # the loss is a mean over the micro-steps
        X, Y = get_batch("train")  # fetch the next batch while the backward pass runs on a GPU
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # this rank's loss for the iteration (an estimate: the last micro-step's, scaled back up)
    lossf = loss.item() * gradient_accumulation_steps
    job.step(loss=lossf, tokens=tokens_per_iter)  # resihp: one report per iteration

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, lr {lr:.2e}")
    iter_num += 1
    if iter_num >= max_iters:
        break

if master_process:
    print(f"final loss {lossf:.6f}")
if ddp:
    destroy_process_group()
