"""How resihp cuts and shards the nanoGPT model in ``model.py``: its layout spec, a few lines
that name what is already there (docs/your-model.md explains each field)."""
from resihp.trainer_hooks.usermodel.spec import LayoutSpec

NANOGPT_LAYOUT = LayoutSpec(
    blocks="transformer.h",
    pre=("transformer.wte", "transformer.wpe", "transformer.drop"),
    post=("transformer.ln_f", "lm_head"),
    embed=lambda m, idx, ctx: m.transformer.drop(m.transformer.wte(idx) + m.transformer.wpe(ctx.positions)),
    head=lambda m, h, ctx: m.lm_head(m.transformer.ln_f(h)),
    tp_plan={"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
    fused={"attn.c_attn": 3},  # q, k and v side by side in one linear layer
    tp_divide=("attn.n_head", "attn.n_embd"),  # a TP rank runs n_head / TP heads
    tied={"lm_head.weight": "transformer.wte.weight"},
    name="nanoGPT",
)
