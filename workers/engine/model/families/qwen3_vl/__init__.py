"""Qwen3-VL (transformers' `qwen3_vl`, `Qwen3VLForConditionalGeneration`): Qwen3's decoder (q/k norm) with the
interleaved multimodal rope and a vision tower whose DeepStack features join the first decoder layers, in Flax NNX
with multi-LoRA on every language-model linear.

Modules: `config` (the composite config.json's text and vision settings), `model` (model/decoder.py's causal LM
with the tower, the image placeholders, the 3-D rope and DeepStack),
`checkpoint` (the ForConditionalGeneration checkpoint's names), `tiny_vision` (its tiny checkpoint) and `family`
(the family interface, for this folder and qwen3_vl_moe's). The tower, its checkpoint names, the image merge and a
training batch's images (vision_batch.image_batch) are Qwen3.5's (qwen3_5/vision*.py), which Qwen3-VL's extends by
DeepStack's mergers.
"""

MODEL_TYPES = ("qwen3_vl",)
