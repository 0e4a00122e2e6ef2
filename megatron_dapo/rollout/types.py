"""What a rollout request asks for and what comes back: sampling parameters and samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """The sampling parameters this project sends (a subset of SGLang's `SamplingParams`).

    temperature 0 means greedy; top_k -1 means the whole vocabulary; `stop` strings need a tokenizer.
    `sampling_seed` makes the draws a function of (seed, token position): reproducible whatever else the
    server is batching. SGLang honours it only when launched with --enable-deterministic-inference, and
    the n copies of one request share it (identical samples): send n requests with n seeds instead.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    sampling_seed: int | None = None
    ignore_eos: bool = False  # keep generating past EOS (tests that need a request still running)

    def to_sglang(self) -> dict:
        """The `sampling_params` dict of a /generate body (unset optional fields left out)."""
        d = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "n": self.n,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.sampling_seed is not None:
            d["sampling_seed"] = int(self.sampling_seed)
        if self.ignore_eos:
            d["ignore_eos"] = True
        return d


@dataclass
class WeightVersionSpan:
    """Output tokens [start, end) were generated with weights `version`."""

    version: str
    start: int
    end: int


@dataclass
class Sample:
    """One finished generation: the tokens, their rollout logprobs, why it stopped, which weights made it."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # logprob of output_ids[i] under the temperature-scaled distribution
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str  # the server's version when the answer was built
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)  # spans; empty if one version
    text: str = ""
    matched_stop: int | str | None = None
    abort_message: str | None = None
    group_id: str | None = None
    index: int = 0  # position of this sample within its group
    server: str = ""  # base URL of the server that produced it
    num_retractions: int = 0  # times a server retracted it (KV pool full) and prefilled it again
    # routing replay (R3): the expert ids of every position fed to the model (prompt + output - 1 rows),
    # [rows, MoE layers, top_k] in RoutingShape.dtype; None unless asked for
    routed_experts: torch.Tensor | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def versions(self) -> list[str]:
        """Every weight version that produced a token of this sample, oldest first."""
        return [s.version for s in self.weight_versions] or [self.weight_version]


@dataclass(frozen=True)
class ServerLoad:
    """One server's own load report (SGLang's /v1/loads, DP rank 0)."""

    running: int  # requests in the running batch (num_running_reqs)
    waiting: int  # requests queued at the server (num_waiting_reqs)
    kv_tokens: int  # KV tokens in use (num_used_tokens)
    kv_capacity: int  # most KV tokens it can hold (max_total_num_tokens)
    throughput: float  # generated tokens per second, recent (gen_throughput)
    token_usage: float  # kv_tokens / kv_capacity as the server rounds it
    max_running_requests: int
    # cumulative decode counters [steps, sum batch, sum step_us, sum batch^2, sum batch*step_us, sum tokens];
    # None until the first decode step (or from a server that does not report them)
    decode_moments: tuple[float, ...] | None = None
    timestamp: float = 0.0  # the server's clock when it took the snapshot
