"""The embedded engine's load counters, kept as SGLang 0.5.23's scheduler keeps them for `/v1/loads`.

- `decode_moments`: cumulative sums over decode steps, in SGLang's order (`scheduler.py`,
  `_accumulate_decode_moment`): [steps, sum batch, sum step_us, sum batch^2, sum batch*step_us,
  sum generated tokens]. Two reports a while apart give the mean decode step time and batch size of
  what ran in between: what `megatron-dapo profile-engine` measures.
- `total_prefill_uncached_tokens` / `total_prefill_busy_us`: cumulative prefill work.
- `gen_throughput`: generated tokens per second over the recent decode steps (SGLang: over its last
  decode-log window, reset to 0 once no decode step came for `stale_s`).
- `StepTrace` (opt-in, --step-trace): every step's batch, KV tokens and seconds, as JSON lines.

Updated by the engine's worker thread, read by the server's event loop: a lock keeps each read whole.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

GEN_THROUGHPUT_WINDOW_STEPS = 40  # SGLang's default --decode-log-interval
GEN_THROUGHPUT_STALE_S = 30.0  # SGLang's GEN_THROUGHPUT_STALENESS_SECONDS


class LoadStats:
    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        window_steps: int = GEN_THROUGHPUT_WINDOW_STEPS,
        stale_s: float = GEN_THROUGHPUT_STALE_S,
    ):
        self.clock = clock
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._moments = [0.0] * 6
        self._prefill_tokens = 0
        self._prefill_us = 0
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=window_steps)  # (start, end, tokens)

    def decode_step(self, batch_size: int, start: float, end: float, generated: int) -> None:
        """One decode step of `batch_size` sequences ran from `start` to `end` (clock seconds)."""
        step_us = int((end - start) * 1e6)
        with self._lock:
            self._recent.append((start, end, generated))
            if batch_size <= 0 or step_us <= 0:  # as SGLang: such a step is not counted
                return
            b, t, m = float(batch_size), float(step_us), self._moments
            m[0] += 1.0
            m[1] += b
            m[2] += t
            m[3] += b * b
            m[4] += b * t
            m[5] += float(generated)

    def prefill_step(self, uncached_tokens: int, start: float, end: float, generated: int) -> None:
        """A prefill of `uncached_tokens` prompt tokens, which also sampled `generated` first tokens."""
        with self._lock:
            self._prefill_tokens += int(uncached_tokens)
            self._prefill_us += max(0, int((end - start) * 1e6))
            self._recent.append((start, end, generated))

    def gen_throughput(self) -> float:
        """Tokens per second over the recent steps, from the first one's start to now (so it decays while
        idle); 0 once the last step is older than `stale_s`."""
        now = self.clock()
        with self._lock:
            if not self._recent or now - self._recent[-1][1] > self.stale_s:
                return 0.0
            span = now - self._recent[0][0]
            return sum(s[2] for s in self._recent) / span if span > 0 else 0.0

    def decode_moments(self) -> list[float] | None:
        with self._lock:
            return list(self._moments) if self._moments[0] > 0 else None

    def prefill_totals(self) -> tuple[int, int]:
        """(total_prefill_uncached_tokens, total_prefill_busy_us)."""
        with self._lock:
            return self._prefill_tokens, self._prefill_us


class StepTrace:
    """Opt-in trace of the engine's steps (the server's --step-trace PATH): one JSON line per prefill or
    decode step, `{"t": wall-clock end, "kind": "decode"|"prefill", "n": sequences, "kv": resident KV tokens
    before the step, "s": seconds, "tokens": prefilled tokens (prefill only)}`.

    Written by the engine's worker thread after each step. The file is opened line-buffered and in append
    mode, so a killed server leaves every finished line readable (at most the last one torn), and several
    runs of one server can share a file. `megatron-dapo profile-engine --from-trace` fits the cost model
    from it: the decode steps a run actually took, under the run's own load.
    """

    def __init__(self, path: str | os.PathLike, clock: Callable[[], float] = time.time):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self.clock = clock  # wall clock: lines of several servers line up with a benchmark's step times
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the server's life)

    def step(self, kind: str, n: int, kv_tokens: int, seconds: float, prefill_tokens: int = 0) -> None:
        row = {"t": round(self.clock(), 6), "kind": kind, "n": n, "kv": kv_tokens, "s": round(seconds, 7)}
        if kind == "prefill":
            row["tokens"] = prefill_tokens
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
