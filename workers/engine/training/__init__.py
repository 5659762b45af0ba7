"""Training: the fused micro-batched step, the losses, AdamW, and the adapter slots they update."""
