"""Transformer Engine's CUDA modules, stood in for on a machine without TE, so that megatron-core's own
TE spec code (megatron/core/extensions/transformer_engine.py, gpt_layer_specs.py) builds a model whose
state dict and sharded state dict can be inspected and loaded on the CPU. Never run forward.

Only the five module classes a GPTModel's TE spec instantiates are stood in for, with TE's parameter
names (TE 2.x: `weight`, `bias`, `layer_norm_weight`, `layer_norm_bias`, `weight{i}` / `bias{i}` of a
grouped linear) and TE's `_extra_state` (an empty uint8 tensor when FP8 is off); everything else megatron-core
touches in `transformer_engine` is a MagicMock, as megatron-core itself does when TE is missing.
`install()` must run before megatron.core is imported.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from unittest.mock import MagicMock

import torch

TE_VERSION = "2.8.0"


class _TEModule(torch.nn.Module):
    """TE's TransformerEngineBaseModule as far as checkpoints see it: FP8 off, extra state empty."""

    def __init__(self):
        super().__init__()
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        pass  # FP8 off: nothing to set up

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # TE 2.x without FP8 (module/base.py)

    def set_extra_state(self, state) -> None:
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            raise AssertionError("the stand-in holds no FP8 state")


def _split(in_features, out_features, parallel_mode, tp_size):
    tp_size = tp_size or 1
    if parallel_mode == "column":
        return in_features, out_features // tp_size
    if parallel_mode == "row":
        return in_features // tp_size, out_features
    return in_features, out_features


class Linear(_TEModule):
    def __init__(self, in_features, out_features, *, bias=True, parallel_mode=None, tp_size=1, **_):
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.parallel_mode, self.tp_size = parallel_mode, tp_size
        i, o = _split(in_features, out_features, parallel_mode, tp_size)
        self.weight = torch.nn.Parameter(torch.empty(o, i))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(o))


class LayerNormLinear(Linear):
    def __init__(self, in_features, out_features, *, normalization="LayerNorm", **kw):
        super().__init__(in_features, out_features, **kw)
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(in_features))
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.empty(in_features))


class GroupedLinear(_TEModule):
    def __init__(self, num_gemms, in_features, out_features, *, bias=True, parallel_mode=None, tp_size=1, **_):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features, self.use_bias = num_gemms, in_features, out_features, bias
        self.parallel_mode, self.tp_size = parallel_mode, tp_size
        i, o = _split(in_features, out_features, parallel_mode, tp_size)
        for g in range(num_gemms):
            self.register_parameter(f"weight{g}", torch.nn.Parameter(torch.empty(o, i)))
            if bias:
                self.register_parameter(f"bias{g}", torch.nn.Parameter(torch.empty(o)))


class DotProductAttention(_TEModule):
    def __init__(self, *args, **kwargs):
        super().__init__()


class RMSNorm(torch.nn.Module):
    # TE's signature: `normalized_shape` (megatron-core 0.19 passes it), `hidden_size` its older name (0.16.1)
    def __init__(self, normalized_shape=None, eps=1e-5, hidden_size=None, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape if hidden_size is None else hidden_size))


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `transformer_engine` and any submodule of it to the stand-in's attribute of that name."""

    def __init__(self, te):
        self.te = te

    def find_spec(self, name, path, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        module = self.te
        for part in spec.name.split(".")[1:]:
            module = getattr(module, part)
        module.__path__ = []  # a package: its submodules import too
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """Register the stand-in as `transformer_engine` (call before importing megatron.core)."""
    if "megatron.core" in sys.modules:
        raise RuntimeError("te_stub.install() must run before megatron.core is imported")
    te = MagicMock(name="transformer_engine")
    te.__version__ = TE_VERSION
    te.pytorch.Linear, te.pytorch.LayerNormLinear, te.pytorch.GroupedLinear = Linear, LayerNormLinear, GroupedLinear
    te.pytorch.DotProductAttention, te.pytorch.RMSNorm = DotProductAttention, RMSNorm
    te.pytorch.cpu_offload.get_cpu_offload_context.return_value = (contextlib.nullcontext(), None)  # offload off
    for quantized in ("QuantizedTensor", "mxfp8_tensor.MXFP8Tensor", "float8_tensor.Float8Tensor"):
        module = te.pytorch.tensor
        for part in quantized.split(".")[:-1]:
            module = getattr(module, part)
        setattr(module, quantized.rsplit(".", 1)[-1], type(quantized, (torch.Tensor,), {}))  # no tensor is FP8
    sys.meta_path.insert(0, _StandInFinder(te))
