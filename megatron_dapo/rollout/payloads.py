"""Request bodies for SGLang's HTTP API and the parsing of its /generate and /v1/loads answers (pure functions).

Every body the client sends is built here, so the conformance test can hold each one against the
fields of SGLang 0.5.23's request class (see `protocol.py`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import torch

from megatron_dapo.rollout.types import FINISH_REASONS, Sample, SamplingParams, ServerLoad, WeightVersionSpan
from megatron_dapo.types import RoutingShape

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
ROUTED_DTYPE = torch.int32  # SGLang's routed-experts capture buffer dtype (state_capturer/base.py)


def generate_body(
    input_ids: Sequence[int],
    sampling: SamplingParams | Sequence[SamplingParams],
    rid: str | None = None,
    return_logprob: bool = True,
    logprob_start_len: int | None = None,
    routed_experts_start_len: int | None = None,
) -> dict:
    """One prompt; with a list of sampling params, a batch of that prompt once per entry (SGLang's batch
    form: input_ids and sampling_params as lists, rid `{rid}-{i}` per entry)."""
    ids = [int(t) for t in input_ids]
    if isinstance(sampling, SamplingParams):
        body = {"input_ids": ids, "sampling_params": sampling.to_sglang()}
        if rid is not None:
            body["rid"] = rid
    else:
        body = {"input_ids": [ids] * len(sampling), "sampling_params": [sp.to_sglang() for sp in sampling]}
        if rid is not None:
            body["rid"] = [f"{rid}-{i}" for i in range(len(sampling))]
    body["return_logprob"] = bool(return_logprob)
    if logprob_start_len is not None:
        body["logprob_start_len"] = int(logprob_start_len)
    if routed_experts_start_len is not None:  # routing replay: the rows from this position on
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = int(routed_experts_start_len)
    return body


def fixed_length_body(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """A batch of prompts, each generating exactly `max_new_tokens` tokens (EOS ignored): for timing."""
    return {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": {"max_new_tokens": int(max_new_tokens), "ignore_eos": True, "temperature": 1.0},
        "return_logprob": False,
    }


def abort_body(rid: str | None = None, abort_all: bool = False) -> dict:
    return {"rid": rid or "", "abort_all": bool(abort_all)}


def pause_body(mode: str = "abort") -> dict:
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
    return {"mode": mode}


def continue_body(torch_empty_cache: bool = True) -> dict:
    return {"torch_empty_cache": bool(torch_empty_cache)}


def memory_body(tags: Sequence[str] | None = None) -> dict:
    return {"tags": list(tags)} if tags else {}


def init_group_body(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
) -> dict:
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def begin_update_body(selector: str = "all") -> dict:
    if selector not in ("all", "target", "draft"):
        raise ValueError(f"weight-update selector must be all, target or draft, got {selector!r}")
    return {"selector": selector}


def end_update_body() -> dict:
    return {}


def destroy_group_body(group_name: str = DEFAULT_GROUP) -> dict:
    return {"group_name": group_name}


def update_distributed_body(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str = DEFAULT_GROUP,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | None = None,
    load_format: str | None = None,
) -> dict:
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    body = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [[int(d) for d in s] for s in shapes],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def update_tensor_body(
    serialized_named_tensors: Sequence[bytes],
    load_format: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | None = None,
) -> dict:
    # SGLang's HTTP schema takes the bytes base64-encoded (JSON has no bytes type).
    body = {
        "serialized_named_tensors": [base64.b64encode(b).decode("ascii") for b in serialized_named_tensors],
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
    }
    if load_format is not None:
        body["load_format"] = load_format
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def update_version_body(new_version: str, abort_all_requests: bool = False) -> dict:
    return {"new_version": str(new_version), "abort_all_requests": bool(abort_all_requests)}


def parse_finish_reason(fr) -> tuple[str, int | str | None, str | None]:
    """SGLang encodes finish_reason as {"type": "stop"|"length"|"abort", "matched"/"length"/"message"}."""
    if fr is None:
        raise ValueError("meta_info.finish_reason is null: the request did not finish")
    if isinstance(fr, str):  # be lenient with OpenAI-style strings
        kind, matched, message = fr, None, None
    elif isinstance(fr, dict) and "type" in fr:
        kind, matched, message = fr["type"], fr.get("matched"), fr.get("message")
    else:
        raise ValueError(f"meta_info.finish_reason has an unexpected shape: {fr!r}")
    if kind not in FINISH_REASONS:
        raise ValueError(f"meta_info.finish_reason.type {kind!r} is not one of {FINISH_REASONS}")
    return kind, matched, message


def parse_generate_item(
    item: dict, prompt_ids: Sequence[int], server: str = "", routing: RoutingShape | None = None
) -> Sample:
    """One /generate answer (an element of the list when n > 1) -> Sample; with `routing`, its routed
    experts too (required: a server launched without --enable-return-routed-experts omits them)."""
    try:
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"/generate answer lacks {e} (keys: {sorted(item) if isinstance(item, dict) else item!r})"
        ) from None
    kind, matched, message = parse_finish_reason(meta.get("finish_reason"))
    triples = meta.get("output_token_logprobs") or []
    if triples and len(triples) != len(output_ids):
        raise ValueError(f"/generate answer: {len(triples)} output_token_logprobs for {len(output_ids)} output_ids")
    for (_, tok, *_), out_tok in zip(triples, output_ids):
        if int(tok) != out_tok:
            raise ValueError(f"/generate answer: logprob token {tok} != output token {out_tok}")
    spans = [
        WeightVersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or []
    ]
    return Sample(
        rid=str(meta.get("id", "")),
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        logprobs=[float(t[0]) for t in triples],
        finish_reason=kind,
        weight_version=str(meta.get("weight_version")),
        weight_versions=spans,
        text=item.get("text") or "",
        matched_stop=matched,
        abort_message=message if kind == "abort" else None,
        server=server,
        num_retractions=int(meta.get("num_retractions") or 0),
        routed_experts=None if routing is None else parse_routed_experts(meta, routing, server),
    )


def parse_routed_experts(meta: dict, routing: RoutingShape, server: str = "") -> torch.Tensor:
    """meta_info.routed_experts -> the MoE layers' rows in the compact dtype, [rows, MoE layers, top_k]."""
    text = meta.get("routed_experts")
    if not isinstance(text, str):
        raise ValueError(
            f"{server}/generate answer has no meta_info.routed_experts (algo.routing_replay=rollout needs servers "
            "launched with --enable-return-routed-experts)"
        )
    rows = decode_routed_experts(text, routing.num_layers, routing.top_k)[:, list(routing.moe_layers)]
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < routing.num_experts:
        raise ValueError(f"{server}/generate answer: routed_experts ids outside [0, {routing.num_experts})")
    return rows.to(routing.dtype)


