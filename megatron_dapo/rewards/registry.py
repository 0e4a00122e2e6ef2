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
thread) but holds up neither the batch nor interpreter exit. With `num_workers > 0` they run in
worker processes instead (megatron_dapo.rewards.pool): a hanging call's worker is killed, a crashed
one replaced, both scored as failures under the same time limit.
"""

from __future__ import annotations

import importlib
import inspect
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


@dataclass(frozen=True)
class RewardCall:
    """A reward function with the config's `reward.kwargs`, called with only the dataset extras it
    accepts (built-ins ignore what they do not know). A plain object, so that it pickles by the
    function's name into reward worker processes."""

    fn: RewardFn
    kwargs: tuple[tuple[str, object], ...] = ()

    def __call__(self, response, ground_truth, **extra):
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            extra = {k: v for k, v in extra.items() if k in names}
        # the config's kwargs always go (a function that does not take one fails, and says so)
        return self.fn(response, ground_truth, **{**extra, **dict(self.kwargs)})


class RewardRunner:
    """Scores responses with per-data-source reward functions under a time limit."""

    def __init__(
        self,
        default: str | RewardFn = "math_dapo",
        by_data_source: dict[str, str | RewardFn] | None = None,
        timeout_s: float = 10.0,
        failure_score: float = -1.0,
        num_workers: int = 0,
    ):
        self.default = get_reward(default) if isinstance(default, str) else default
        self.by_source = {k: get_reward(v) if isinstance(v, str) else v for k, v in (by_data_source or {}).items()}
        self.pool = None
        if num_workers > 0:
            from megatron_dapo.rewards.pool import RewardPool

            self.pool = RewardPool(self.default, self.by_source, num_workers)
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
        results = self._score_in_pool(items) if self.pool is not None else self._score_in_threads(items)
        self._count(results)
        return results

    def _failure(self, error: str) -> RewardResult:
        return RewardResult(self.failure_score, False, True, error)

    def _score_in_pool(self, items) -> list[RewardResult]:
        results = []
        for answer in self.pool.score(items, time.monotonic() + self.timeout_s):
            if answer is None:
                results.append(self._failure(f"timed out after {self.timeout_s}s"))
            elif answer[0] == "error":
                results.append(self._failure(answer[1]))
            else:
                try:
                    results.append(_as_result(answer[1]))
                except Exception as e:
                    results.append(self._failure(f"{type(e).__name__}: {e}"))
        return results

    def _score_in_threads(self, items) -> list[RewardResult]:
        slots: list[RewardResult | None] = [None] * len(items)
        done = [threading.Event() for _ in items]

        def work(i, response, gt, source, extra):
            try:
                slots[i] = _as_result(self.fn_for(source)(response, gt, **(extra or {})))
            except Exception as e:  # any failure of user code is a scored failure, not a crash
                slots[i] = self._failure(f"{type(e).__name__}: {e}")
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
                res = self._failure(f"timed out after {self.timeout_s}s")
            results.append(res)
        return results

    def _count(self, results: list[RewardResult]) -> None:
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

    def close(self) -> None:
        """End the worker processes (num_workers > 0)."""
        if self.pool is not None:
            self.pool.close()

    def score(self, response: str, ground_truth: str, data_source: str = "math_dapo", extra: dict | None = None):
        return self.score_many([(response, ground_truth, data_source, extra or {})])[0]

    def counters(self) -> dict:
        return {
            "scored": self.num_scored,
            "errors": self.num_errors,
            "timeouts": self.num_timeouts,
            "nonfinite": self.num_nonfinite,
        }
