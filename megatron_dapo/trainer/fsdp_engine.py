"""The FSDP2 training engine (trainer/engine.py's TrainEngine): a Hugging Face model sharded with torch's
`fully_shard` over all trainer ranks (data parallel only; `trainer.backend: fsdp2`), torch AdamW on the
shards, `clip_grad_norm_` on DTensor gradients, megatron-core's lr schedule (`OptimizerParamScheduler`
drives any optimizer's param groups, so warm-up and decay are the Megatron engine's to the step) and
DCP checkpoints.

Packing: each micro-batch is one row of sequences back to back, with per-sequence position ids
and no attention mask; transformers 5 then builds the block-diagonal causal mask from the
position ids itself (masking_utils.find_packed_sequence_indices), so sequences never attend to
one another (checked against one-sequence-at-a-time HF forwards in tests/workers/fsdp_checks.py).
Every rank runs the same number of micro-batches (FSDP's all-gathers are collective); a rank
with fewer rows runs all-padding ones that contribute zero loss.

Gradients: FSDP2 reduce-scatters the *mean* over ranks, like DDP, and the DAPO loss carries the
data-parallel factor, so the gradients equal those of the whole mini-batch on one process.
"""

from __future__ import annotations

import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_dapo.bridge.export import EACH_SOURCE
from megatron_dapo.kernels.backend import vocab_parallel_logprobs
from megatron_dapo.models import QwenArch
from megatron_dapo.runtime.layout import ParallelLayout
from megatron_dapo.trainer.engine import LossFn
from megatron_dapo.trainer.lr_schedule import build_lr_scheduler
from megatron_dapo.trainer.offload import DeviceOffload, optimizer_tensors
from megatron_dapo.trainer.packing import PackedMicroBatch, PackingRules

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_config(cfg, arch: QwenArch) -> None:
    """What this engine cannot run, refused by name (config validation says the same earlier)."""
    bad = [
        f"parallel.{n}={getattr(cfg.parallel, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(cfg.parallel, n) != 1
    ]
    if bad:
        raise ValueError(f"trainer.backend=fsdp2 shards over data parallel only; set {', '.join(bad)} to 1")
    if cfg.optimizer.cpu_offload:
        raise ValueError(
            "optimizer.cpu_offload=true needs trainer.backend=megatron (megatron-core's HybridDeviceOptimizer); "
            "trainer.backend=fsdp2 steps torch AdamW on its own shards"
        )
    if arch.is_moe and cfg.algo.routing_replay != "none":
        raise ValueError(
            "trainer.backend=fsdp2 does not replay the rollout's routing (algo.routing_replay=rollout, the "
            "default for an MoE model): use trainer.backend=megatron, or set algo.routing_replay=none"
        )


def checkpoint_names(model: torch.nn.Module) -> list[tuple[str, str, tuple]]:
    """(checkpoint name, in-memory parameter name, view geometry) of every tensor the HF checkpoint holds.

    The mapping is the embedded rollout server's weight loader's (fused transformers-5 experts
    split per expert); a view's size / stride / offset say where in the full parameter it lies.
    """
    from megatron_dapo.bridge.hf_loader import HFWeightLoader

    loader = HFWeightLoader(model)
    unique = {n for n, _ in model.named_parameters()}  # tied weights once, under the first name
    out = []
    for name in loader.checkpoint_shapes():
        view, mem = loader.target(name)
        if mem not in unique:
            continue
        base = loader.params[mem]
        geometry = (tuple(view.shape), tuple(view.stride()), view.storage_offset() - base.storage_offset())
        out.append((name, mem, geometry))
    return out


def shard_model(model: torch.nn.Module, dtype: str, device: torch.device) -> None:
    """fully_shard each decoder layer, then the whole model, over every rank. fp32 master weights;
    with bf16 / fp16 the forward and backward run in that dtype and gradients are reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = _DTYPES[dtype]
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute != torch.float32 else None
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def build_adamw(model: torch.nn.Module, o) -> torch.optim.AdamW:
    """torch AdamW over the model's shards; as megatron-core, no weight decay on biases and norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "wd_mult": 0.0},
        ],
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
    )


