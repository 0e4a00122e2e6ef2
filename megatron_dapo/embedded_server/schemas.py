"""Request bodies the embedded server accepts: every field of SGLang 0.5.23's request classes.

Fields are named exactly as in SGLang's request classes (`io_struct.py`, `sampling_params.py`). A
/generate body may carry every field SGLang's `GenerateReqInput` and `SamplingParams` have: those
this server implements are model fields; those that only label or route a request (trace headers,
metric labels, cache-isolation keys with no prefix cache here, `priority` without priority
scheduling, DP rank 0 of one) are accepted and have no effect, as in SGLang under the same setup; the
rest (multimodal data, LoRA, grammars, hidden states, disaggregation...) are accepted only at their
neutral value (`GENERATE_NEUTRAL`, `SAMPLING_NEUTRAL`) and otherwise refused with 400 naming the
field. A field SGLang does not have is refused with 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from megatron_dapo.embedded_server.stops import MAX_STOP_REGEX_COUNT, compile_stop_regex


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- SGLang fields accepted only at their neutral value ------------------------------
# field -> the values that mean "feature off" in SGLang 0.5.23 (a batch may send a list of them)
GENERATE_NEUTRAL: dict[str, tuple] = {
    **dict.fromkeys(
        (
            "session_id",
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "mm_hashes",
            "mm_content_hashes",
            "video_config",
            "watermark",
            "token_ids_logprob",
            "return_sampling_mask",
            "sampling_logprobs_mode",
            "modalities",
            "session_params",
            "lora_path",
            "lora_id",
            "custom_logit_processor",
            "positional_embed_overrides",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "bootstrap_pair_key",
            "decode_tp_size",
            "disagg_prefill_dp_rank",
            "max_thinking_tokens",
            "need_wait_for_mm_inputs",
            "num_items_assigned",
            "encoder_urls",
            "max_dynamic_patch",
            "min_dynamic_patch",
            "image_max_dynamic_patch",
            "video_max_dynamic_patch",
            "images_config",
            "mm_processor_kwargs",
            "multi_item_delimiter_indices",
            "token_indices_to_pool",
            "kv_hints",
        ),
        (None,),
    ),
    **dict.fromkeys(
        (
            "use_audio_in_video",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs",
            "return_flat_raw_top_logprobs_b64",
            "return_hidden_states",
            "return_indexer_topk",
            "background",
            "require_reasoning",
            "return_bytes",
            "return_entropy",
            "return_prompt_token_ids",
        ),
        (None, False),
    ),
}
SAMPLING_NEUTRAL: dict[str, tuple] = {
    "beam_width": (None, 1),
    # SGLang treats an empty grammar as unset
    **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), (None, "")),
    "logit_bias": (None, {}),
    "watermark": (None,),
    # internal SamplingParams fields, filled by SGLang's normalize()
    **dict.fromkeys(("stop_strs", "stop_regex_strs"), (None,)),
    **dict.fromkeys(("stop_str_max_len", "stop_regex_max_len"), (0,)),
    **dict.fromkeys(("is_normalized", "ebnf_full_assistant"), (False,)),
}


def _is_neutral(value, neutral: tuple) -> bool:
    if isinstance(value, list):
        return all(_is_neutral(v, neutral) for v in value)
    return any(type(value) is type(n) and value == n for n in neutral if n is not None) or value is None


def _drop_neutral(data, table: dict[str, tuple]):
    """Remove the table's fields from a raw body after checking each is at its neutral value."""
    if not isinstance(data, dict):
        return data
    for name in [k for k in data if k in table]:
        if not _is_neutral(data[name], table[name]):
            shown = ", ".join(json.dumps(n) for n in table[name])
            raise ValueError(
                f"{name}: not implemented by this server; only {shown} accepted, got {json.dumps(data[name])[:200]}"
            )
        data = {k: v for k, v in data.items() if k != name}
    return data


