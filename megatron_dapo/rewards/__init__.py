"""Reward functions: the DAPO math rule, an optional math-verify backend, custom ones by name."""

from megatron_dapo.rewards.registry import RewardResult, RewardRunner, get_reward, register_reward

__all__ = ["RewardResult", "RewardRunner", "get_reward", "register_reward"]
