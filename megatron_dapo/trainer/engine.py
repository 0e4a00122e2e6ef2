"""The training engine a `DapoStep` runs on (trainer/dapo_step.py): one rank's model, optimizer and
parallel layout, behind the few calls the DAPO step makes. `MegatronEngine` (trainer/megatron_engine.py)
and `FSDPEngine` (trainer/fsdp_engine.py) implement it; docs/training.md tells what each does.

The step packs micro-batches by the engine's `packing` rules and hands them to `forward_backward` with a
loss function; the engine runs the forward (its pipeline schedule, its LM head, its context-parallel
gather), turns the output into per-position logprobs of the packed row and calls

    loss_fn(mb, logprobs, entropy)     # [1, L] fp32-castable each (entropy None unless asked for)

which returns this micro-batch's exact share of the mini-batch loss (a scalar tensor; ignored when
`forward_only`). Summed over the micro-batches and the data-parallel ranks' mean, the engine's
backward gives the gradients of the whole mini-batch as one batch on one process.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch

from megatron_dapo.models import QwenArch
from megatron_dapo.runtime.layout import ParallelLayout
from megatron_dapo.trainer.packing import PackedMicroBatch, PackingRules
from megatron_dapo.trainer.routing_replay import RoutingReplay

LossFn = Callable[[PackedMicroBatch, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


class TrainEngine(Protocol):
    layout: ParallelLayout
    arch: QwenArch
    packing: PackingRules
    replay: RoutingReplay | None  # rollout routing replay (R3); None where the engine replays no routing

    def forward_backward(
        self,
        packs: list[PackedMicroBatch],
        loss_fn: LossFn,
        forward_only: bool,
        temperature: float,
        with_entropy: bool,
        batch=None,
    ) -> None:
        """Forward (and, unless `forward_only`, backward, gradients accumulating) of every micro-batch.
        `batch`: the RolloutBatch they were packed from, whose routed experts the engine replays if it
        does. Forward-only passes run in eval mode. Collective."""
        ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
        """Clip and step (then the lr schedule) unless the loss or the gradient norm is non-finite, in
        which case the gradients are dropped. Returns (stepped, grad norm). Collective."""
        ...

    def current_lr(self) -> float:
        """The lr the next optimizer step applies."""
        ...

    def save_checkpoint(self, path: str, extra: dict) -> None:
        """Model, optimizer and lr schedule (and `extra`, a dict of plain values) under `path`. Collective."""
        ...

    def load_checkpoint(self, path: str, extra: dict) -> dict:
        """Load what save_checkpoint wrote; returns its `extra` (`extra` here: the keys to read). Collective."""
        ...

    def export_hf_weights(self, byte_budget: int | None = None, dst_rank=0) -> Iterator:
        """`(hf_name, full tensor or None)` of every HF tensor: full on `dst_rank` (None: every rank;
        bridge.EACH_SOURCE: the rank that rebuilds it). Collective: every rank iterates to the end."""
        ...

    def export_sources(self) -> list[int]:
        """The ranks that rebuild HF tensors in an export, ascending. Collective."""
        ...

    def offload(self, what=None) -> dict[str, int]:
        """Move `what` (a subset of {"params", "grads", "optimizer"}; None: all three) off the device,
        freeing its storage (colocated placement; trainer/offload.py tells how). Returns the device bytes
        freed per part. Gradients are freed, not kept (they come back as zeros). Calls that need an
        offloaded part raise errors.EngineOffloadedError until `reload`. Local (not collective)."""
        ...

    def reload(self, what=None) -> dict[str, int]:
        """Bring back what `offload` moved (`what` as there; None: all offloaded parts), bitwise. Returns the
        device bytes reallocated per part. Local (not collective)."""
        ...
