"""megatron-dapo: Megatron-core RL post-training with DAPO."""

__version__ = "0.1.0"
