"""A procedurally generated arithmetic task in the DAPO-Math-17k schema (the CPU demo's data).

Each problem asks for `a + b` or `a - b`; the reference answer is the integer. Responses are
judged by the DAPO math rule, so a correct response ends with the line `Answer: N`. Train and
held-out sets are disjoint by construction (different operand pairs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.data.dataset import write_rows

INSTRUCTION = "Give the last line as Answer: N."


@dataclass(frozen=True)
class ArithmeticTask:
    max_operand: int = 19
    ops: str = "+-"
    seed: int = 0

    def all_problems(self) -> list[tuple[int, str, int]]:
        return [(a, op, b) for op in self.ops for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]

    def split(self, num_test: int) -> tuple[list, list]:
        problems = self.all_problems()
        random.Random(self.seed).shuffle(problems)
        if not 0 < num_test < len(problems):
            raise ValueError(f"num_test={num_test} must be between 1 and {len(problems) - 1}")
        return problems[num_test:], problems[:num_test]


def answer_of(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def question_of(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}=? {INSTRUCTION}"


def response_of(a: int, op: str, b: int) -> str:
    """The reference response (used by the supervised warm start)."""
    return f"Answer: {answer_of(a, op, b)}"


def problem_row(a: int, op: str, b: int, split: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": question_of(a, op, b)}],
        "ability": "arithmetic",
        "reward_model": {"ground_truth": str(answer_of(a, op, b)), "style": "rule"},
        "extra_info": {"split": split, "a": a, "op": op, "b": b},
    }


def write_task(out_dir: str | Path, task: ArithmeticTask, num_test: int) -> tuple[Path, Path]:
    """Write train.jsonl and test.jsonl to `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    train, test = task.split(num_test)
    train_path = write_rows(out_dir / "train.jsonl", (problem_row(*p, "train") for p in train))
    test_path = write_rows(out_dir / "test.jsonl", (problem_row(*p, "test") for p in test))
    return train_path, test_path
