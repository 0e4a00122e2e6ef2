"""The data that crosses from the coordinator to the trainer, as plain dataclasses (a leaf module: it
imports nothing of the package, so both sides and the simulator can use it).

A `RolloutBatch` has one row per sample, the n samples of a group contiguous, groups in the order
they were taken; a `DPShard` is the rows one data-parallel rank trains on in a step, with the global
counts the loss normalises by; a `StepData` is what trainer rank 0 receives for a step: the shards
and the step's rollout metrics. The coordinator builds them (megatron_dapo.coordinator.batch,
.shards, .service).
"""

from __future__ import annotations

import base64
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class RolloutBatch:
    input_ids: list[list[int]]  # prompt + response tokens
    prompt_lengths: list[int]
    response_lengths: list[int]
    advantages: torch.Tensor  # [N] fp32, group-normalised (GRPO / DAPO)
    rollout_logprobs: list[list[float]]  # [N][response_length]: the servers' logprobs, temperature-scaled
    response_loss_mask: list[int]  # [N] 1 = the response's tokens enter the loss; 0 = overlong-filtered
    token_versions: list[list[int]]  # [N][response_length]: weight version behind each response token
    group_index: torch.Tensor  # [N] int64, 0..num_groups-1
    temperature: float  # sampling temperature: the trainer's logprobs use the same scaling
    step: int  # the trainer step (= weight version) this batch is consumed at
    prompt_indices: list[int]  # dataset index of each group's prompt (for logs and tests)
    # rollout routing replay (R3): per sample the servers' expert ids, [prompt + response - 1, MoE layers,
    # top_k] in RoutingShape.dtype (the last token is never fed to the model); None when replay is off
    routed_experts: list[torch.Tensor] | None = None

    @property
    def num_samples(self) -> int:
        return len(self.input_ids)

    @property
    def num_groups(self) -> int:
        return len(self.prompt_indices)

    def staleness(self) -> list[int]:
        """Versions behind the trainer, per sample (its oldest token)."""
        return [self.step - min(v) if v else 0 for v in self.token_versions]


@dataclass
class DPShard:
    """The rows one data-parallel rank trains on in a step."""

    batch: RolloutBatch  # this rank's rows, in the step batch's order (group_index / prompt_indices global)
    dp_rank: int
    dp_size: int
    mini_batches: list[list[int]]  # rows of `batch` in each mini-batch; the same count on every rank
    mini_batch_counts: list[tuple[int, int]]  # each whole mini-batch's (loss tokens, loss sequences), all ranks


@dataclass
class StepData:
    """What trainer rank 0 receives for one step."""

    shards: list[DPShard]  # one per DP rank
    metrics: dict[str, float]  # the step's rollout metrics (responses, rewards, groups, staleness)
    staleness: Counter = field(default_factory=Counter)  # staleness -> groups
    extra: dict = field(default_factory=dict)  # prompt indices and sample versions, for metrics.jsonl
    tokens: int = 0  # prompt + response tokens of the whole batch


@dataclass(frozen=True)
class RoutingShape:
    """What the rollout servers' routed experts (R3) hold for a MoE model: SGLang answers one row per
    position with `num_layers` (every decoder layer) x `top_k` int32 ids; samples keep the rows of the
    MoE layers only, in the smallest unsigned dtype that holds `num_experts` ids."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return routing_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        return len(self.moe_layers) * self.top_k * self.dtype.itemsize


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest unsigned integer dtype whose values cover expert ids 0..num_experts-1."""
    if num_experts <= 1 << 8:
        return torch.uint8
    if num_experts <= 1 << 16:
        return torch.uint16
    return torch.int32


def routing_to_state(rows: torch.Tensor | None) -> dict | None:
    """Plain JSON data of a sample's routing (checkpoints): dtype, shape and the base64 of its bytes."""
    if rows is None:
        return None
    data = base64.b64encode(rows.contiguous().view(torch.uint8).numpy().tobytes()).decode("ascii")
    return {"dtype": str(rows.dtype).removeprefix("torch."), "shape": list(rows.shape), "data": data}


def routing_from_state(state: dict | None) -> torch.Tensor | None:
    if state is None:
        return None
    raw = torch.frombuffer(bytearray(base64.b64decode(state["data"])), dtype=torch.uint8)
    return raw.view(getattr(torch, state["dtype"])).view(state["shape"]).clone()
