"""Your own model under resihp: a layout spec (``LayoutSpec``; written for you from a Hugging Face
model's own TP/PP plans by ``hf_layout``) and the recipe that cuts, shards and reshards it
(``UserModelRecipe``). See docs/your-model.md."""
