"""Routed-expert capture (SGLang's `--enable-return-routed-experts`, for rollout routing replay, R3).

The expert ids come from the model's own router: a forward hook on each MoE layer's router module
(transformers' `Qwen3MoeTopKRouter`, whose forward returns (logits, top-k weights, top-k indices)) keeps
the indices it computed. Nothing here re-implements routing.

The answer is SGLang 0.5.23's (`state_capturer/routed_experts.py`, `managers/detokenizer_manager.py`):
`meta_info["routed_experts"]` is the base64 of an int32 array [rows, num_hidden_layers, top_k] in
C order, one row per sequence position in `[routed_experts_start_len, seqlen - 1)` (seqlen = prompt +
output tokens; the last token was never fed to the model). Layers are indexed by their decoder-layer
number; a layer without experts keeps zeros, as in SGLang's zero-initialised capture buffer.
"""

from __future__ import annotations

import torch

from megatron_dapo.rollout.payloads import ROUTED_DTYPE


def moe_routers(model) -> dict[int, torch.nn.Module]:
    """Decoder-layer index -> the router module of that layer's experts, for every MoE layer."""
    inner = getattr(model, "model", model)
    routers = {}
    for i, layer in enumerate(getattr(inner, "layers", [])):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            routers[i] = gate
    return routers


class RoutingCapture:
    """Keeps, for the last forward, the top-k expert ids every MoE router chose for every input token."""

    def __init__(self, model):
        routers = moe_routers(model)
        if not routers:
            raise ValueError(
                "--enable-return-routed-experts: the model has no MoE layers, so no routed experts to return"
            )
        self.num_layers = int(model.config.num_hidden_layers)
        self.top_k = int(next(iter(routers.values())).top_k)
        self._chosen: dict[int, torch.Tensor] = {}
        self._hooks = [r.register_forward_hook(self._keeper(i)) for i, r in routers.items()]

    def _keeper(self, layer_id: int):
        def keep(_module, _args, out):
            self._chosen[layer_id] = out[2]  # the router's top-k indices, [tokens, top_k]

        return keep

    def take(self, batch: int, length: int) -> torch.Tensor:
        """The last forward's expert ids, [batch, length, num_layers, top_k] int32 on the CPU; clears them."""
        rows = torch.zeros(batch * length, self.num_layers, self.top_k, dtype=ROUTED_DTYPE)
        for layer_id, chosen in self._chosen.items():
            rows[:, layer_id] = chosen.reshape(batch * length, self.top_k).to("cpu", ROUTED_DTYPE)
        self._chosen = {}
        return rows.view(batch, length, self.num_layers, self.top_k)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
