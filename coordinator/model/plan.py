"""The parallel layout as a value.

A Plan says, for every data-parallel replica, which ranks form the tensor-parallel group
of each pipeline stage, how many contiguous layers each (virtual) stage runs, and how many
micro-batches of the global batch the replica processes. Everything that reshapes a job —
planner, reshard planner, runtime — speaks this one type. Pure: no torch, grpc or MPI.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import chain
from typing import Any

from resihp.coordinator.model.spec import ModelSpec, SpecError


class Schedule(str, Enum):
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"
    ZB_H1 = "zb-h1"

    @classmethod
    def parse(cls, value: str) -> Schedule:
        for item in cls:
            if item.value == value:
                return item
        raise SpecError(f"unknown schedule {value!r}; expected one of {[s.value for s in cls]}")


@dataclass(frozen=True)
class RankPosition:
    replica: int
    stage: int
    tp_index: int
    tp_size: int


@dataclass(frozen=True)
class PipelinePlan:
    """One data-parallel replica: a pipeline of stages.

    ``stages[s]`` is the TP group of stage s (its size is that stage's TP degree).
    ``layers`` has one entry per *virtual* stage (pp × virtual_chunks); virtual stage j
    runs on stage ``j % pp`` — Megatron's interleaved assignment. With one chunk per
    device it is simply the layer count of each stage.

    ``tokens`` is the replica's share of the global batch in tokens when shares are cut by
    the document (docs/plan-inputs.md, "Document shares"): the replica packs them into
    ``microbatches`` micro-batches, so its micro-batches may be smaller (or, within the
    activation budget, larger) than the batch's. 0 keeps whole micro-batches: the share is
    ``microbatches × tokens_per_microbatch`` (every plan written before shares existed).
    """

    stages: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    microbatches: int
    tokens: int = 0

    def share_tokens(self, tokens_per_microbatch: int) -> int:
        """This replica's tokens of the global batch."""
        return self.tokens if self.tokens else self.microbatches * tokens_per_microbatch

    @property
    def pp(self) -> int:
        return len(self.stages)

    def ranks(self) -> tuple[int, ...]:
        return tuple(r for group in self.stages for r in group)

    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of every virtual stage, in model order."""
        out: list[tuple[int, int]] = []
        start = 0
        for count in self.layers:
            out.append((start, start + count))
            start += count
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stages": [list(g) for g in self.stages], "layers": list(self.layers),
                               "microbatches": self.microbatches}
        if self.tokens:  # absent for whole micro-batches: older readers see the plans they know
            out["tokens"] = self.tokens
        return out


@dataclass(frozen=True)
class Plan:
    replicas: tuple[PipelinePlan, ...]
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_chunks: int = 1
    epoch: int = 0
    spares: tuple[int, ...] = ()  # alive but given no work (e.g. an excluded slow device)
    reason: str = ""
    # every rank holding a shard; rank -> (replica, stage, tp index, tp size) is built from
    # it on first use (planner candidates of 16K ranks are built, scored and dropped without it)
    _members: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise SpecError("plan: needs at least one data-parallel replica")
        if self.virtual_chunks < 1:
            raise SpecError(f"plan: virtual_chunks must be >= 1, got {self.virtual_chunks}")
        if self.virtual_chunks > 1 and self.schedule is not Schedule.INTERLEAVED:
            raise SpecError("plan: virtual_chunks > 1 needs the interleaved-1f1b schedule")
        v = self.virtual_chunks
        groups = [g for rep in self.replicas for g in rep.stages]
        ok = all(rep.stages and len(rep.layers) == len(rep.stages) * v and min(rep.layers) >= 1
                 and rep.microbatches >= 0 and rep.tokens >= 0 and (rep.microbatches or not rep.tokens)
                 for rep in self.replicas) and all(groups)
        members: set[int] = set(chain.from_iterable(groups)) if ok else set()
        if not ok or len(members) != sum(map(len, groups)):
            _raise_first_problem(self.replicas, v)  # the first problem in plan order, named as always
        if self.spares:
            overlap = sorted(members.intersection(self.spares))
            if overlap:
                raise SpecError(f"plan: ranks {overlap} are both spares and members of a stage")
        object.__setattr__(self, "_members", members)

    def _table(self) -> dict[int, tuple[int, int, int, int]]:
        table: dict[int, tuple[int, int, int, int]] | None = self.__dict__.get("_positions")
        if table is None:
            table = {}
            for r_idx, rep in enumerate(self.replicas):
                for s_idx, group in enumerate(rep.stages):
                    k = len(group)
                    for t_idx, rank in enumerate(group):
                        table[rank] = (r_idx, s_idx, t_idx, k)
            self.__dict__["_positions"] = table
        return table

    # --- shape ------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def pp(self) -> int:
        return max(rep.pp for rep in self.replicas)

    @property
    def tp(self) -> int:
        return max(len(g) for rep in self.replicas for g in rep.stages)

    @property
    def global_microbatches(self) -> int:
        return sum(rep.microbatches for rep in self.replicas)

    @property
    def document_shares(self) -> bool:
        """Whether any replica's share is given in tokens (cut by the document)."""
        return any(rep.tokens for rep in self.replicas)

    def global_tokens(self, tokens_per_microbatch: int) -> int:
        """Tokens of the global batch this plan trains per step."""
        return sum(rep.share_tokens(tokens_per_microbatch) for rep in self.replicas)

    def batch_microbatches(self, tokens_per_microbatch: int) -> int:
        """The global batch in micro-batches of ``tokens_per_microbatch`` tokens: the micro-batch
        count for whole shares; a token-share plan's replicas may run other counts
        (``global_microbatches``), but their tokens add up to the same batch."""
        if not self.document_shares or tokens_per_microbatch < 1:
            return self.global_microbatches
        return self.global_tokens(tokens_per_microbatch) // tokens_per_microbatch

    def describe(self) -> str:
        """A short human-readable layout, e.g. ``TP2xPP2xDP2 mb 4,4`` or, for replicas that
        differ, ``[PP2 TP2,2 L4,4 mb5 | PP1 TP2 L8 mb3] spares 7``."""
        shapes = {(tuple(len(g) for g in rep.stages), rep.layers) for rep in self.replicas}
        mbs = ",".join(_share_text(rep) for rep in self.replicas)
        if len(shapes) == 1 and len({len(g) for rep in self.replicas for g in rep.stages}) == 1:
            rep = self.replicas[0]
            even = len(set(rep.layers)) == 1
            text = f"TP{self.tp}xPP{rep.pp}xDP{self.dp}" + ("" if even else f" L{','.join(map(str, rep.layers))}")
            text += f" mb {mbs}"
        else:
            parts = [f"PP{rep.pp} TP{','.join(str(len(g)) for g in rep.stages)} L{','.join(map(str, rep.layers))} "
                     f"mb{_share_text(rep)}" for rep in self.replicas]
            text = "[" + " | ".join(parts) + "]"
        return text + (f" spares {','.join(map(str, self.spares))}" if self.spares else "")

    def ranks(self) -> tuple[int, ...]:
        """Every rank that holds a model shard, sorted (computed once per plan)."""
        cached: tuple[int, ...] | None = self.__dict__.get("_sorted_ranks")
        if cached is None:
            cached = tuple(sorted(self._members))
            self.__dict__["_sorted_ranks"] = cached
        return cached

    def position(self, rank: int) -> RankPosition:
        try:
            return RankPosition(*self._table()[rank])
        except KeyError:
            raise SpecError(f"plan: rank {rank} is not part of this plan (ranks: {list(self.ranks())})") from None

    def position_table(self) -> Mapping[int, tuple[int, int, int, int]]:
        """rank -> (replica, stage, tp index, tp size) for every rank, without building a
        RankPosition per rank (the planner reads all 16K of them). Read-only."""
        return self._table()

    def has_rank(self, rank: int) -> bool:
        return rank in self._members

    def validate_for(self, num_layers: int, num_heads: int) -> None:
        """Raise SpecError unless every replica runs the whole model with legal TP sizes."""
        sizes = {len(g) for rep in self.replicas for g in rep.stages}
        if all(not (k & (k - 1) or num_heads % k) for k in sizes) and all(
                sum(rep.layers) == num_layers for rep in self.replicas):
            return  # the common case, checked in bulk; otherwise name the first problem below
        for r_idx, rep in enumerate(self.replicas):
            if sum(rep.layers) != num_layers:
                raise SpecError(
                    f"plan: replica {r_idx} runs {sum(rep.layers)} layers, the model has {num_layers}"
                )
            for s_idx, group in enumerate(rep.stages):
                k = len(group)
                if k & (k - 1) or num_heads % k:
                    raise SpecError(
                        f"plan: replica {r_idx} stage {s_idx} has TP size {k}; TP sizes must be powers of two "
                        f"that divide the head count ({num_heads})"
                    )

    # --- construction -----------------------------------------------------------------
    @classmethod
    def uniform(
        cls,
        tp: int,
        pp: int,
        dp: int,
        num_layers: int,
        global_microbatches: int,
        schedule: Schedule = Schedule.ONE_F_ONE_B,
        virtual_chunks: int = 1,
        ranks: Sequence[int] | None = None,
    ) -> Plan:
        """The textbook layout: TP fastest, then PP, then DP (rank = d·pp·tp + s·tp + t);
        layers and micro-batches spread as evenly as integers allow."""
        world = tp * pp * dp
        order = list(range(world)) if ranks is None else list(ranks)
        if len(order) != world:
            raise SpecError(f"plan: tp×pp×dp = {world} but {len(order)} ranks were given")
        n_virtual = pp * virtual_chunks
        if num_layers < n_virtual:
            raise SpecError(f"plan: {num_layers} layers cannot fill {n_virtual} (virtual) stages")
        layers = tuple(even_split(num_layers, n_virtual))
        shares = even_split(global_microbatches, dp)
        replicas = []
        for d in range(dp):
            stages = tuple(
                tuple(order[d * pp * tp + s * tp + t] for t in range(tp)) for s in range(pp)
            )
            replicas.append(PipelinePlan(stages=stages, layers=layers, microbatches=shares[d]))
        return cls(replicas=tuple(replicas), schedule=schedule, virtual_chunks=virtual_chunks)

    # --- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "schedule": self.schedule.value,
            "virtual_chunks": self.virtual_chunks,
            "replicas": [rep.to_dict() for rep in self.replicas],
            "spares": list(self.spares),
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if not isinstance(data, Mapping):
            raise SpecError(f"plan must be an object, got {type(data).__name__}")
        if "replicas" not in data:
            shape = {k: data.get(k) for k in ("tp", "pp", "dp", "num_layers", "global_microbatches")}
            if all(isinstance(v, int) for v in shape.values()):
                return cls.uniform(
                    int(data["tp"]), int(data["pp"]), int(data["dp"]), int(data["num_layers"]),
                    int(data["global_microbatches"]), Schedule.parse(str(data.get("schedule", "1f1b"))),
                    int(data.get("virtual_chunks", 1)),
                )
            raise SpecError(
                "plan: give either 'replicas' or all of tp, pp, dp, num_layers, global_microbatches as integers"
            )
        replicas = []
        for i, rep in enumerate(data["replicas"]):
            try:
                stages = tuple(tuple(int(r) for r in g) for g in rep["stages"])
                layers = tuple(int(c) for c in rep["layers"])
                mbs = int(rep["microbatches"])
                tokens = int(rep.get("tokens", 0))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise SpecError(
                    f"plan: replica {i} needs 'stages' (lists of ranks), 'layers' (ints), 'microbatches' (int) "
                    f"and optionally 'tokens' (int): {exc}"
                ) from None
            replicas.append(PipelinePlan(stages=stages, layers=layers, microbatches=mbs, tokens=tokens))
        return cls(
            replicas=tuple(replicas),
            schedule=Schedule.parse(str(data.get("schedule", "1f1b"))),
            virtual_chunks=int(data.get("virtual_chunks", 1)),
            epoch=int(data.get("epoch", 0)),
            spares=tuple(int(r) for r in data.get("spares", ())),
            reason=str(data.get("reason", "")),
        )


def _share_text(rep: PipelinePlan) -> str:
    """``5`` for whole micro-batches, ``5:37000t`` for a token share in 5 micro-batches."""
    return f"{rep.microbatches}:{rep.tokens}t" if rep.tokens else str(rep.microbatches)


def _raise_first_problem(replicas: Sequence[PipelinePlan], v: int) -> None:
    """Walk the replicas in order and raise on the first problem: the full check, run only
    when the fast one in ``Plan.__post_init__`` found something wrong."""
    seen: set[int] = set()
    for r_idx, rep in enumerate(replicas):
        if rep.pp < 1:
            raise SpecError(f"plan: replica {r_idx} has no stages")
        if len(rep.layers) != rep.pp * v:
            raise SpecError(
                f"plan: replica {r_idx} lists {len(rep.layers)} layer counts; expected pp × virtual_chunks = "
                f"{rep.pp} × {v}"
            )
        if any(c < 1 for c in rep.layers):
            raise SpecError(f"plan: replica {r_idx} has a stage with no layers: {list(rep.layers)}")
        if rep.microbatches < 0:
            raise SpecError(f"plan: replica {r_idx} has a negative micro-batch share ({rep.microbatches})")
        if rep.tokens < 0 or (rep.tokens and not rep.microbatches):
            raise SpecError(f"plan: replica {r_idx} has a token share of {rep.tokens} in {rep.microbatches} "
                            f"micro-batches; a token share must be >= 0 and needs at least one micro-batch")
        for s_idx, group in enumerate(rep.stages):
            if not group:
                raise SpecError(f"plan: replica {r_idx} stage {s_idx} has an empty TP group")
            for rank in group:
                if rank in seen:
                    raise SpecError(f"plan: rank {rank} appears twice (replica {r_idx} stage {s_idx})")
                seen.add(rank)
    raise SpecError("plan: invalid layout")  # unreachable: the fast check saw a problem


def relayer(plan: Plan, model: ModelSpec) -> Plan:
    """``plan``'s ranks and micro-batch shares with ``model``'s layers split evenly over each
    pipeline's stages (SpecError when the model cannot be laid out so)."""
    data = plan.to_dict()
    for rep in data["replicas"]:
        rep["layers"] = even_split(model.num_layers, len(rep["stages"]) * plan.virtual_chunks)
    out = Plan.from_dict(data)
    out.validate_for(model.num_layers, model.num_heads)
    return out


def even_split(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` integers differing by at most one, larger ones first."""
    if parts <= 0:
        raise SpecError(f"cannot split into {parts} parts")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
