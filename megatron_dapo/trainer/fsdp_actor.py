"""The FSDP2 actor: the same DAPO train step as the Megatron actor, on a Hugging Face model sharded
with torch's `fully_shard` over all trainer ranks (data parallel only; `trainer.backend: fsdp2`).

    actor = FSDPActor(cfg)                          # HF weights from cfg.model.hf_path
    old = actor.compute_logprobs(batch)             # list of [response_len] fp32 tensors, every rank
    metrics = actor.train_step(batch)               # same metric names as MegatronActor
    actor.save_checkpoint(dir); actor.load_checkpoint(dir)   # model + optimizer + lr schedule, torch DCP
    for name, tensor in actor.export_weights(): ... # HF checkpoint names, full tensors on rank 0

What is shared with `MegatronActor` (this class derives from it): the split of groups over ranks,
the mini-batch loop, the packing by token budget, the DAPO loss with its exact global token count,
the metrics and their reduction, the non-finite skip, and megatron-core's lr schedule
(`OptimizerParamScheduler` drives any optimizer's param groups, so warm-up and decay are the
Megatron path's to the step). What differs is the engine: a forward loop over micro-batches
instead of megatron-core's pipeline schedule, torch AdamW on the FSDP2 shards, `clip_grad_norm_`
on DTensor gradients, and DCP checkpoints.

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

import logging
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_dapo.kernels.backend import vocab_parallel_logprobs
from megatron_dapo.models import QwenArch
from megatron_dapo.trainer.actor import MegatronActor
from megatron_dapo.trainer.lr_schedule import build_lr_scheduler

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Chunk:
    """The FSDP module as the Megatron actor's loop addresses its model chunks."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def zero_grad_buffer(self):
        self.module.zero_grad(set_to_none=True)


def _checkpoint_names(model: torch.nn.Module) -> list[tuple[str, str, tuple]]:
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


class FSDPActor(MegatronActor):
    def __init__(self, cfg, hf_dir: str | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        m, o, a = cfg.model, cfg.optimizer, cfg.algo
        hf_dir = hf_dir or m.hf_path or None
        if not hf_dir:
            raise ValueError("model.hf_path is required to build the FSDP2 actor's model")
        bad = [
            f"parallel.{n}={getattr(cfg.parallel, n)}"
            for n in ("tp", "pp", "cp", "ep")
            if getattr(cfg.parallel, n) != 1
        ]
        if bad:
            raise ValueError(f"trainer.backend=fsdp2 shards over data parallel only; set {', '.join(bad)} to 1")
        self.arch = QwenArch.from_hf(hf_dir)
        if self.arch.is_moe and a.routing_replay != "none":
            raise ValueError(
                "trainer.backend=fsdp2 does not replay the rollout's routing (algo.routing_replay=rollout, the "
                "default for an MoE model): use trainer.backend=megatron, or set algo.routing_replay=none"
            )
        self.replay = None
        if not dist.is_initialized():
            raise RuntimeError("FSDPActor needs torch.distributed initialised (runtime.distributed.init_distributed)")
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # fp32 master weights; with bf16 / fp16 the forward and backward run in that dtype and
        # gradients are reduced in fp32 (FSDP2's mixed precision).
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(self.device)
        if m.recompute_granularity != "none":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._export_names = _checkpoint_names(model)
        compute = _DTYPES[m.dtype]
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute != torch.float32 else None
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        kwargs = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.module = model
        self.model = [_Chunk(model)]

        params = [p for p in model.parameters() if p.requires_grad]
        # As megatron-core: no weight decay on biases and norm weights.
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim > 1], "weight_decay": o.weight_decay},
                {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "wd_mult": 0.0},
            ],
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.tp_group = None
        self.dp_group = None  # the default group: every trainer rank is a data-parallel rank
        self.dp_size = dist.get_world_size()
        self.dp_rank = dist.get_rank()
        self.pp_size = 1
        self.is_last_stage = True
        self.max_tokens = a.max_tokens_per_micro_batch or (cfg.data.max_prompt_length + cfg.data.max_response_length)
        self.pad_multiple = self.seq_multiple = 1  # no sequence or context parallelism here
        self.cp_size, self.cp_rank, self.cp_group = 1, 0, None
        self.optimizer_steps = 0
        self.skipped_steps = 0

    # ---------------------------------------------------------------- forward machinery
    def _forward(self, model, mb):
        # No attention mask: transformers derives the per-sequence causal mask from the position ids.
        out = self.module(
            input_ids=mb.tokens.to(self.device), position_ids=mb.position_ids.to(self.device), use_cache=False
        )
        return out.logits

    def _logprobs(self, logits, mb, temperature: float, with_entropy: bool, head_weight=None, part=None):
        # head_weight is the fused LM head's (algo.fused_lm_head) and part a context-parallel slice: config
        # validation refuses both for fsdp2
        assert head_weight is None, "algo.fused_lm_head is not supported by the FSDP2 actor"
        assert part is None, "parallel.cp > 1 is not supported by the FSDP2 actor"
        return vocab_parallel_logprobs(
            logits, mb.target_ids.to(logits.device), None, temperature=temperature, with_entropy=with_entropy
        )

    def _run(self, packs, forward_only: bool, loss_fn, batch=None):
        """Forward (and backward) of each micro-batch in turn; gradients accumulate in the shards.

        `loss_fn` returns the micro-batch loss times the number of micro-batches (the pipeline
        schedule's convention that MegatronActor follows): divide it back out.
        """
        n = len(packs)
        for mb in packs:
            with torch.set_grad_enabled(not forward_only):
                logits = self._forward(self.module, mb)
                loss, _ = loss_fn(logits, mb)
                if not forward_only:
                    (loss / n).backward()

    def _optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
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
        self.optimizer_steps += 1
        return True, norm

    # ---------------------------------------------------------------- checkpoints and weights
    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "actor": {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps},
        }

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer and lr schedule as a torch.distributed.checkpoint (DCP) directory, each
        rank writing its shards. Collective. The caller renames `path` into place."""
        import torch.distributed.checkpoint as dcp

        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=path)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Load what :meth:`save_checkpoint` wrote (DCP reshards: any number of ranks). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not os.path.isdir(path):
            raise FileNotFoundError(f"actor checkpoint {path} does not exist")
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["actor"]["optimizer_steps"])
        self.skipped_steps = int(state["actor"]["skipped_steps"])

    @torch.no_grad()
    def export_weights(self, byte_budget: int | None = None, dst_rank: int | None = 0) -> Iterator:
        """`(hf_name, full tensor or None)` for every tensor of the HF checkpoint, in its order.

        Collective: every rank iterates to the end. Each parameter is all-gathered from its FSDP
        shards once; the full tensor (fp32 master weights cast to `model.dtype`, on the CPU) is
        yielded on `dst_rank` (None: every rank), None elsewhere. Fused MoE experts are yielded
        per expert under their checkpoint names. `byte_budget` is accepted for interface
        parity: each parameter is one gather here.
        """
        del byte_budget
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
