"""Rollout routing replay (R3) in the Megatron actor: megatron-core 0.16.1's own RouterReplay, fed the
rollout servers' expert ids (`RolloutBatch.routed_experts`) for every token a rank's routers see.

The model is built with `moe_enable_routing_replay`, so each TopKRouter holds a `RouterReplay`. Per
micro-batch and model chunk, `RoutingReplay.feed` hands every local router its layer's rows of the
packed micro-batch (the chunk's own MoE layers: pipeline stages and virtual chunks get only theirs),
cut to this rank's tokens (the sequence-parallel slice when the MoE layer's input is scattered over
TP) and sets REPLAY_FORWARD; `after_forward` switches to REPLAY_BACKWARD, so activation recompute
during backward pops the same rows again, oldest first (pipeline schedules run each chunk's
backwards in the order of its forwards).

A sample's routing has one row fewer than its tokens: the rollout engine never fed its last token.
That token predicts nothing that is scored and, through causal attention, reaches no other token, so
its row cannot change a logprob or a policy gradient; it gets a filler row, like padding: experts
(position + i) mod E for i < top_k, spread so that fillers do not pile onto one expert rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_dapo.bridge.parallel import unwrap_model
from megatron_dapo.types import RoutingShape


def routing_shape_of(arch) -> RoutingShape:
    """The RoutingShape of a QwenArch with routed experts (its MoE layers in order)."""
    layers = tuple(i for i, moe in enumerate(arch.moe_layers) if moe)
    return RoutingShape(arch.num_layers, layers, arch.moe_topk, arch.num_experts)


def filler_rows(positions: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """[len(positions), top_k] int64 distinct expert ids (position + i) mod E."""
    return (positions[:, None] + torch.arange(top_k)) % num_experts


def packed_routing(batch, mb, shape: RoutingShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed micro-batch's expert ids [L, MoE layers, top_k] int64 in packed token order, and a
    [L] bool mask of the rows that came from the rollout (the others are filler rows)."""
    n_layers, k = len(shape.moe_layers), shape.top_k
    rows = filler_rows(torch.arange(mb.length), shape.num_experts, k)[:, None, :].repeat(1, n_layers, 1)
    from_rollout = torch.zeros(mb.length, dtype=torch.bool)
    for i, r in enumerate(mb.rows):
        start, n = int(mb.cu_seqlens[i]), len(batch.input_ids[r])
        routed = batch.routed_experts[r]
        if tuple(routed.shape) != (n - 1, n_layers, k):
            raise ValueError(
                f"RolloutBatch.routed_experts row {r}: shape {tuple(routed.shape)}, expected "
                f"({n - 1}, {n_layers}, {k}) = (tokens - 1, MoE layers, top_k)"
            )
        rows[start : start + n - 1] = routed.to(torch.int64)
        from_rollout[start : start + n - 1] = True
    if int(rows.max()) >= shape.num_experts:
        raise ValueError(f"RolloutBatch.routed_experts holds expert ids >= num_experts={shape.num_experts}")
    return rows, from_rollout


def local_slice(length: int, tp_rank: int, tp_size: int, sequence_parallel: bool) -> slice:
    """The packed positions this rank's routers see: with sequence parallelism the MoE layer's input is
    the rank's contiguous 1/tp of the row; otherwise every TP rank routes the whole row."""
    if not sequence_parallel or tp_size == 1:
        return slice(0, length)
    per = length // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


@dataclass
class _Router:
    module: torch.nn.Module  # a TopKRouter built with moe_enable_routing_replay
    moe_index: int  # its layer's position on the samples' MoE-layer axis


class RoutingReplay:
    """The actor's replay state: which routers each model chunk holds, and the step's counters."""

    def __init__(self, chunks, shape: RoutingShape, tp_rank: int, tp_size: int, sequence_parallel: bool):
        self.shape = shape
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.routers = {id(c): self._routers_of(c) for c in chunks}
        self.bytes_fed = 0
        self.agree = self.compared = 0
        self._scored: torch.Tensor | None = None  # the current micro-batch's rollout-row mask (local)

    def _routers_of(self, chunk) -> list[_Router]:
        out = []
        for module in unwrap_model(chunk).modules():
            if getattr(module, "router_replay", None) is None:
                continue
            layer = module.layer_number - 1  # megatron-core's layer numbers are global and 1-based
            if layer not in self.shape.moe_layers:
                raise ValueError(f"router of layer {layer} is not one of the MoE layers {self.shape.moe_layers}")
            out.append(_Router(module, self.shape.moe_layers.index(layer)))
        return out

    def feed(self, chunk, batch, mb, part=None) -> None:
        """Give the chunk's routers this micro-batch's rows (this rank's tokens: its context-parallel
        `part`, then its sequence-parallel slice) and replay them."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows, from_rollout = packed_routing(batch, mb, self.shape)
        if part is not None:  # the load-balanced CP layout: this rank's packed positions, in its order
            rows, from_rollout = rows[part.index], from_rollout[part.index]
        cut = local_slice(rows.shape[0], self.tp_rank, self.tp_size, self.sequence_parallel)
        rows, self._scored = rows[cut], from_rollout[cut]
        for r in self.routers[id(chunk)]:
            ids = rows[:, r.moe_index].contiguous()
            r.module.router_replay.set_target_indices(ids)
            r.module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self.bytes_fed += ids.numel() * ids.element_size()

    def after_forward(self, chunk) -> None:
        """The chunk's forward is done: a recompute in its backward replays the stored rows in order."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers[id(chunk)]:
            r.module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def clear(self) -> None:
        """Drop every stored row and action (after a forward-only pass or a whole schedule)."""
        for routers in self.routers.values():
            for r in routers:
                r.module.router_replay.clear_indices()
                r.module.router_replay.clear_router_replay_action()

    @contextlib.contextmanager
    def measuring_agreement(self):
        """Inside this block each replayed router also routes the same input itself (RECORD): counts of
        token-layer top-k sets where its own choice equals the rollout's, over rollout rows only."""
        hooks = [r.module.register_forward_hook(self._compare) for rs in self.routers.values() for r in rs]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    @torch.no_grad()
    def _compare(self, module, args, _output) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = module.router_replay
        replayed = replay.target_topk_idx
        replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            module.routing(module.gating(args[0]))
        finally:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        own = replay.get_recorded_indices().to(replayed.device)
        same = (own.sort(dim=1).values == replayed.sort(dim=1).values).all(dim=1)
        scored = self._scored.to(same.device)
        self.agree += int((same & scored).sum())
        self.compared += int(scored.sum())

    def take_metrics(self) -> dict[str, float]:
        """This rank's counters since the last call (summed over ranks by the caller), then reset."""
        out = {"bytes": float(self.bytes_fed), "agree": float(self.agree), "compared": float(self.compared)}
        self.bytes_fed = self.agree = self.compared = 0
        return out
