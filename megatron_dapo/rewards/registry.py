"""Reward functions by name, and a runner that never lets one crash or stall the run.

A reward function is `fn(response: str, ground_truth: str, **extra) -> float | dict`; a dict has
"score" and optionally "acc" and "pred" (the extracted answer; validation's maj@n votes on it).
Built-ins: `math_dapo` / `dapo_math` (the DAPO rule) and `math_verify` (needs the math-verify
package). A custom function is registered with `@register_reward("name")` or
named in the config as `"package.module:function"`.

`RewardRunner` calls the function with a time limit that counts from the moment the call starts (a
call waiting for a free thread or worker is not late). A call that raises, runs past the limit or
returns a non-finite score (NaN, +-inf) scores the sample `failure_score` (the worst score), is
counted by type (`failures_by_type`: the exception's class name, `RewardTimeout`, `NonFiniteReward`,
`RewardWorkerDied`; the run's `reward/failures/<type>` metrics) and logged (the first few of each
type, then every 100th); the run goes on.
With `num_workers = 0` calls run on a bounded set of threads (megatron_dapo.rewards.threads): a
hung call's thread is abandoned and replaced, up to a cap past which `RewardCallsHang` stops the
run. With `num_workers > 0` they run in worker processes instead (megatron_dapo.rewards.pool): a
hanging call's worker is killed, a crashed one replaced, both scored as failures.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable

from megatron_dapo.rewards.threads import MAX_HUNG, NUM_THREADS, RewardThreads
from megatron_dapo.runtime.hooks import import_function

log = logging.getLogger(__name__)

# failures logged in full: the first LOG_FIRST of each type, then every LOG_EVERY-th
LOG_FIRST = 5
LOG_EVERY = 100

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
        return import_function(name, "reward function")
    known = sorted(set(_REGISTRY) | {"math_dapo", "dapo_math", "math_verify"})
    raise ValueError(f"unknown reward function {name!r}; known: {known}, or give 'package.module:function'")


@dataclass(frozen=True)
class RewardResult:
    score: float
    acc: bool
    failed: bool = False
    error: str | None = None
    pred: str | None = None  # the answer the function extracted (a dict's "pred"), for majority votes
    error_type: str | None = None  # of a failure: the exception's class name, RewardTimeout, ...


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
        num_threads: int = NUM_THREADS,
        max_hung: int = MAX_HUNG,
    ):
        self.default = get_reward(default) if isinstance(default, str) else default
        self.by_source = {k: get_reward(v) if isinstance(v, str) else v for k, v in (by_data_source or {}).items()}
        self.pool = self.threads = None
        if num_workers > 0:
            from megatron_dapo.rewards.pool import RewardPool

            self.pool = RewardPool(self.default, self.by_source, num_workers)
        else:
            self.threads = RewardThreads(num_threads, max_hung)
        self.timeout_s = timeout_s
        self.failure_score = failure_score
        self.num_scored = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self.num_nonfinite = 0
        self.failures_by_type: Counter = Counter()
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._scoring = 0  # score_many calls in progress
        self._busy_since = 0.0
        self._busy_s = 0.0  # time with a score_many call in progress, before the current stretch

    def fn_for(self, data_source: str) -> RewardFn:
        return self.by_source.get(data_source, self.default)

    def score_many(self, items: list[tuple[str, str, str, dict]]) -> list[RewardResult]:
        """Score (response, ground_truth, data_source, extra) items concurrently; same order back."""
        self._begin_busy()
        try:
            if self.pool is not None:
                outcomes = self.pool.score(items, self.timeout_s)
            else:
                calls = [partial(self.fn_for(src), resp, gt, **(extra or {})) for resp, gt, src, extra in items]
                outcomes = self.threads.run(calls, self.timeout_s)
            results = [self._result(o) for o in outcomes]
            self._count(results)
        finally:
            self._end_busy()
        return results

    def _failure(self, error_type: str, message: str) -> RewardResult:
        return RewardResult(self.failure_score, False, True, f"{error_type}: {message}", error_type=error_type)

    def _result(self, outcome: tuple | None) -> RewardResult:
        """A call's outcome (None: past the time limit) as a RewardResult."""
        if outcome is None:
            return self._failure("RewardTimeout", f"timed out after {self.timeout_s}s")
        if outcome[0] == "error":
            return self._failure(outcome[1], outcome[2])
        try:
            return _as_result(outcome[1])
        except Exception as e:
            return self._failure(type(e).__name__, str(e))

    def _begin_busy(self) -> None:
        with self._lock:
            if self._scoring == 0:
                self._busy_since = time.monotonic()
            self._scoring += 1

    def _end_busy(self) -> None:
        with self._lock:
            self._scoring -= 1
            if self._scoring == 0:
                self._busy_s += time.monotonic() - self._busy_since

    def activity(self) -> tuple[int, float]:
        """(calls scored, seconds with calls in hand) so far: their differences between two looks are
        the runner's throughput (calls / s) over that stretch, queueing included."""
        with self._lock:
            now_busy = time.monotonic() - self._busy_since if self._scoring else 0.0
            return self.num_scored, self._busy_s + now_busy

    def _count(self, results: list[RewardResult]) -> None:
        with self._lock:
            for res in results:
                self.num_scored += 1
                if res.failed:
                    self.last_error = res.error
                    if res.error_type == "RewardTimeout":
                        self.num_timeouts += 1
                    elif res.error_type == NonFiniteReward.__name__:
                        self.num_nonfinite += 1
                    else:
                        self.num_errors += 1
                    self.failures_by_type[res.error_type] += 1
                    self._log_failure(res)

    def _log_failure(self, res: RewardResult) -> None:
        """Under the lock: the first LOG_FIRST failures of each type, then every LOG_EVERY-th."""
        n = self.failures_by_type[res.error_type]
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            later = f"; from now on every {LOG_EVERY}th is logged" if n == LOG_FIRST else ""
            log.warning("reward call failed (%s #%d%s): %s", res.error_type, n, later, res.error)

    def close(self) -> None:
        """End the worker processes (num_workers > 0) or threads."""
        if self.pool is not None:
            self.pool.close()
        if self.threads is not None:
            self.threads.close()

    def score(self, response: str, ground_truth: str, data_source: str = "math_dapo", extra: dict | None = None):
        return self.score_many([(response, ground_truth, data_source, extra or {})])[0]

    def counters(self) -> dict:
        return {
            "scored": self.num_scored,
            "errors": self.num_errors,
            "timeouts": self.num_timeouts,
            "nonfinite": self.num_nonfinite,
        }
