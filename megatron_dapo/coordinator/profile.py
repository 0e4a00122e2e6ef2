"""Fitting the decode-step cost model (cost_model.py) to measured steps: pure functions.

The model, L(n, K) = a_b + a_k*K + max(o_thr, o_b + o_k*n), equals c + a_k*K + o_k*max(n, n*) with
c = a_b + o_b and the breakpoint n* = (o_thr - o_b) / o_k, below which the batch-dependent part is
flat. For a fixed n* this is linear in (c, a_k, o_k): each candidate n* (every measured n, the points
between them, and "no flat part") gets a least-squares fit, non-negative (the exact optimum over
the coefficients' signs, by trying each subset of free ones), and the candidate with the least error
wins. Residuals are relative (divided by the measured time), so short and long steps count alike;
a fit of traced steps (`by_steps`) instead weighs each point by its steps, absolute residuals.

Measured steps only tell the constant c, not how it splits between a_b and o_b: the fit reports
a_b = 0, o_b = c, o_thr = c + o_k*n*. Step times, throughputs and routing gains are the same for any split.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_dapo.config.cost_model import CostModel

BREAKPOINT_GRID = 64  # evenly spaced candidate n* between the smallest and largest measured n
REFINEMENTS = 3  # closer looks around the best candidate n*


@dataclass(frozen=True)
class ProfilePoint:
    """Decode steps measured at one grid setting: their mean batch, resident KV tokens and step time."""

    n: float  # running requests
    kv_tokens: float  # resident KV tokens
    step_s: float  # seconds per decode step
    steps: int = 0  # decode steps the mean is over (0: unknown)

    def to_dict(self) -> dict:
        return asdict(self)


def _check(points: Sequence[ProfilePoint]) -> None:
    if len(points) < 3:
        raise ValueError(f"cost model fit: need at least 3 measured points, got {len(points)}")
    for p in points:
        if not (p.step_s > 0 and p.n > 0 and p.kv_tokens >= 0 and math.isfinite(p.step_s)):
            raise ValueError(f"cost model fit: point {p} needs n > 0, kv_tokens >= 0 and a step time > 0")
    if len({p.n for p in points}) < 2 or len({round(p.kv_tokens / p.n, 6) for p in points}) < 2:
        raise ValueError(
            "cost model fit: the grid must vary both the batch n and the context per request "
            "(K / n), or a_k and o_k cannot be told apart"
        )


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x b - y|^2 over b >= 0, for a few columns: the best of the per-support least squares whose
    solution is non-negative (the optimum is one of them)."""
    cols = x.shape[1]
    best, best_err = np.zeros(cols), float(np.sum(y**2))
    for k in range(1, cols + 1):
        for support in itertools.combinations(range(cols), k):
            b_s, *_ = np.linalg.lstsq(x[:, support], y, rcond=None)
            if np.any(b_s < 0):
                continue
            b = np.zeros(cols)
            b[list(support)] = b_s
            err = float(np.sum((x @ b - y) ** 2))
            if err < best_err:
                best, best_err = b, err
    return best


def _breakpoints(ns: np.ndarray) -> list[float]:
    uniq = np.unique(ns)
    mids = (uniq[:-1] + uniq[1:]) / 2
    grid = np.linspace(uniq[0], uniq[-1], BREAKPOINT_GRID)
    return [0.0] + sorted(set(uniq.tolist()) | set(mids.tolist()) | set(grid.tolist()))


def relative_error(model: CostModel, points: Sequence[ProfilePoint], by_steps: bool = False) -> float:
    """Root-mean-square of (predicted - measured) / measured step time over the points (by_steps: each
    point counted as many times as it has steps)."""
    rel = [(model.step_time(p.n, p.kv_tokens) - p.step_s) / p.step_s for p in points]
    w = [max(p.steps, 1) if by_steps else 1 for p in points]
    return math.sqrt(sum(wi * r * r for wi, r in zip(w, rel)) / sum(w))


def _fit_at(n, k, y, w, n_star: float) -> tuple[float, np.ndarray]:
    """(sum of squared residuals, [c, a_k, o_k]) of the fit with breakpoint `n_star`: relative residuals
    when `w` is None, else absolute ones weighted by `w`."""
    x = np.stack([np.ones_like(n), k, np.maximum(n, n_star)], axis=1)
    if w is None:
        x, target = x / y[:, None], np.ones_like(y)
    else:
        x, target = x * np.sqrt(w)[:, None], y * np.sqrt(w)
    b = _nonnegative_lstsq(x, target)
    return float(np.sum((x @ b - target) ** 2)), b


