"""Reward functions for the reward worker-pool tests (module level: they travel to the workers by name)."""

import os
import threading


def judged(response: str, ground_truth: str, **extra) -> dict:
    """A deterministic score that depends on every input, extras included."""
    score = (sum(map(ord, response)) * 7 + sum(map(ord, ground_truth)) + extra.get("bonus", 0)) % 11 - 5.0
    return {"score": score, "acc": score > 0, "pred": response[::-1]}


def misbehaving(response: str, ground_truth: str, **_):
    if response == "hang":
        threading.Event().wait(600)
    if response == "crash":
        os._exit(7)  # the interpreter dies mid-call, as a segfaulting extension would
    if response == "raise":
        raise RuntimeError("reward service unavailable")
    if response == "nan":
        return float("nan")
    if response == "pid":
        return float(os.getpid())
    return judged(response, ground_truth)
