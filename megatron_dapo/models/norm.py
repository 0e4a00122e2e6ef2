"""An RMSNorm for megatron-core's local (non-Transformer-Engine) layer spec that allows sequence parallel.

megatron-core's local spec builds `WrappedTorchNorm`, which refuses `sequence_parallel`; MoE with
TP > 1 requires sequence parallel, so without TE no MoE + TP model could be built. The norm itself
is elementwise over the hidden dimension, so it is correct on a sequence shard as is; what sequence
parallel needs is that the weight's gradient be summed over the TP group, which megatron-core's
`finalize_model_grads` does for every parameter marked `sequence_parallel`.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in fp32 like HF's Qwen3RMSNorm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        device = "cpu" if getattr(config, "use_cpu_initialization", False) else None
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.eps = eps
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # read by megatron-core's grad sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