def fit_cost_model(points: Sequence[ProfilePoint], by_steps: bool = False) -> tuple[CostModel, float]:
    """The least-squares CostModel of `points` and its relative error (see `relative_error`).

    by_steps: each point is the mean of its `steps` decode steps, and the residuals are absolute, weighted
    by them: the least squares of every step, so that the fit keeps the total time of all the steps (what
    a simulation of a traced run needs) instead of treating a rare batch shape like a common one.
    """
    _check(points)
    n = np.array([p.n for p in points], dtype=np.float64)
    k = np.array([p.kv_tokens for p in points], dtype=np.float64)
    y = np.array([p.step_s for p in points], dtype=np.float64)
    w = np.array([max(p.steps, 1) for p in points], dtype=np.float64) if by_steps else None
    candidates = _breakpoints(n)
    for _ in range(REFINEMENTS + 1):
        fits = [(*_fit_at(n, k, y, w, c), c) for c in candidates]
        i = min(range(len(fits)), key=lambda j: fits[j][0])
        # the error is continuous in n*: look closer between the best candidate's neighbours
        lo, hi = candidates[max(i - 1, 0)], candidates[min(i + 1, len(candidates) - 1)]
        best, candidates = fits[i], np.linspace(lo, hi, 33).tolist()
    _, (c, a_k, o_k), n_star = best
    model = CostModel(a_b=0.0, a_k=float(a_k), o_thr=float(c + o_k * n_star), o_b=float(c), o_k=float(o_k))
    return model, relative_error(model, points, by_steps)


def format_table(model: CostModel, points: Sequence[ProfilePoint]) -> str:
    """Measured against fitted step time, one row per point."""
    lines = [f"{'n':>7} {'KV tokens':>10} {'steps':>6} {'measured ms':>12} {'fitted ms':>10} {'error':>7}"]
    for p in sorted(points, key=lambda q: (q.n, q.kv_tokens)):
        fit = model.step_time(p.n, p.kv_tokens)
        lines.append(
            f"{p.n:7.1f} {p.kv_tokens:10.0f} {p.steps:6d} {p.step_s * 1e3:12.3f} {fit * 1e3:10.3f} "
            f"{(fit - p.step_s) / p.step_s:+7.1%}"
        )
    return "\n".join(lines)


# ---- points from a step trace (the embedded server's --step-trace) -------------------------------------
TRACE_CONTEXT_BIN = 32  # tokens of context per sequence (K / n) that one point's steps may differ by
TRACE_MIN_STEPS = 1  # every step counts (the by-steps fit weighs a point by its steps)


def read_step_trace(
    paths: Sequence[str], since: float | None = None, until: float | None = None, kind: str = "decode"
) -> list[dict]:
    """The `kind` rows (decode or prefill) of trace files whose wall-clock end `t` lies in [since, until]. A
    torn last line (a server killed mid-write) is skipped; any other unreadable line is an error naming file
    and line."""

    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                keep = (
                    row["kind"] == kind
                    and (since is None or row["t"] >= since)
                    and (until is None or row["t"] <= until)
                )
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                if i == len(lines):  # no newline after it: the last line, cut short
                    continue
                raise ValueError(f"step trace {path}, line {i}: not a step row ({e})") from None
            if keep:
                rows.append(row)
    return rows


def trace_points(
    rows: Sequence[dict], context_bin: int = TRACE_CONTEXT_BIN, min_steps: int = TRACE_MIN_STEPS
) -> list[ProfilePoint]:
    """Decode-step rows grouped by batch n and context per sequence (K / n, in `context_bin` tokens): one
    ProfilePoint per group of at least `min_steps` steps, with their mean K and step time."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        if r["n"] > 0 and r["s"] > 0:
            groups.setdefault((r["n"], int(r["kv"] / r["n"] // context_bin)), []).append(r)
    return [
        ProfilePoint(
            n=float(n), kv_tokens=sum(r["kv"] for r in g) / len(g), step_s=sum(r["s"] for r in g) / len(g), steps=len(g)
        )
        for (n, _), g in sorted(groups.items())
        if len(g) >= min_steps
    ]


def prefill_cost(rows: Sequence[dict]) -> float:
    """Seconds per prefilled token (CostModel.p_k) of traced prefill rows: their total time over their
    total tokens (0 without any)."""
    tokens = sum(r["tokens"] for r in rows)
    return sum(r["s"] for r in rows) / tokens if tokens else 0.0


def total_time_error(model: CostModel, rows: Sequence[dict]) -> float:
    """(fitted - traced) / traced total seconds over every decode step of `rows`: what a simulation of the
    same steps would be off by."""
    traced = sum(r["s"] for r in rows)
    return (sum(model.step_time(r["n"], r["kv"]) for r in rows) - traced) / traced
