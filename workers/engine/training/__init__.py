"""Training: the fused micro-batched step, the losses, AdamW, the adapter slots they update, and the checks of a
forward_backward's datums."""