class SamplingParamsIn(_Strict):
    max_new_tokens: Optional[int] = Field(128, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    temperature: Optional[float] = Field(1.0, ge=0.0)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = -1
    n: Optional[int] = Field(1, ge=1)
    ignore_eos: Optional[bool] = False
    # SGLang's range check; honoured always here (SGLang: only with --enable-deterministic-inference)
    sampling_seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)
    skip_special_tokens: Optional[bool] = True
    spaces_between_special_tokens: Optional[bool] = True
    # the answer text keeps the matched stop string or stop token (SGLang's detokenizer trims it)
    no_stop_trim: Optional[bool] = False

    # ---- SGLang's cheap sampling features: implemented, SGLang's ranges (verify()) ----
    min_p: Optional[float] = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(1.0, gt=0.0, le=2.0)
    min_new_tokens: Optional[int] = Field(0, ge=0)
    stop_regex: Optional[Union[str, list[str]]] = None
    # only changes how a stream is chunked; this server does not stream
    stream_interval: Optional[int] = Field(None, ge=1)
    # read only by a custom logit processor, which this server (like SGLang by default) does not run
    custom_params: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        return _drop_neutral(data, SAMPLING_NEUTRAL)

    @model_validator(mode="after")
    def _min_within_max(self):
        if self.max_new_tokens is not None and (self.min_new_tokens or 0) > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens: must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}"
            )
        return self

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex(cls, v):
        # compiled here, in the request's parsing, so that the engine thread only ever runs RE2 searches
        patterns = [v] if isinstance(v, str) else v or []
        if len(patterns) > MAX_STOP_REGEX_COUNT:
            raise ValueError(f"at most {MAX_STOP_REGEX_COUNT} patterns are allowed, got {len(patterns)}")
        for pattern in patterns:
            compile_stop_regex(pattern)
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v != -1 and v < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {v}")
        return v


class GenerateIn(_Strict):
    # A batch, as in SGLang: input_ids a list of prompts, with one sampling_params dict for all or one
    # per prompt, and one rid per prompt. sampling_params is validated per prompt by the server, so an
    # error names its field as sampling_params[i].field.
    rid: Optional[Union[str, list[str]]] = None
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    return_logprob: Optional[bool] = False
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = Field(None, ge=0)
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False
    log_metrics: bool = True
    # routed experts (R3): served with --enable-return-routed-experts on a MoE model; rows from this position
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)

    # ---- SGLang fields that label or route a request: accepted, no effect here ----
    # SGLang ignores a priority unless started with --enable-priority-scheduling
    priority: Optional[int] = None
    # DP rank to route to; this server is one rank, so only 0 (SGLang: "out of range [0, 1)")
    data_parallel_rank: Optional[int] = Field(None, ge=0, le=0)
    routed_dp_rank: Optional[int] = Field(None, ge=0, le=0)
    # keys that keep requests from sharing prefix-cache entries; no prefix cache outlives a batch here
    extra_key: Optional[Union[str, list[str]]] = None
    cache_salt: Optional[Union[str, list[str]]] = None
    no_logs: bool = False
    custom_labels: Optional[dict[str, str]] = None
    routing_key: Optional[str] = None
    conversation_id: Optional[str] = None
    external_trace_header: Optional[dict[str, Any]] = None
    received_time: Optional[float] = None
    http_worker_ipc: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        return _drop_neutral(data, GENERATE_NEUTRAL)

    @property
    def is_batch(self) -> bool:
        if isinstance(self.text, list):
            return True
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class AbortIn(_Strict):
    rid: Optional[str] = None
    abort_all: bool = False


class PauseIn(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueIn(_Strict):
    torch_empty_cache: bool = True


class MemoryIn(_Strict):
    tags: Optional[list[Literal["weights", "kv_cache"]]] = None


class InitGroupIn(_Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: str = "nccl"


class DestroyGroupIn(_Strict):
    group_name: str = "weight_update_group"


class UpdateDistributedIn(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[Literal["flattened_bucket"]] = None


class UpdateTensorIn(_Strict):
    serialized_named_tensors: list[str]  # base64, one entry per TP rank (this server has one)
    load_format: Optional[Literal["flattened_bucket"]] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class UpdateVersionIn(_Strict):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default for this request


class BeginUpdateIn(_Strict):
    selector: Literal["target", "draft", "all"] = "all"


class EndUpdateIn(_Strict):
    pass
