"""`megatron-dapo plan`: cluster layout, per-GPU memory and step-time estimates, no GPU needed."""
