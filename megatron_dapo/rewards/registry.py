"""Reward functions by name, and a runner that never lets one crash or stall the run.

A reward function is `fn(response: str, ground_truth: str, **extra) -> float | dict`; a dict has
"score" and optionally "acc" and "pred" (the extracted answer; validation's maj@n votes on it).
Built-ins: `math_dapo` / `dapo_math` (the DAPO rule) and `math_verify` (needs the math-verify
package). A custom function is registered with `@register_reward("name")` or
named in the config as `"package.module:function"`.

`RewardRunner` calls the function with a time limit. A call that raises, runs past the limit or
returns a non-finite score (NaN, +-inf) scores the sample `failure_score` (the worst score) and is
counted (`num_errors`, `num_timeouts`, `num_nonfinite`; the run's `reward/failures` metric); the
run goes on.
Calls run on daemon threads: a function stuck forever is abandoned (Python cannot kill a
thread) but holds up neither the batch nor interpreter exit.
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

RewardFn = Callable[..., "float | dict"]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: make `fn` available as reward `name`."""

    def deco(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def _builtin(name: str) -> RewardFn | None:
    if name in ("math_dapo", "dapo_math"):
        from megatron_dapo.rewards.math_dapo import compute_score
    elif name == "math_verify":
        from megatron_dapo.rewards.math_verify_backend import compute_score
    else:
        return None
    return compute_score


def get_reward(name: str) -> RewardFn:
    """The reward function called `name`: registered, built-in, or `module:function`."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    fn = _builtin(name)
    if fn is not None:
        return fn
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be imported: {e}") from e
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable")
        return fn
    known = sorted(set(_REGISTRY) | {"math_dapo", "dapo_math", "math_verify"})
    raise ValueError(f"unknown reward function {name!r}; known: {known}, or give 'package.module:function'")


@dataclass(frozen=True)
class RewardResult:
    score: float
    acc: bool
    failed: bool = False
    error: str | None = None
    pred: str | None = None  # the answer the function extracted (a dict's "pred"), for majority votes


class NonFiniteReward(ValueError):
    """A reward function returned NaN or +-inf: scored as a failure, never fed to the advantages."""


def _as_result(out) -> RewardResult:
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
        score = float(out["score"])
        acc = out.get("acc", score > 0)
        pred = out.get("pred")
    else:
        score = float(out)
        acc, pred = score > 0, None
    if not math.isfinite(score):
        raise NonFiniteReward(f"reward function returned a non-finite score {score}")
    return RewardResult(score, bool(acc), pred=None if pred is None else str(pred))


class RewardRunner:
    """Scores responses with per-data-source reward functions under a time limit."""

    def __init__(
        self,
        default: str | RewardFn = "math_dapo",
        by_data_source: dict[str, str | RewardFn] | None = None,
        timeout_s: float = 10.0,
        failure_score: float = -1.0,
    ):
        self.default = get_reward(default) if isinstance(default, str) else default
        self.by_source = {k: get_reward(v) if isinstance(v, str) else v for k, v in (by_data_source or {}).items()}
        self.timeout_s = timeout_s
        self.failure_score = failure_score
        self.num_scored = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self.num_nonfinite = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def fn_for(self, data_source: str) -> RewardFn:
        return self.by_source.get(data_source, self.default)

    def score_many(self, items: list[tuple[str, str, str, dict]]) -> list[RewardResult]:
        """Score (response, ground_truth, data_source, extra) items concurrently; same order back."""
        slots: list[RewardResult | None] = [None] * len(items)
        done = [threading.Event() for _ in items]

        def work(i, response, gt, source, extra):
            try:
                slots[i] = _as_result(self.fn_for(source)(response, gt, **(extra or {})))
            except Exception as e:  # any failure of user code is a scored failure, not a crash
                slots[i] = RewardResult(self.failure_score, False, True, f"{type(e).__name__}: {e}")
            finally:
                done[i].set()

        for i, item in enumerate(items):
            threading.Thread(target=work, args=(i, *item), daemon=True, name=f"reward-{i}").start()
        deadline = time.monotonic() + self.timeout_s
        results = []
        for i, event in enumerate(done):
            finished = event.wait(max(0.0, deadline - time.monotonic()))
            res = slots[i] if finished else None
            if res is None:
                res = RewardResult(self.failure_score, False, True, f"timed out after {self.timeout_s}s")
            results.append(res)
        with self._lock:
            for res in results:
                self.num_scored += 1
                if res.failed:
                    self.last_error = res.error
                    if res.error and res.error.startswith("timed out"):
                        self.num_timeouts += 1
                    elif res.error and res.error.startswith(NonFiniteReward.__name__):
                        self.num_nonfinite += 1
                    else:
                        self.num_errors += 1
        return results

    def score(self, response: str, ground_truth: str, data_source: str = "math_dapo", extra: dict | None = None):
        return self.score_many([(response, ground_truth, data_source, extra or {})])[0]

    def counters(self) -> dict:
        return {"scored": self.num_scored, "errors": self.num_errors, "timeouts": self.num_timeouts,
                "nonfinite": self.num_nonfinite}
