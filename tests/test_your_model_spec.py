"""A wrong layout spec is a clear error at init, before any rank allocates the model: the model
is only ever built on the meta device until the spec has been checked against it."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from usermodel_models import NANOGPT_LAYOUT, SEQ, llama_factory, nanogpt_factory

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.runtime.trainer import TrainConfig
from resihp.trainer_hooks.usermodel.recipe import UserModelRecipe
from resihp.trainer_hooks.usermodel.recipe import recipe_for as user_recipe
from resihp.trainer_hooks.usermodel.spec import LayoutSpec

CONFIG = TrainConfig(max_seq_len=SEQ)


class Recording:
    """A factory that notes on which device each model it built holds its weights."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.devices: list[str] = []

    def __call__(self) -> nn.Module:
        model = self.factory()
        self.devices.append(next(model.parameters()).device.type)
        return model


def fails(model: Any, layout: Any, plan: Plan, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        user_recipe(model, layout, plan, CONFIG)
    if isinstance(model, Recording):
        assert model.devices == ["meta"], "the model was only built on the meta device"


def test_a_block_path_that_does_not_exist_names_the_model_s_modules() -> None:
    spec = dataclasses.replace(NANOGPT_LAYOUT, blocks="transformer.blocks")
    fails(Recording(nanogpt_factory()), spec, Plan.uniform(1, 2, 1, 4, 4),
          r"blocks 'transformer.blocks' is not a module of GPT \(its top-level modules: transformer, lm_head\)")


def test_a_tp_plan_naming_a_missing_module_lists_the_block_s_linear_layers() -> None:
    spec = dataclasses.replace(NANOGPT_LAYOUT, tp_plan={**NANOGPT_LAYOUT.tp_plan, "attn.qkv": "colwise"},
                               fused={})
    fails(Recording(nanogpt_factory()), spec, Plan.uniform(2, 1, 1, 4, 4),
          r"tp_plan names 'attn.qkv', which block 0 \(transformer.h.0, a Block\) does not have; its linear layers: "
          r"attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj")


def test_heads_not_divisible_by_tp_are_refused() -> None:
    fails(Recording(llama_factory(heads=8, kv_heads=2)), None, Plan.uniform(4, 1, 1, 4, 4),
          r"TP size 4 does not divide the model's 2 key/value heads")
    fails(Recording(nanogpt_factory(n_head=2)), NANOGPT_LAYOUT, Plan.uniform(4, 1, 1, 4, 4),
          r"TP size 4 does not divide the model's 2 attention heads")


def test_a_forward_that_cannot_run_split_is_named_at_init() -> None:
    """nanoGPT's original attention takes its head size from the input's width (C // n_head):
    with its heads split over TP it cannot run, and the check says so before training."""
    def nanogpt_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    factory = nanogpt_factory()

    def original() -> nn.Module:
        model = factory()
        for block in model.transformer.h:
            block.attn.forward = nanogpt_forward.__get__(block.attn)
        return model

    fails(Recording(original), NANOGPT_LAYOUT, Plan.uniform(2, 1, 1, 4, 4),
          r"one block of 'transformer.h' does not run split over TP size 2: RuntimeError: shape .* is invalid")
    user_recipe(original, NANOGPT_LAYOUT, Plan.uniform(1, 2, 2, 4, 4), CONFIG)  # PP x DP needs no split


def test_other_spec_mistakes_say_what_to_do() -> None:
    plan = Plan.uniform(1, 2, 1, 4, 4)
    fails(Recording(nanogpt_factory()), dataclasses.replace(NANOGPT_LAYOUT, post=("lm_head",)), plan,
          r"parameter 'transformer.ln_f.weight' lies in no pre, block or post module")
    fails(Recording(nanogpt_factory()), dataclasses.replace(NANOGPT_LAYOUT, tied={"lm_head.weight": "transformer.wpe.weight"}),
          plan, r"tied says 'lm_head.weight' is 'transformer.wpe.weight', but the model holds them as two")
    fails(Recording(nanogpt_factory()), None, plan, r"cannot tell how GPT is laid out; pass layout=LayoutSpec")
    with pytest.raises(SpecError, match=r"a micro-batch holds 64 tokens but nanoGPT takes rows of at most 32"):
        user_recipe(nanogpt_factory(), NANOGPT_LAYOUT, plan, TrainConfig(max_seq_len=64))
    with pytest.raises(SpecError, match=r"tp_plan\['mlp.c_fc'\] = 'sequence_parallel' is not a style"):
        dataclasses.replace(NANOGPT_LAYOUT, tp_plan={"mlp.c_fc": "sequence_parallel"})
    with pytest.raises(SpecError, match=r"fused\['mlp.c_fc'\] names a module the TP plan does not split colwise"):
        LayoutSpec(blocks="h", embed=lambda m, x, c: x, head=lambda m, x, c: x, tp_plan={"mlp.c_fc": "rowwise"}, fused={"mlp.c_fc": 2})
    with pytest.raises(SpecError, match=r"layout= describes a model of yours"):
        user_recipe("gpt-tiny", NANOGPT_LAYOUT, plan, CONFIG)


def test_torch_parallel_style_objects_are_accepted() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    spec = dataclasses.replace(NANOGPT_LAYOUT, tp_plan={"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                                        "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    assert spec.styles() == {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                             "mlp.c_proj": "rowwise"}
    recipe = UserModelRecipe(nanogpt_factory(), spec)
    recipe.validate([2, 4])


def test_torch_style_objects_are_read_by_their_layouts() -> None:
    """A torch ColwiseParallel that replicates its output is the gathering form, a RowwiseParallel
    taking a replicated input the splitting one; a sequence-parallel output is not built."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from resihp.trainer_hooks.usermodel.spec import known_style

    assert [known_style(s) for s in (ColwiseParallel(), ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(),
                                     RowwiseParallel(input_layouts=Replicate()),
                                     RowwiseParallel(output_layouts=Shard(1)))] == [
        "colwise", "colwise_gather", "rowwise", "rowwise_split", None]


def test_a_hugging_face_model_needs_no_spec() -> None:
    recipe = UserModelRecipe(llama_factory())
    ls = recipe.layout_spec
    assert (ls.blocks, ls.pre, ls.post, ls.shared) == ("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"),
                                                       ("model.rotary_emb",))
    assert ls.styles()["self_attn.k_proj"] == "colwise" and ls.styles()["mlp.down_proj"] == "rowwise"
    assert ls.packed
    assert (recipe.spec.num_kv_heads, recipe.spec.gated_mlp) == (4, True)


def test_a_hugging_face_forward_the_plans_do_not_describe_is_refused_at_init() -> None:
    """A family whose forward does more than embedding, blocks, norm and head (here: logits
    doubled) would train another function; the reading is checked against the model's own
    forward on a two-block copy, and the mismatch named before anything is allocated."""
    from transformers import LlamaForCausalLM

    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            assert out.logits is not None
            out.logits = out.logits * 2.0
            return out

    config = llama_factory()().config
    fails(Recording(lambda: DoubledLogits(config)), None, Plan.uniform(1, 2, 1, 4, 4),
          r"DoubledLogits's own forward computes other logits than resihp's reading of its declared plans")


def test_the_families_scalars_are_read_from_their_config() -> None:
    """Granite scales its embeddings and divides its logits, Cohere scales its logits: read
    from the config, they pass the check against the model's own forward."""
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    shape: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": SEQ}
    granite = UserModelRecipe(lambda: GraniteForCausalLM(GraniteConfig(**shape, embedding_multiplier=12.0,
                                                                       logits_scaling=4.0)))
    cohere = UserModelRecipe(lambda: CohereForCausalLM(CohereConfig(**shape, logit_scale=0.25)))
    assert (granite.num_layers, cohere.num_layers) == (2, 2)


def test_a_large_config_is_checked_on_a_shrunk_copy() -> None:
    """Llama 2 7B's config: the check runs on a two-block copy with tiny widths; the model
    itself is only ever built on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from resihp.trainer_hooks.usermodel.hf_check import shrunk_config

    factory = Recording(lambda: LlamaForCausalLM(LlamaConfig()))
    recipe = UserModelRecipe(factory)
    assert (recipe.spec.hidden, recipe.num_layers, factory.devices) == (4096, 32, ["meta"])
    small = shrunk_config(LlamaConfig())
    assert (small.num_hidden_layers, small.hidden_size, small.intermediate_size, small.vocab_size) == (2, 256, 16, 128)


def test_a_model_the_check_cannot_copy_is_used_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import LlamaForCausalLM

    class NeedsMore(LlamaForCausalLM):
        def __init__(self, config: Any, vocab_file: str) -> None:  # a class the check cannot rebuild from its config
            super().__init__(config)

    config = llama_factory()().config
    with caplog.at_level("WARNING"):
        recipe = UserModelRecipe(lambda: NeedsMore(config, "vocab.txt"))
    assert recipe.num_layers == 4
    assert "could not check resihp's reading of NeedsMore against its own forward (TypeError" in caplog.text


def test_hugging_face_tp_styles_map_to_what_resihp_builds() -> None:
    """colwise_rep replicates the output (HF): it is the gathering form, not a split output."""
    from resihp.trainer_hooks.usermodel.spec import known_style

    assert [known_style(s) for s in ("colwise", "colwise_rep", "colwise_gather_output", "rowwise_split_input",
                                     "rowwise_rep", "replicated_with_grad_allreduce", "grouped_gemm")] == [
        "colwise", "colwise_gather", "colwise_gather", "rowwise_split", "rowwise_split", "replicated_grad", None]


def test_a_declared_style_resihp_does_not_build_allows_tp_1_only() -> None:
    def factory() -> nn.Module:
        model = llama_factory()()
        model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.gate_proj": "packed_colwise"}
        return model

    recipe = UserModelRecipe(factory)
    assert recipe.layout_spec.tp_unsupported == ("mlp.gate_proj = packed_colwise",)
    recipe.validate([1])
    with pytest.raises(SpecError, match=r"declares TP styles resihp does not build \(mlp.gate_proj = packed_colwise\), "
                                        r"so it cannot be split over TP size 2; run it with TP 1"):
        recipe.validate([2])


def test_replicated_modules_that_see_a_tp_shard_are_found_from_the_shapes_they_get() -> None:
    """Apertus's MLP activation has parameters and runs on the column-parallel layer's split
    output: its gradient is partial on each TP rank, though its plan does not say so. Norms on
    the whole hidden state (every Llama module outside the plan) are not."""
    from usermodel_models import recipe

    assert recipe("apertus").sharded_input_modules(2) == ("mlp.act_fn",)
    assert recipe("llama").sharded_input_modules(2) == ()
    assert recipe("qwen3").sharded_input_modules(2) == ()  # its q/k norms are declared (replicated_with_grad_allreduce)


def test_a_fused_gate_and_up_projection_is_read_as_a_gated_mlp() -> None:
    """Phi-3 computes its SwiGLU's gate and up in one ``gate_up_proj``: the cost model prices
    three MLP matrices, not two."""
    from usermodel_models import recipe

    assert recipe("phi3").spec.gated_mlp
    assert not recipe("nanogpt").spec.gated_mlp
