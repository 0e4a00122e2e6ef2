"""Optional math-verify backend: symbolic equivalence (`1/2` == `0.5` == `\\frac{1}{2}`).

The `math-verify` package is imported only when this backend is used.
"""

from __future__ import annotations

from megatron_dapo.rewards.math_dapo import ANSWER_RE, TAIL_CHARS


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "reward backend 'math_verify' needs the math-verify package: pip install 'math-verify[antlr4_13_2]'"
        ) from e
    return math_verify


def compute_score(response: str, ground_truth: str) -> dict:
    """+1 when the last `Answer:` line (or, failing that, the response's last boxed / math
    expression) is mathematically equal to the ground truth, else -1."""
    mv = _math_verify()
    tail = response[-TAIL_CHARS:]
    found = ANSWER_RE.findall(tail)
    candidate = found[-1] if found else tail
    gold = mv.parse(f"${ground_truth}$") or mv.parse(str(ground_truth))
    pred = mv.parse(candidate) or mv.parse(f"${candidate}$")
    correct = bool(gold and pred and mv.verify(gold, pred))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": str(pred[-1]) if pred else ""}
