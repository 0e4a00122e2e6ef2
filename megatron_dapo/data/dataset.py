"""Prompt datasets in the DAPO-Math-17k schema.

A row has `prompt` (a list of chat messages `{"role", "content"}`), `reward_model.ground_truth`
(the reference answer) and `data_source` (which reward function judges it). Files are parquet
or jsonl. Rows are validated when loaded (a bad row names its file and row number), rendered
through the tokenizer's chat template; a prompt longer than the limit is dropped, refused or cut
(`truncation`, verl's RLHFDataset options); `num_dropped_too_long` / `num_truncated` count them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable


class DatasetError(ValueError):
    """A dataset file or row that cannot be used (the message names the file and row)."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, tokenized and ready to submit for rollout."""

    index: int  # row index in the dataset after filtering; stable across runs with the same files
    prompt_ids: tuple[int, ...]
    ground_truth: str
    data_source: str
    messages: tuple[dict, ...] = field(repr=False, default=())
    extra_info: dict = field(repr=False, default_factory=dict)


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a parquet or jsonl file as dicts."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # truncated or not parquet (pyarrow's errors derive from these)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DatasetError(f"{path}: not a readable parquet file ({reason[:200]})") from None
    if suffix in (".jsonl", ".json"):
        rows = []
        with path.open("rb") as f:
            for lineno, raw in enumerate(f):
                where = f"{path}: row {len(rows)} (line {lineno + 1})"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{where} is not UTF-8 text (byte {e.start} of the line: {e.reason})") from None
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except (json.JSONDecodeError, RecursionError) as e:
                    raise DatasetError(f"{where} is not valid JSON: {str(e) or type(e).__name__}") from None
        return rows
    raise DatasetError(f"dataset file {path}: unsupported format {suffix!r} (expected .parquet or .jsonl)")


def write_rows(path: str | Path, rows: Iterable[dict]) -> Path:
    """Write rows as jsonl or parquet (by suffix), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    rows = list(rows)
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def validate_row(row: Any, where: str, prompt_key: str = "prompt") -> tuple[list[dict], str, str]:
    """(messages, ground_truth, data_source) of a row, or DatasetError naming `where` and the field."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    messages = row.get(prompt_key)
    if isinstance(messages, str):  # a bare string prompt is one user message
        messages = [{"role": "user", "content": messages}]
    if not messages or not isinstance(messages, (list, tuple)):
        raise DatasetError(f"{where}: field {prompt_key!r} is missing or empty (expected a list of chat messages)")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: {prompt_key}[{j}] must be {{'role': str, 'content': str}}, got {m!r}")
    reward_model = row.get("reward_model")
    gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if gt is None or (isinstance(gt, str) and not gt.strip()):
        raise DatasetError(f"{where}: field 'reward_model.ground_truth' is missing or empty")
    if isinstance(gt, (list, tuple)):
        gt = gt[0] if len(gt) == 1 else json.dumps(list(gt))
    data_source = row.get("data_source") or "math_dapo"
    return [dict(m) for m in messages], str(gt), str(data_source)


class PromptDataset:
    """Validated, tokenized prompts from one or more files, filtered by prompt length.

    `tokenizer` is a Hugging Face tokenizer with a chat template; each prompt is rendered with
    `add_generation_prompt=True` so generation starts at the assistant's turn. `prompt_key` is
    the column of the chat messages; `truncation` handles prompts over `max_prompt_length`
    (see `TRUNCATION_MODES`).
    """

    def __init__(
        self,
        paths: str | Path | Iterable[str | Path],
        tokenizer,
        max_prompt_length: int | None = None,
        truncation: str = "drop",
        prompt_key: str = "prompt",
    ):
        if truncation not in TRUNCATION_MODES:
            raise DatasetError(f"truncation={truncation!r}: expected one of {TRUNCATION_MODES}")
        if isinstance(paths, (str, Path)):
            paths = [paths]
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise DatasetError("no dataset files given")
        self.max_prompt_length = max_prompt_length
        self.num_rows = 0
        self.num_dropped_too_long = 0
        self.num_truncated = 0
        self.records: list[PromptRecord] = []
        for path in self.paths:
            for i, row in enumerate(read_rows(path)):
                self.num_rows += 1
                messages, gt, source = validate_row(row, f"{path}: row {i}", prompt_key)
                ids = encode_chat(tokenizer, messages)
                if max_prompt_length is not None and len(ids) > max_prompt_length:
                    if truncation == "drop":
                        self.num_dropped_too_long += 1
                        continue
                    if truncation == "error":
                        raise DatasetError(
                            f"{path}: row {i}: prompt has {len(ids)} tokens, more than "
                            f"max_prompt_length={max_prompt_length} (data.truncation=error)"
                        )
                    ids = truncate(ids, max_prompt_length, truncation)
                    self.num_truncated += 1
                extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
                self.records.append(
                    PromptRecord(len(self.records), tuple(ids), gt, source, tuple(messages), dict(extra))
                )
        if not self.records:
            names = ", ".join(map(str, self.paths))
            if self.num_rows == 0:
                raise DatasetError(f"dataset {names} is empty (no rows)")
            raise DatasetError(
                f"dataset {names}: all {self.num_rows} rows were dropped because their prompts are longer "
                f"than max_prompt_length={max_prompt_length} tokens"
            )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


TRUNCATION_MODES = ("drop", "error", "left", "right", "middle")


def truncate(ids: list[int], max_length: int, mode: str) -> list[int]:
    """The first (`right`: cut on the right), last (`left`) or first and last halves (`middle`) of
    `ids`, max_length tokens in all: verl's RLHFDataset truncation of an overlong prompt."""
    if len(ids) <= max_length:
        return list(ids)
    if mode == "right":
        return list(ids[:max_length])
    if mode == "left":
        return list(ids[len(ids) - max_length :])
    if mode == "middle":
        head = max_length // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_length - head) :])
    raise ValueError(f"truncate: mode={mode!r}, expected left, right or middle")


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ready for the assistant turn."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return list(out)


class PromptSampler:
    """Endless, deterministic stream of dataset indices: a fresh seeded permutation per epoch.

    The position (epoch, offset) is the whole state, so a resumed run draws exactly the prompts
    the interrupted run would have drawn next.
    """

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True):
        if size <= 0:
            raise DatasetError("cannot sample from an empty dataset")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import numpy as np

        if not self.shuffle:
            return list(range(self.size))
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.size).tolist()

    def next(self) -> int:
        if self.offset >= self.size:
            self.epoch += 1
            self.offset = 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.offset]
        self.offset += 1
        return i

    def next_draw(self) -> tuple[int, int]:
        """(dataset index, draw number): the draw number counts draws from the start of the stream, so
        it names this draw across epochs and resumes (a prompt drawn again in a later epoch gets another)."""
        i = self.next()
        return i, self.epoch * self.size + self.offset - 1

    def take(self, n: int) -> list[int]:
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "size": self.size,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise DatasetError(
                f"sampler state is for a dataset of {state['size']} prompts (seed {state['seed']}, shuffle "
                f"{state['shuffle']}), this one has {self.size} (seed {self.seed}, shuffle {self.shuffle})"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)
