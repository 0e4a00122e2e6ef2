"""Request bodies the embedded server accepts: SGLang 0.5.23's fields, the subset it implements.

Fields are named exactly as in SGLang's request classes (`io_struct.py`, `sampling_params.py`); a body
with a field SGLang has but this server does not implement, or a field SGLang does not have, is
refused with 400 naming it, rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    # accepted and meaningless here (no detokenizer-side trimming differences to honour)
    skip_special_tokens: Optional[bool] = True
    spaces_between_special_tokens: Optional[bool] = True
    no_stop_trim: Optional[bool] = False

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
    text: Optional[str] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    return_logprob: Optional[bool] = False
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = Field(None, le=0)
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False
    log_metrics: bool = True

    @property
    def is_batch(self) -> bool:
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
