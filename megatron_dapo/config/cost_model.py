"""The decode-step cost model of a rollout engine (PSRL / StaleFlow's), used by routing and the simulator.

One decode step of an engine holding n running requests and K resident KV tokens takes

    L(n, K) = a_b + a_k * K + max(o_thr, o_b + o_k * n)      (seconds)

(attention cost grows with the KV tokens read; the rest of the forward is flat until the batch is
large enough to be compute bound), and the engine then produces n tokens: throughput T = n / L.
Prefilling P tokens (admitting a request, or re-admitting a retracted or resumed one) takes p_k * P
seconds, during which nothing decodes; routing's gain rule ignores it (as PSRL's does), the simulated
engines pay it. Coefficients are per model and parallel layout; `megatron-dapo profile-engine`
measures a server and fits the decode ones (live) or all of them from a server's step trace
(`--from-trace`), and writes the JSON that `CostModel.load` reads (p_k may be absent: prefill free).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    a_b: float  # s, per step, independent of the batch
    a_k: float  # s per resident KV token
    o_thr: float  # s, floor of the batch-dependent part (memory bound)
    o_b: float  # s
    o_k: float  # s per running request
    p_k: float = 0.0  # s per prefilled token (optional in files)

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"cost model: {f.name} must be a finite number >= 0, got {v!r}")
        if self.step_time(1, 0) <= 0:
            raise ValueError("cost model: a step of one request must take some time (all coefficients are 0)")

    def step_time(self, n: int, kv_tokens: float) -> float:
        """Seconds of one decode step with `n` running requests and `kv_tokens` resident KV tokens."""
        return self.a_b + self.a_k * kv_tokens + max(self.o_thr, self.o_b + self.o_k * n)

    def throughput(self, n: int, kv_tokens: float) -> float:
        """Generated tokens per second (0 for an idle engine)."""
        return n / self.step_time(n, kv_tokens) if n > 0 else 0.0

    # ---- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "cost model") -> "CostModel":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object with {[f.name for f in fields(cls)]}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d and n not in OPTIONAL]
        if missing:
            raise ValueError(f"{source}: missing coefficient(s) {missing}")
        try:
            return cls(**{n: d[n] for n in names if n in d})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def save(self, path: str | os.PathLike, **extra) -> None:
        """Write the coefficients (plus `extra` facts such as the fit's error) atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**self.to_dict(), **extra}, indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cost model {path}: {e}") from None
        return cls.from_dict(d, source=f"cost model {path}")


OPTIONAL = ("p_k",)

# PSRL's published decode fit for a 7B model on one GPU (SGLang): a sensible default for simulations.
# PSRL publishes no prefill cost; p_k is the FLOPs estimate 2 * 7.6e9 FLOPs per token at 45% of an
# H100's 989 TFLOP/s (~29k prefill tokens/s).
QWEN_7B_1GPU = CostModel(a_b=2.8e-3, a_k=3.35e-8, o_thr=6.4e-3, o_b=2.7e-3, o_k=0.123e-3, p_k=3.4e-5)