class FSDPEngine:
    replay = None  # routing replay is the Megatron engine's only (check_config refuses it here)
    packing = PackingRules()  # no sequence, context or pipeline parallelism

    def __init__(self, cfg, hf_dir: str | None = None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        hf_dir = hf_dir or cfg.model.hf_path or None
        if not hf_dir:
            raise ValueError("model.hf_path is required to build the FSDP2 actor's model")
        self.arch = QwenArch.from_hf(hf_dir)
        check_config(cfg, self.arch)
        if not dist.is_initialized():
            raise RuntimeError("FSDPEngine needs torch.distributed initialised (runtime.distributed.init_distributed)")
        self.layout = ParallelLayout.data_parallel_only()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.module = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(self.device)
        if cfg.model.recompute_granularity != "none":
            self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._export_names = checkpoint_names(self.module)
        shard_model(self.module, cfg.model.dtype, self.device)
        self.optimizer = build_adamw(self.module, cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self._offload = DeviceOffload(
            self.device,
            {
                "params": lambda: [*self.module.parameters(), *self.module.buffers()],
                "grads": lambda: [p.grad for p in self.module.parameters()],
                "optimizer": lambda: optimizer_tensors(self.optimizer),
            },
        )

    # ---------------------------------------------------------------- forward / backward
    def forward_backward(
        self,
        packs: list[PackedMicroBatch],
        loss_fn: LossFn,
        forward_only: bool,
        temperature: float,
        with_entropy: bool,
        batch=None,
    ) -> None:
        """Forward (and backward) of each micro-batch in turn; gradients accumulate in the shards."""
        self._offload.require("forward_backward", ("params",) if forward_only else ("params", "grads"))
        del batch  # no routing replay here
        if forward_only:
            self.module.eval()
        try:
            for mb in packs:
                with torch.set_grad_enabled(not forward_only):
                    # No attention mask: transformers derives the per-sequence causal mask from the position ids.
                    logits = self.module(
                        input_ids=mb.tokens.to(self.device),
                        position_ids=mb.position_ids.to(self.device),
                        use_cache=False,
                    ).logits
                    out = vocab_parallel_logprobs(
                        logits,
                        mb.target_ids.to(logits.device),
                        None,
                        temperature=temperature,
                        with_entropy=with_entropy,
                    )
                    loss = loss_fn(mb, *(out if with_entropy else (out, None)))
                    if not forward_only:
                        loss.backward()
        finally:
            if forward_only:
                self.module.train()

    # ---------------------------------------------------------------- optimizer
    def zero_grad(self) -> None:
        self._offload.require("zero_grad", ("grads",))
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
        self._offload.require("optimizer_step", ("params", "grads", "optimizer"))
        params = [p for p in self.module.parameters() if p.grad is not None]
        clip = self.cfg.optimizer.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not (loss_finite and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return False, norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step(1)
        return True, norm

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ---------------------------------------------------------------- checkpoints and weights
    def _state(self, extra: dict) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict(), **extra}

    def save_checkpoint(self, path: str, extra: dict) -> None:
        """Model, optimizer and lr schedule as a torch.distributed.checkpoint (DCP) directory, each
        rank writing its shards."""
        self._offload.require("save_checkpoint", ("params", "optimizer"))
        import torch.distributed.checkpoint as dcp

        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dcp.save(self._state(extra), checkpoint_id=path)
        dist.barrier()

    def load_checkpoint(self, path: str, extra: dict) -> dict:
        """Load what save_checkpoint wrote (DCP reshards: any number of ranks)."""
        self._offload.require("load_checkpoint", ("params", "optimizer"))
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not os.path.isdir(path):
            raise FileNotFoundError(f"actor checkpoint {path} does not exist")
        state = self._state(extra)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        return {k: state[k] for k in extra}

    @torch.no_grad()
    def export_hf_weights(self, byte_budget: int | None = None, dst_rank=0) -> Iterator:
        """`(hf_name, full tensor or None)` for every tensor of the HF checkpoint, in its order.

        Each parameter is all-gathered from its FSDP shards once; the full tensor (fp32 master weights
        cast to `model.dtype`, on the CPU) is yielded on `dst_rank` (None: every rank; EACH_SOURCE:
        rank 0, the one source), None elsewhere. Fused MoE experts are yielded per expert under their
        checkpoint names. `byte_budget` is accepted for interface parity: each parameter is one gather.
        """
        del byte_budget
        self._offload.require("export_hf_weights", ("params",))
        dst_rank = 0 if dst_rank is EACH_SOURCE else dst_rank
        params = dict(self.module.named_parameters())
        dtype = _DTYPES[self.cfg.model.dtype]
        me = dist.get_rank()
        full_name, full = None, None
        for name, mem, (shape, stride, offset) in self._export_names:
            if mem != full_name:
                p = params[mem]
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                full = full.to("cpu", dtype).contiguous() if dst_rank is None or me == dst_rank else None
                full_name = mem
            if full is None:
                yield name, None
            else:
                yield name, full.as_strided(shape, stride, offset).clone()

    def export_sources(self) -> list[int]:
        """Rank 0 gathers every full tensor: the one source."""
        return [0]

    # ---------------------------------------------------------------- offload (colocated placement)
    def offload(self, what=None) -> dict[str, int]:
        """trainer/offload.py on the local shards (FSDP2 frees the unsharded parameters after each
        forward and backward, so the shards are all that stays on the device between steps)."""
        self.module.reshard()  # a forward-only pass may leave the root's parameters unsharded
        return self._offload.offload(what)

    def reload(self, what=None) -> dict[str, int]:
        return self._offload.reload(what)
