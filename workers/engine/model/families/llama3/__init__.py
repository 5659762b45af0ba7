"""Llama 3 (transformers' `llama`, LlamaForCausalLM): the dense decoder without q/k norm, with plain or llama3-scaled
rope (Llama 3.1+'s `rope_type: llama3`). `family.py` answers the family interface."""

MODEL_TYPES = ("llama",)
