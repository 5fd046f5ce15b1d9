"""The hybrid-parallel runtime: places the model and AdamW from a plan and trains a step.

Per iteration: this rank's replica takes its share of the global batch, runs it through
the 1F1B pipeline, sums gradients over the ranks holding the same shards (DP), and steps
AdamW. Every micro-batch's loss is its summed token cross-entropy divided by the token
count of the WHOLE global batch, so the summed gradients are the global-batch gradient
whatever the replicas' shares are (even a share of zero). AdamW is element-wise, so
sharding it by TP changes nothing. The reported loss is the global batch's mean token
loss, known on the last-stage ranks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, overload

import torch
import torch.distributed as dist

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import ModelSpec, SpecError
from resihp.trainer_hooks.launch.backends import group_runs_nccl
from resihp.trainer_hooks.reporting.deaths import DeathWatch
from resihp.trainer_hooks.reporting.opcursor import CURSOR
from resihp.trainer_hooks.runtime.abort_on_death import AbortOnDeath
from resihp.trainer_hooks.runtime.chunk_clock import clock_for
from resihp.trainer_hooks.runtime.data import GlobalBatches, PackedStream
from resihp.trainer_hooks.runtime.groups import (
    EpochGroups,
    StagePlace,
    build_groups,
    coarse_shard,
    communicators,
    destroy_groups,
    mixed_tp_sizes,
    sever,
)
from resihp.trainer_hooks.runtime.layout import Index, TensorSpec, gpt_tensor_specs, shard_shape, shard_slice
from resihp.trainer_hooks.runtime.model import GPTStage
from resihp.trainer_hooks.runtime.optim import OptimizerFactory, states_of
from resihp.trainer_hooks.runtime.pipeline import ChunkLog, PipelineStep
from resihp.trainer_hooks.runtime.throttle import Throttle
from resihp.trainer_hooks.runtime.tp_layers import TPContext, bind_tp, pending_tp, tp_modules

if TYPE_CHECKING:
    from resihp.trainer_hooks.usermodel.recipe import UserModelRecipe


@dataclass(frozen=True)
class TrainConfig:
    """The runtime's training settings.

    ``max_seq_len`` is the number of tokens in one micro-batch (one packed row: several
    documents share it), which is also the size of the position table; it is not the length
    of one document. For a plain (B, T) batch report ``seqlens=[[T]] * B``: B rows of T.
    """

    seed: int = 0
    # tokens per micro-batch (the packing budget: documents are packed into rows of this many
    # tokens) and the position table's size; not one document's length. tokens_per_microbatch,
    # when set, lowers the packing budget below it
    max_seq_len: int = 64
    tokens_per_microbatch: int = 0  # 0 = max_seq_len
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    data_seed: int = -1  # -1 = seed
    data_root: str = ""  # "" = the Python standard library
    # how compute chunks (F, B, W) are timed: "wall" (default; CUDA events on a GPU), "cpu" (the
    # thread's CPU time: ranks sharing cores see the scheduler in wall time, not in CPU time;
    # a GPU refuses it), "auto" (CPU time on a CPU, CUDA events on a GPU). Wall stays the
    # default: on 2 shared cores CPU time found a 1.3x throttle in 3 iterations instead of 7,
    # but raised false fail-slow findings in 2 of 5 healthy 4-rank runs (cache and
    # scheduling effects inflate one rank's CPU time for a few iterations); see docs/runtime.md
    compute_clock: str = "wall"

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise SpecError(f"train: max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.tokens_per_microbatch > self.max_seq_len:
            raise SpecError(
                f"train: tokens_per_microbatch ({self.tokens_per_microbatch}) exceeds max_seq_len "
                f"({self.max_seq_len}); a packed document could not be given positions"
            )
        if self.lr <= 0:
            raise SpecError(f"train: lr must be > 0, got {self.lr}")
        if self.compute_clock not in ("auto", "wall", "cpu"):
            raise SpecError(f"train: compute_clock must be 'auto', 'wall' or 'cpu', got {self.compute_clock!r}")

    @property
    def budget(self) -> int:
        return self.tokens_per_microbatch or self.max_seq_len


@dataclass
class StepResult:
    """What one iteration did on this rank (what the step hook reports)."""

    iteration: int
    replica: int
    loss: float | None  # global mean token loss (last-stage ranks), else None
    tokens: int  # tokens this rank's replica trained on
    global_tokens: int
    seqlens: tuple[tuple[int, ...], ...]  # this replica's micro-batches
    sample_ids: tuple[int, ...]
    wall_start_s: float  # time.time() when the iteration started on this rank
    time_s: float  # this rank's step time
    chunks: list[tuple[str, int, int, float, float]] = field(default_factory=list)


def _default_device() -> torch.device:
    """CUDA under NCCL (one device per local rank, set by the bootstrap), else the CPU."""
    if group_runs_nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@overload
def build_stage(spec: ModelSpec, max_seq_len: int, place: StagePlace, tp: TPContext | None = None,
                device: torch.device | None = None, recipe: None = None) -> GPTStage: ...
@overload
def build_stage(spec: ModelSpec, max_seq_len: int, place: StagePlace, tp: TPContext | None = None,
                device: torch.device | None = None, recipe: UserModelRecipe | None = None) -> torch.nn.Module: ...
def build_stage(spec: ModelSpec, max_seq_len: int, place: StagePlace, tp: TPContext | None = None,
                device: torch.device | None = None, recipe: UserModelRecipe | None = None) -> torch.nn.Module:
    """The stage module of ``place`` with undrawn weights (the runtime's GPT) or a user's model's
    initial ones (``recipe``). Without ``tp`` its TP group is pending (``bind_tp`` gives it the
    real one once the groups exist)."""
    if recipe is not None:
        return recipe.build_stage(place.layer_range, place.first, place.last,
                                  tp or pending_tp(place.tp_index, place.tp_size), device)
    with torch.device(device or torch.device("cpu")):
        return GPTStage(spec, max_seq_len, place.layer_range, place.first, place.last,
                        tp or pending_tp(place.tp_index, place.tp_size))


@dataclass
class StageAhead:
    """A stage module built ahead of a switch, with what a Runtime derives from it: walking
    a module tree costs ~1 ms per walk in Python, and a switch walked it five times (device
    check, AdamW, parameter table, TP binding, loading) with several ranks sharing a core."""

    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    tp_modules: list[torch.nn.Module]  # the sub-modules that hold a TP place
    optimizer: torch.optim.Optimizer


def new_adamw(params: Any, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay)


def new_optimizer(params: dict[str, torch.nn.Parameter], config: TrainConfig,
                  optimizer: OptimizerFactory | None) -> torch.optim.Optimizer:
    """The user's optimizer over ``params``, or AdamW from the config."""
    return optimizer(list(params.values())) if optimizer is not None else new_adamw(list(params.values()), config)


def stage_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A stage's parameters by layout name (a user's model names a tied weight once)."""
    logical = getattr(model, "logical_parameters", None)
    return cast("dict[str, torch.nn.Parameter]", logical()) if callable(logical) else dict(model.named_parameters())


def build_stage_ahead(spec: ModelSpec, config: TrainConfig, place: StagePlace,
                      device: torch.device | None = None, recipe: UserModelRecipe | None = None,
                      optimizer: OptimizerFactory | None = None) -> StageAhead:
    """``build_stage`` (TP group pending) with its parameter table, TP layers and an empty
    optimizer (AdamW, or ``optimizer``'s)."""
    model = build_stage(spec, config.max_seq_len, place, device=device, recipe=recipe)
    params = stage_parameters(model)
    return StageAhead(model, params, tp_modules(model), new_optimizer(params, config, optimizer))


def sum_in_place(tensors: Sequence[torch.Tensor], group: Any, what: str) -> None:
    """All-reduce (SUM) ``tensors`` over ``group`` as one flat buffer (one collective, not one
    per tensor); the sums are written back into them."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    with CURSOR.op("collective", what):
        dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def mixed_slices(coarse: dict[str, int], place: StagePlace, specs: Sequence[TensorSpec]
                 ) -> dict[str, tuple[tuple[int, ...], Index, bool]]:
    """For the parameters of ``coarse`` (name → the coarse TP size its gradient is summed over,
    ``groups.mixed_tp_sizes``) this rank holds: the shape of the coarse shard its own shard
    lies in, its shard's index within it, and whether it adds its gradient (a TP-split one
    always; a TP-replicated one from the first rank of each coarse shard of its group)."""
    out: dict[str, tuple[tuple[int, ...], Index, bool]] = {}
    if not coarse:
        return out
    index, size = place.tp_index, place.tp_size
    for spec in specs:
        g = coarse.get(spec.name)
        if g is None:
            continue
        mine = shard_slice(spec, index, size)
        around = shard_slice(spec, coarse_shard(index, size, g), g)
        local = tuple(slice(m.start - a.start, m.stop - a.start) for m, a in zip(mine, around))
        out[spec.name] = (shard_shape(around), local, spec.tp_dim is not None or index % (size // g) == 0)
    return out


class Runtime:
    """One rank's share of the model under the current plan, and its optimizer."""

    def __init__(
        self, spec: ModelSpec, plan: Plan, rank: int, config: TrainConfig, device: torch.device | None = None,
        throttle: Throttle | None = None, epoch: int = 0, cohabitants: Sequence[Plan] = (),
        data: GlobalBatches | None = None, model: torch.nn.Module | StageAhead | None = None,
        init_weights: bool = True, made_groups: dict[tuple[int, ...], Any] | None = None,
        recipe: UserModelRecipe | None = None, optimizer: OptimizerFactory | None = None,
    ) -> None:
        """``data``: the job's packed batch stream to go on with (a reconfiguration keeps it:
        the same samples, no re-packing); by default a fresh one from the config's seed.
        ``model``: this rank's stage module built ahead (``build_stage`` with a pending TP
        place, e.g. while a reconfiguration command waits for its ``apply_at``), or a
        ``StageAhead`` (the module with its parameter table and AdamW); it gets the new groups
        here. ``init_weights=False`` leaves the weights undrawn (the caller loads
        every one, as a reshard does). ``made_groups``: the plan's process groups, if the caller
        created them already (``groups.make_groups``); else they are created here, collectively.
        ``recipe``: a user's model (trainer_hooks/usermodel) instead of the runtime's GPT.
        ``optimizer``: builds the optimizer from the parameters (default AdamW from the config);
        its per-parameter state is learned once (``optim.probe_states``) for reshards and checkpoints."""
        plan.validate_for(spec.num_layers, spec.num_heads)
        if recipe is not None:
            recipe.check_plan(plan)
        self.recipe = recipe
        self.opt_states = states_of(optimizer)
        self.spec = spec
        self.config = config
        self.rank = rank
        self.device = device or _default_device()
        self.throttle = throttle or Throttle()
        batch_mbs = plan.batch_microbatches(config.budget)  # a token-share plan's replicas run other counts
        if data is not None and data.global_microbatches == batch_mbs:
            self.data = data
        else:
            stream = PackedStream(
                config.budget, seed=config.seed if config.data_seed < 0 else config.data_seed,
                root=Path(config.data_root) if config.data_root else None,
            )
            # a token share re-packs documents into micro-batches of up to max_seq_len tokens
            # (the position table); a model without document masks keeps its rows whole
            self.data = GlobalBatches(stream, batch_mbs, config.max_seq_len,
                                      packed=recipe is None or recipe.packed)
        self.plan = plan
        self.groups: EpochGroups = build_groups(plan, rank, epoch, spec, cohabitants, made=made_groups,
                                                layout=recipe.layout() if recipe is not None else None)
        place = self.groups.place
        ahead = model if isinstance(model, StageAhead) else None
        if model is None:
            model = build_stage(spec, config.max_seq_len, place, self.groups.tp, self.device, recipe)
        else:
            model = model.model if isinstance(model, StageAhead) else model
            want = (place.layer_range, place.first, place.last)
            if (model.layer_range, model.first, model.last) != want:
                raise SpecError(f"runtime: the module built ahead holds layers {model.layer_range} "
                                f"(first={model.first}, last={model.last}); this place needs {want}")
            bind_tp(model, self.groups.tp, ahead.tp_modules if ahead is not None else None)
        # typed as the runtime's GPT stage: a user's model's UserStage has the same call interface
        # (stage(x, meta), spec, layer_range, first, last, init_from_seed)
        self.model = cast(GPTStage, model)
        if init_weights:
            self.model.init_from_seed(config.seed)
        params = ahead.params if ahead is not None else stage_parameters(self.model)
        # for each parameter split over different TP sizes (_sync_mixed): the shape of the
        # coarse shard this rank's shard lies in, where in it, and whether this rank adds to it
        sizes = mixed_tp_sizes(plan, recipe.layout() if recipe is not None else None)
        mine = {n for _, _, names in self.groups.mixed_buckets for n in names}
        self._mixed_slices = mixed_slices(
            {n: g for n, g in sizes.items() if n in mine}, place,
            recipe.layout().tensor_specs() if recipe is not None else gpt_tensor_specs(spec, config.max_seq_len))
        if any(p.device != self.device for p in params.values()):
            self.model.to(self.device)  # moves parameters in place: the table and AdamW still hold them
        self.optimizer = ahead.optimizer if ahead is not None else new_optimizer(params, config, optimizer)
        self.pipeline = PipelineStep(self.model, place, self.device, self.throttle, self.groups.peer_groups,
                                     config.compute_clock, DeathWatch(rank, plan.ranks(), epoch))
        self._params = params
        # NCCL: a collective with a dead peer may never return; the coordinator's word aborts
        # this epoch's communicators from the hook's thread (gloo fails by itself)
        groups = self.groups
        self._abort_on_death = AbortOnDeath(rank, plan.ranks(), epoch, lambda: communicators(groups)) \
            if self.device.type == "cuda" and group_runs_nccl() else None

    @property
    def epoch(self) -> int:
        return self.groups.epoch

    def _sync_gradients(self, log: ChunkLog) -> None:
        start = log.clock.mark()
        for _, group, names in self.groups.grad_buckets:
            params = [self._params[n] for n in names]
            grads: list[torch.Tensor] = []
            for p in params:
                if p.grad is None:  # a replica with no micro-batches still joins the sum
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            if group is not None:
                sum_in_place(grads, group, "DP all-reduce")
        self._sync_mixed()
        log.add_marks("DP", -1, start, log.clock.mark())

    def _sync_mixed(self) -> None:
        """Sum the gradients of parameters that holders split over different TP sizes
        (``groups.mixed_tp_sizes``) by coarse shard: each holder writes its shard's gradient
        into a zero tensor of the coarse shard that holds it (TP8 beside TP4: a quarter; TP2
        beside TP1: the whole parameter); a TP-replicated parameter, whose TP peers hold the
        same gradient (after any TP sum the model declares), only from one rank per coarse
        shard of its group. One all-reduce over the coarse shard's holders sums them and each
        takes its part back. It moves the coarse shard where the alike case moves a shard."""
        for _, group, names in self.groups.mixed_buckets:
            coarse: list[torch.Tensor] = []
            for name in names:
                p = self._params[name]
                shape, local, gives = self._mixed_slices[name]
                buf = torch.zeros(shape, dtype=p.dtype, device=p.device)
                if p.grad is not None and gives:
                    buf[local] = p.grad
                coarse.append(buf)
            if group is None:  # one holder (a tied weight on one rank): nothing to sum
                continue
            sum_in_place(coarse, group, "DP all-reduce (mixed TP)")
            for name, buf in zip(names, coarse):
                self._params[name].grad = buf[self._mixed_slices[name][1]].contiguous()

    def _global_loss(self, local: torch.Tensor | None) -> float | None:
        if local is None:
            return None
        # only TP rank 0 of each last stage contributes, so the sum is exact (x + 0 = x)
        value = local.clone() if self.groups.place.tp_index == 0 else torch.zeros_like(local)
        if self.groups.loss_group is not None:
            with CURSOR.op("collective", "loss all-reduce"):
                dist.all_reduce(value, group=self.groups.loss_group)
        return float(value)

    def train_step(self, step: int) -> StepResult:
        wall = time.time()
        log = ChunkLog(clock_for(self.device))  # on a GPU: CUDA events (chunk_clock.py)
        place = self.groups.place
        batch = self.data.for_replica(step, self.plan, place.replica)
        self.optimizer.zero_grad(set_to_none=True)
        local_loss = self.pipeline.run(batch, log)
        self.pipeline.finish_sends(log)
        self._sync_gradients(log)
        loss = self._global_loss(local_loss)
        start = log.clock.mark()
        with CURSOR.op("compute", "optimizer step"):
            self.optimizer.step()
        log.add_marks("OPT", -1, start, log.clock.mark())
        time_s = log.finish()
        return StepResult(
            iteration=step, replica=place.replica, loss=loss,
            tokens=batch.tokens, global_tokens=batch.global_tokens,
            seqlens=batch.seqlens if self.recipe is None or self.recipe.packed else
            tuple((sum(lens),) for lens in batch.seqlens),  # a model without document masks: one sequence a row
            sample_ids=batch.sample_ids, wall_start_s=wall,
            time_s=time_s, chunks=log.chunks,
        )

    def let_go_of_groups(self) -> list[Any]:
        """After a peer failure: destroy this epoch's groups and take out of this runtime
        everything that keeps their connections open (the groups themselves, the TP layers'
        bindings, the pipeline's unfinished sends), returned for ``groups.retire``. Once the
        caller lets go of them too, peers blocked on this rank fail at once instead of at
        their timeout. The runtime keeps its tensors (a recovery reshards from them)."""
        destroy_groups(self.groups)
        held = sever(self.groups, self.model)
        held += self.pipeline.abandon()
        return held

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by layout name (the table itself: do not modify it)."""
        return self._params

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards by layout name (the reshard planner's names)."""
        return {n: p.detach() for n, p in self._params.items()}

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """The optimizer's state (AdamW: exp_avg, exp_avg_sq, step) by parameter name: its own dicts, not
        copies (a switch reads them twice; do not modify them)."""
        state = self.optimizer.state
        return {n: state.get(p, {}) for n, p in self._params.items()}
