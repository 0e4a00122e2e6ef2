"""Held-out accuracy as the DAPO paper and verl report it, per data source.

For each prompt, n answers are sampled and judged by the reward function:

    mean@n  the fraction of the n answers that are correct (DAPO's avg@32 on AIME is mean@32)
    best@n  1 if any of the n answers is correct (pass@n on the answers drawn)
    maj@n   whether the most common extracted answer is correct (majority vote; a tie goes to the
            answer drawn first, a response without an answer votes for "no answer")
    greedy  whether the one greedy (temperature 0) answer is correct

and each is averaged over the prompts of a data source. These are verl's definitions
(`process_validation_metrics`, `calc_maj_val`) computed on the n answers drawn: verl reports best@n and
maj@n as bootstrap estimates (resampling n of the n answers with replacement), which is why its best@n
can be below the observed value; here they are exact.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class PromptOutcome:
    """How the answers to one held-out prompt were judged."""

    data_source: str
    accs: tuple[bool, ...]  # the n sampled answers, correct or not
    preds: tuple[str | None, ...]  # their extracted answers; None when the reward extracts none
    greedy_acc: bool | None = None  # the greedy answer; None when not asked for


def mean_at_n(accs: Sequence[bool]) -> float:
    return sum(map(bool, accs)) / len(accs)


def best_at_n(accs: Sequence[bool]) -> float:
    return float(any(accs))


def maj_at_n(preds: Sequence[str | None], accs: Sequence[bool]) -> float:
    """Correctness of the most common answer (ties: the answer drawn first; None is an answer too:
    a failed reward call)."""
    if len(preds) != len(accs) or not preds:
        raise ValueError(f"maj@n needs one answer per judgement, got {len(preds)} answers, {len(accs)} judgements")
    counts = Counter(preds)  # insertion ordered, and max() keeps the first of equal counts
    winner = max(counts, key=counts.__getitem__)
    return float(bool(accs[preds.index(winner)]))


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def validation_metrics(outcomes: Sequence[PromptOutcome], prefix: str = "val") -> dict[str, float]:
    """`{prefix}/{data_source}/acc/{mean@n, best@n, maj@n, greedy}` averaged over each source's prompts.

    maj@n is left out for a source whose reward function extracts no answers (never returns a "pred")."""
    by_source: dict[str, list[PromptOutcome]] = defaultdict(list)
    for o in outcomes:
        by_source[o.data_source].append(o)
    out: dict[str, float] = {}
    for source in sorted(by_source):
        group = by_source[source]
        key = f"{prefix}/{source}/acc"
        sizes = {len(o.accs) for o in group}
        if len(sizes) != 1:
            raise ValueError(f"data source {source!r}: prompts have different sample counts {sorted(sizes)}")
        (n,) = sizes
        if n:
            out[f"{key}/mean@{n}"] = _mean(mean_at_n(o.accs) for o in group)
            out[f"{key}/best@{n}"] = _mean(best_at_n(o.accs) for o in group)
            if any(p is not None for o in group for p in o.preds):
                out[f"{key}/maj@{n}"] = _mean(maj_at_n(o.preds, o.accs) for o in group)
        greedy = [o.greedy_acc for o in group if o.greedy_acc is not None]
        if greedy:
            out[f"{key}/greedy"] = _mean(map(float, greedy))
    return out


def by_source(metrics: dict[str, float], prefix: str = "val") -> dict[str, dict[str, float]]:
    """`{data_source: {"mean@n": ..., "greedy": ...}}` from the flat keys of `validation_metrics`."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if key.startswith(prefix + "/") and "/acc/" in key:
            source, _, name = key.removeprefix(prefix + "/").rpartition("/acc/")
            out.setdefault(source, {})[name] = value
    return out


def format_table(first_column: str, rows: dict[str, dict[str, float | int]]) -> str:
    """A plain-text table: one row per label, one column per key (floats to 3 decimals, '-' if absent)."""
    names = list(dict.fromkeys(n for r in rows.values() for n in r))
    width = max(len(first_column), *(len(label) for label in rows))
    cols = [max(8, len(n)) for n in names]

    def cell(v, w):
        return f"{'-':>{w}}" if v is None else f"{v:>{w}}" if isinstance(v, int) else f"{v:>{w}.3f}"

    lines = [f"{first_column:<{width}}" + "".join(f"  {n:>{w}}" for n, w in zip(names, cols))]
    lines += [
        f"{label:<{width}}" + "".join(f"  {cell(r.get(n), w)}" for n, w in zip(names, cols))
        for label, r in rows.items()
    ]
    return "\n".join(lines)
