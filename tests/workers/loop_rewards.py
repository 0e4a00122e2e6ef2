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


def held_parity_reward(response: str, ground_truth: str, **_) -> float:
    """parity_reward, held while a test's fault is under way: with LOOP_REWARD_HOLD=DIR in the environment, a
    call made once DIR/killed exists waits (up to 300 s) until DIR/released does, so the run cannot finish
    its steps before the test's relaunched server is back."""
    import os
    import time
    from pathlib import Path

    hold = Path(os.environ.get("LOOP_REWARD_HOLD", "/nonexistent"))
    deadline = time.monotonic() + 300
    while (hold / "killed").exists() and not (hold / "released").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return parity_reward(response, ground_truth)
