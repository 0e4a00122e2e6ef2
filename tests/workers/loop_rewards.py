"""Reward functions for the loop tests (named in configs as `tests.workers.loop_rewards:NAME`)."""


def parity_reward(response: str, ground_truth: str, **_) -> float:
    """Even answers: every sample right (uninformative groups, which dynamic sampling must drop).
    Odd answers: judged on the first character's code (mixed groups), and the reward function
    raises for a third of the responses (failures that must be counted, never crash the run)."""
    if int(ground_truth) % 2 == 0:
        return 1.0
    code = ord(response[0]) if response else 0
    if code % 3 == 0:
        raise RuntimeError(f"reward service unavailable for {response[:8]!r}")
    return 1.0 if code % 2 else -1.0