def parse_generate(
    answer, prompt_ids: Sequence[int], server: str = "", routing: RoutingShape | None = None
) -> list[Sample]:
    items = answer if isinstance(answer, list) else [answer]
    samples = [parse_generate_item(it, prompt_ids, server, routing) for it in items]
    for i, s in enumerate(samples):
        s.index = i
    return samples


def parse_input_logprobs(answer) -> list[float]:
    """meta_info.input_token_logprobs -> logprob of prompt token t given tokens < t, for t >= 1.

    SGLang's first triple is (None, token_0, text): the first token has no context.
    """
    item = answer[0] if isinstance(answer, list) else answer
    triples = item["meta_info"].get("input_token_logprobs")
    if triples is None:
        raise ValueError("/generate answer has no meta_info.input_token_logprobs (return_logprob not honoured?)")
    return [float(t[0]) for t in triples if t[0] is not None]


LOAD_FIELDS = {
    "running": "num_running_reqs",
    "waiting": "num_waiting_reqs",
    "kv_tokens": "num_used_tokens",
    "kv_capacity": "max_total_num_tokens",
    "throughput": "gen_throughput",
    "token_usage": "token_usage",
    "max_running_requests": "max_running_requests",
}


def parse_loads(answer, server: str = "") -> ServerLoad:
    """DP rank 0's row of a /v1/loads answer; ValueError naming the missing or malformed field."""
    rows = answer.get("loads") if isinstance(answer, dict) else None
    if not rows or not isinstance(rows[0], dict):
        raise ValueError(f"{server}/v1/loads: no load row in {answer!r:.200}")
    row = rows[0]
    values = {}
    for name, key in LOAD_FIELDS.items():
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{server}/v1/loads: loads[0].{key} must be a number, got {value!r}")
        values[name] = float(value) if name in ("throughput", "token_usage") else int(value)
    moments = row.get("decode_moments")
    if moments is not None and (not isinstance(moments, list) or len(moments) != 6):
        raise ValueError(f"{server}/v1/loads: loads[0].decode_moments must be a list of 6 sums, got {moments!r}")
    return ServerLoad(
        **values,
        decode_moments=tuple(map(float, moments)) if moments else None,
        timestamp=float(row.get("timestamp") or 0.0),
    )


def encode_routed_experts(rows: torch.Tensor) -> str:
    """SGLang's encoding: base64 of the int32 array's bytes (detokenizer_manager._b64_encode_per_request)."""
    return base64.b64encode(rows.to(ROUTED_DTYPE).contiguous().numpy().tobytes()).decode("utf-8")


def decode_routed_experts(text: str, num_layers: int, top_k: int) -> torch.Tensor:
    """The [rows, num_layers, top_k] int32 array of an encoded answer (the inverse of the above)."""
    flat = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=ROUTED_DTYPE)
    if flat.numel() % (num_layers * top_k):
        raise ValueError(f"routed_experts: {flat.numel()} ids are not a whole number of rows of {num_layers}x{top_k}")
    return flat.view(-1, num_layers, top_k)
