"""Qwen3.5 / Qwen3.6 (transformers' `qwen3_5` and `qwen3_5_moe` text models): a hybrid decoder whose layers mix Gated
DeltaNet linear attention with gated full attention, in Flax NNX with multi-LoRA on every linear.

Modules: `gated_delta` (the gated delta rule: chunked form, per-token recurrence and decode step), `conv` (the
depthwise causal conv in front of it), `segments` (packed segment ids as the recurrent parts read them), `config`
(the model's settings), `layers` (norms, MLP, gated attention), `linear_attention` (the Gated DeltaNet layer),
`sparse_moe` (routed experts plus the gated shared expert), `model` (decoder layers and the text model), `cache`
(what the sampler's decode slots keep: full-attention keys/values and linear-attention states), `checkpoint` (its
tensor names in both checkpoint layouts) and `family` (the family interface, for this folder and qwen3_5_moe's).
"""

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
