"""A Hugging Face Qwen3-MoE forward forced to route as a batch's `routed_experts` say (the test reference of
rollout routing replay): each MoE gate takes the given expert ids instead of its own top-k, with gate values
computed by HF's own code path (softmax over all experts, gathered at the ids, renormalised when
norm_topk_prob). A sequence's last token has no given row; it keeps its own routing (it reaches no scored
logprob)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def moe_gates(model) -> list:
    """The HF model's MoE gates in layer order (the samples' MoE-layer axis)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


class Forcing:
    """`use(row)`: the next forward (one sequence, batch 1) routes as `routed_experts[row]`; `agree` /
    `compared` count the given token-layer top-k sets the gate's own top-k equals (its own inputs)."""

    def __init__(self, routed_experts):
        self.routed_experts = routed_experts
        self.ids = None
        self.agree = self.compared = 0

    def use(self, row: int) -> None:
        self.ids = None if self.routed_experts is None else self.routed_experts[row]


@contextlib.contextmanager
def forced_routing(model, batch):
    """Yields a `Forcing` for `batch`; a no-op when the batch carries no routing."""
    given = Forcing(batch.routed_experts)
    if batch.routed_experts is None:
        yield given
        return
    gates = moe_gates(model)

    def forced(j, gate):
        def forward(hidden_states):
            h = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(h, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            rows = given.ids[:, j].long()
            same = (own[: rows.shape[0]].sort(dim=1).values == rows.sort(dim=1).values).all(dim=1)
            given.agree += int(same.sum())
            given.compared += rows.shape[0]
            ids = torch.cat([rows, own[rows.shape[0] :]])
            value = probs.gather(1, ids)
            if gate.norm_topk_prob:
                value = value / value.sum(dim=-1, keepdim=True)
            return logits, value.to(logits.dtype), ids

        return forward

    for j, gate in enumerate(gates):
        gate.forward = forced(j, gate)
    try:
        yield given
    finally:
        for gate in gates:
            del gate.forward


def random_routing(batch, num_moe_layers: int, num_experts: int, top_k: int, seed: int) -> list[torch.Tensor]:
    """Random distinct top-k expert ids per (token - 1, MoE layer), uint8 as samples carry them: routing
    the trainer's own router would almost never choose, so only a replay can match a forced reference."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for seq in batch.input_ids:
        scores = torch.rand(len(seq) - 1, num_moe_layers, num_experts, generator=g)
        out.append(scores.topk(top_k, dim=-1).indices.to(torch.uint8))
    return out
