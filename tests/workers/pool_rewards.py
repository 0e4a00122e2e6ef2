"""Reward functions for the reward worker-pool tests (module level: they travel to the workers by name)."""

import os
import threading
import time


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


def sleeper(response: str, ground_truth: str, **_) -> float:
    """Sleeps `response` seconds (a slow but healthy reward, e.g. a remote judge), then scores 1."""
    time.sleep(float(response))
    return 1.0


class JudgeDown(Exception):
    """What an always-failing reward raises (a type of its own, so that counters and logs can be told apart)."""


def always_raises(response: str, ground_truth: str, **_):
    raise JudgeDown(f"judge unreachable for {response[:12]!r}")
