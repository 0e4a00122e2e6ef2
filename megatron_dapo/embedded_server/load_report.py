"""The embedded server's `/v1/loads` rows, shaped as SGLang 0.5.23's `LoadSnapshot` (srt/managers/
load_snapshot.py, served by srt/entrypoints/v1_loads.py) for its one DP rank.

What the fields hold here (SGLang's meaning, this engine's counters):
- num_running_reqs / num_waiting_reqs: requests in the running batch / in the queue;
- num_used_tokens: KV tokens of the running sequences; num_total_tokens (= num_active_tokens): those
  plus the tokens the waiting requests will prefill; num_waiting_uncached_tokens: the latter (no
  prefix cache outlives a batch here);
- max_total_num_tokens: the KV capacity, `--max-total-tokens` (admission and decode keep the running
  sequences within it, retracting as SGLang does), else max_batch sequences of the model's full context;
  token_usage = num_used_tokens / max_total_num_tokens;
- gen_throughput: generated tokens/s over the recent steps; decode_moments and total_prefill_*: the
  cumulative step counters of `load_stats.LoadStats`;
- sections memory, disaggregation (mode "null"), queues; speculative and lora are absent, as in an
  SGLang server without them.
"""

from __future__ import annotations

import time

from megatron_dapo.embedded_server.engine import Engine

SECTIONS = (
    ("memory", "memory"),
    ("speculative", "spec"),
    ("lora", "lora"),
    ("disaggregation", "disagg"),
    ("queues", "queues"),
)  # (row key, include= name), in SGLang's order
VALID_INCLUDE = frozenset({"core", "all"} | {name for _, name in SECTIONS})
PROMETHEUS_PREFIX = {"speculative": "spec", "disaggregation": "disagg"}
GIB = float(1 << 30)


def kv_bytes_per_token(engine: Engine) -> int:
    """Bytes of K and V one token occupies across the model's layers."""
    cfg = engine.model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    elem = next(engine.model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem


def load_row(engine: Engine) -> dict:
    """The full row (every section) of the engine's load now."""
    load = engine.load_report()
    capacity = load.capacity
    usage = load.resident_tokens / capacity if capacity else 0.0
    prefill_tokens, prefill_us = engine.stats.prefill_totals()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
        "num_waiting_uncached_tokens": load.waiting_tokens,
        "num_used_tokens": load.resident_tokens,
        "num_total_tokens": load.resident_tokens + load.waiting_tokens,
        "num_active_tokens": load.resident_tokens + load.waiting_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": engine.max_batch,
        "token_usage": round(usage, 4),
        "gen_throughput": round(engine.stats.gen_throughput(), 2),
        "cache_hit_rate": 0.0,
        # SGLang's formula, with max_running_requests standing for its max_running_requests_under_SLO
        "utilization": round(max(load.running / engine.max_batch, usage / 0.9), 4),
        "total_prefill_uncached_tokens": prefill_tokens,
        "total_prefill_busy_us": prefill_us,
        "decode_moments": engine.stats.decode_moments(),
        "memory": {
            "weight_gb": round(weight_bytes / GIB, 3),
            "kv_cache_gb": round(load.resident_tokens * kv_bytes_per_token(engine) / GIB, 3),
            "graph_gb": 0.0,
            "token_capacity": capacity,
        },
        "disaggregation": {
            "mode": "null",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {
            "waiting": load.waiting,
            "grammar": 0,
            "paused": load.paused,
            "retracted": load.retracted,
            "prealloc_ready": 0,
        },
    }


def parse_include(include: str | None) -> set[str] | None:
    """The sections of an `include=` query (None: all); ValueError with SGLang's message if unknown."""
    if not include:
        return None
    sections = {s.strip() for s in include.split(",")}
    if not sections <= VALID_INCLUDE:
        raise ValueError(
            f"Invalid include sections: {sections - VALID_INCLUDE}. Valid options: {sorted(VALID_INCLUDE)}"
        )
    return sections


def select(row: dict, include: set[str] | None) -> dict:
    """`row` with the sections `include` asks for (the core fields always)."""
    section_keys = {key for key, _ in SECTIONS}
    out = {k: v for k, v in row.items() if k not in section_keys}
    if include == {"core"}:
        return out
    every = include is None or "all" in include
    for key, name in SECTIONS:
        if row.get(key) is not None and (every or name in include):
            out[key] = row[key]
    return out


def prometheus_text(rows: list[dict]) -> str:
    """Rows (already selected) as Prometheus gauges: one metric per field, one sample per DP rank."""
    samples: dict[str, list] = {}
    for row in rows:
        rank = row["dp_rank"]
        for key, value in row.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                prefix = PROMETHEUS_PREFIX.get(key, key)
                for sub, v in value.items():
                    if isinstance(v, (int, float)):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, v))
            elif isinstance(value, (int, float)):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values]
    return "\n".join(lines) + "\n"
