"""The Megatron training engine (trainer/engine.py's TrainEngine) on megatron-core: GPT model chunks
(TP / PP / VPP / CP / EP) wrapped in DDP, its (distributed) optimizer and lr schedule, the pipeline
schedule, the fused LM head, routing replay (R3), torch_dist checkpoints and the streaming HF export.

Built after `init_distributed` / `init_model_parallel`: `MegatronEngine(cfg)`, HF weights from
`cfg.model.hf_path`. The loss function's value (a micro-batch's exact share of the mini-batch loss) is
handed to the schedule multiplied by the number of micro-batches, as the schedule divides by it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_dapo.bridge.parallel import unwrap_model
from megatron_dapo.bridge.spec_keys import load_model_state
from megatron_dapo.config import derived
from megatron_dapo.kernels.backend import vocab_parallel_logprobs
from megatron_dapo.kernels.fused_linear import fused_linear_logprobs
from megatron_dapo.models import ModelParallel, QwenArch, build_gpt_model, mask_padded_vocab_logits
from megatron_dapo.models.specs import te_available
from megatron_dapo.runtime.layout import ParallelLayout
from megatron_dapo.trainer.cp_split import ContextParallelSlice, gather_token_order, split_micro_batch
from megatron_dapo.trainer.engine import LossFn
from megatron_dapo.trainer.lr_schedule import build_lr_scheduler
from megatron_dapo.trainer.offload import DeviceOffload, optimizer_tensors
from megatron_dapo.trainer.packing import PackedMicroBatch, PackingRules, per_sequence_rope
from megatron_dapo.trainer.routing_replay import RoutingReplay, routing_shape_of


@contextlib.contextmanager
def output_layer_returns_hidden(model):
    """Inside this block a last-stage GPTModel returns its final hidden state [b, s, h] where it would
    return logits [b, s, v] (algo.fused_lm_head): its output layer's forward hands back its input and no
    bias. Yields a dict that gets "weight", the output weight [V_local, h] the layer was called with
    (the shared embedding weight when embeddings are tied, else the layer's own); empty on other stages.

    The module call itself is kept (hooks still run); only the matmul is skipped. The input is not routed
    through copy_to_tensor_model_parallel_region (nor gathered under sequence parallelism) either, so the
    caller's op must all-reduce dH over TP, or gather and reduce-scatter it (fused_linear_logprobs does)."""
    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    head: dict = {}
    if layer is None:
        yield head
        return

    def forward(input_, weight=None, runtime_gather_output=None, **_kwargs):
        head["weight"] = layer.weight if weight is None else weight
        return input_, None

    layer.forward = forward
    try:
        yield head
    finally:
        del layer.forward


# ---------------------------------------------------------------- build
def model_overrides(cfg, arch: QwenArch, use_te: bool) -> dict:
    """TransformerConfig fields the config sets beyond the architecture and the parallel sizes."""
    parallel, model = cfg.parallel, cfg.model
    # grouped GEMM of the experts exists only with Transformer Engine (TEGroupedMLP)
    out = (
        {
            "moe_token_dispatcher_type": parallel.moe_token_dispatcher,
            "moe_grouped_gemm": model.moe_grouped_gemm and use_te,
        }
        if arch.is_moe
        else {}
    )
    if model.recompute_granularity != "none":
        out["recompute_granularity"] = model.recompute_granularity
        if model.recompute_granularity == "full":
            out.update(recompute_method=model.recompute_method, recompute_num_layers=model.recompute_num_layers)
    if model.moe_aux_loss_coeff is not None:
        out["moe_aux_loss_coeff"] = model.moe_aux_loss_coeff
    # algo.routing_replay: null means rollout for an MoE model (R3, trainer/routing_replay.py)
    if replays_routing(cfg, arch):
        out["moe_enable_routing_replay"] = True
    if parallel.cp > 1 and use_te:  # Transformer Engine's CP attention; the local spec's gathers K/V
        out["cp_comm_type"] = parallel.cp_comm_type or "p2p"
    elif parallel.cp > 1 and parallel.cp_comm_type not in (None, "all_gather"):
        raise ValueError(
            f"parallel.cp_comm_type={parallel.cp_comm_type} needs Transformer Engine on a GPU; this rank runs the "
            f"local spec, whose context-parallel attention all-gathers K/V (set it to all_gather or null)"
        )
    return out


def replays_routing(cfg, arch: QwenArch) -> bool:
    return arch.is_moe and cfg.algo.routing_replay != "none"


def model_parallel(cfg) -> ModelParallel:
    parallel = cfg.parallel
    return ModelParallel(
        tp=parallel.tp,
        pp=parallel.pp,
        vpp=parallel.vpp,
        ep=parallel.ep,
        etp=parallel.etp,
        cp=parallel.cp,
        dtype=cfg.model.dtype,
        sequence_parallel=parallel.sequence_parallel,
    )


def build_chunks(cfg, hf_dir: str | None, use_te: bool) -> list:
    """This rank's GPT model chunks, HF weights loaded from `hf_dir` (else initialised from model.hf_config)."""
    source = hf_dir or cfg.model.hf_config
    if not source:
        raise ValueError("model.hf_path (or model.hf_config) is required to build the actor's model")
    arch = QwenArch.from_hf(source)
    chunks = build_gpt_model(
        arch, model_parallel(cfg), use_te=use_te, config_overrides=model_overrides(cfg, arch, use_te)
    )
    if hf_dir:
        from megatron_dapo.bridge import load_hf_into_megatron

        load_hf_into_megatron(chunks, hf_dir)
    return chunks


def wrap_ddp(chunks, cfg) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        overlap_grad_reduce=False,
    )
    return [DistributedDataParallel(config, ddp_config, c) for c in chunks]


def optimizer_config_kwargs(cfg) -> dict:
    """The fields of megatron-core's OptimizerConfig for `cfg.optimizer`. With optimizer.cpu_offload,
    megatron-core's own CPU offload: its HybridDeviceOptimizer keeps `offload_fraction` of the fp32 master
    weights and Adam states in pinned CPU memory and steps them there with torch AdamW, overlapping the
    gradient / parameter copies on side streams. It runs on the precision-aware distributed optimizer's
    code path (Megatron-LM refuses --optimizer-cpu-offload without --use-precision-aware-optimizer, whose
    OptimizerConfig checks read Transformer Engine's version): the settings slime runs Qwen3-30B-A3B with
    on one node."""
    o, dtype = cfg.optimizer, model_parallel(cfg).torch_dtype
    offload = (
        dict(
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=o.offload_fraction,
            use_precision_aware_optimizer=True,
            overlap_cpu_optimizer_d2h_h2d=True,
        )
        if o.cpu_offload
        else {}
    )
    return dict(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        use_distributed_optimizer=o.use_distributed_optimizer,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **offload,
    )


def build_optimizer(model: list, cfg):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if cfg.optimizer.cpu_offload and not torch.cuda.is_available():
        # HybridDeviceOptimizer.__init__ takes torch.cuda.current_stream() / torch.cuda.Stream() and its
        # step copies on them: megatron-core's CPU offload exists for GPU training only.
        raise ValueError(
            "optimizer.cpu_offload=true needs CUDA: megatron-core's HybridDeviceOptimizer copies gradients and "
            "parameters between GPU and CPU on CUDA streams; on a CPU-only machine set optimizer.cpu_offload=false"
        )
    return get_megatron_optimizer(OptimizerConfig(**optimizer_config_kwargs(cfg)), model)


def packing_rules(layout: ParallelLayout, sequence_parallel: bool, num_chunks: int) -> PackingRules:
    # Context parallelism cuts every packed sequence into 2*cp chunks; sequence parallel then scatters
    # each CP rank's row over TP ranks: lengths must divide evenly.
    seq = 2 * layout.cp if layout.cp > 1 else 1
    return PackingRules(
        seq_multiple=seq,
        pad_multiple=seq * (layout.tp if sequence_parallel else 1),
        count_multiple=layout.pp if num_chunks > 1 else 1,  # the interleaved schedule runs groups of pp
        same_length=layout.pp > 1,
    )


# ---------------------------------------------------------------- optimizer state around a load
def materialize_optimizer_state(optimizer) -> None:
    """Give every parameter an (empty) Adam state before loading one.

    A fresh optimizer has no state until its first step, and megatron-core 0.16.1's distributed
    optimizer reads each state's `step` to build the sharded state dict it loads into (its
    init_state_fn sets exp_avg / exp_avg_sq only): the torch Adam used without TE / apex
    would fail there.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for group in torch_opt.param_groups:
            for p in group["params"]:
                state = torch_opt.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state.setdefault("step", torch.tensor(0.0))


def restore_adam_steps(optimizer) -> None:
    """Torch Adam's per-parameter `step` after a load.

    Without TE / apex, megatron-core keeps Adam's step in the param groups of the checkpoint and
    re-applies it before loading the parameter states, and that load then overwrites it with the
    placeholder of the state it loads into: set it from the param groups again.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(opt, "optimizer", None)
        for group in getattr(torch_opt, "param_groups", []):
            if "step" not in group:
                continue
            for p in group["params"]:
                torch_opt.state[p]["step"] = torch.tensor(float(group["step"]))


class MegatronEngine:
    def __init__(self, cfg, hf_dir: str | None = None):
        self.cfg = cfg
        impl = cfg.model.transformer_impl
        self.use_te = impl == "transformer_engine" and te_available() and torch.cuda.is_available()
        chunks = build_chunks(cfg, hf_dir or cfg.model.hf_path or None, self.use_te)
        self.arch, self.config = chunks[0].arch, chunks[0].config
        self.model = wrap_ddp(chunks, cfg)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.layout = ParallelLayout.from_megatron()
        self.packing = packing_rules(self.layout, bool(self.config.sequence_parallel), len(self.model))
        self._offload = DeviceOffload(
            self.device,
            {"params": self._param_tensors, "grads": self._grad_tensors, "optimizer": self._optimizer_tensors},
        )
        # algo.fused_lm_head: the last stage returns hidden states; logprobs come from
        # fused_linear_logprobs (chunked, never the [T, V] logits).
        self.fused_lm_head = derived.fused_lm_head(cfg)
        self.replay = (
            RoutingReplay(
                self.model,
                routing_shape_of(self.arch),
                self.layout.tp_rank,
                self.layout.tp,
                bool(self.config.sequence_parallel),
            )
            if replays_routing(cfg, self.arch)
            else None
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
        """Run the pipeline schedule over `packs`; with `batch` carrying routed experts (R3) every
        micro-batch's forward (and its recompute in backward) replays the rollout's routing."""
        self._offload.require("forward_backward", ("params",) if forward_only else ("params", "grads"))
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replay = self.replay if batch is not None and batch.routed_experts is not None else None
        n = len(packs)

        def loss(mb, part, head_weight, output):
            lp = self._position_logprobs(output, mb, part, head_weight, temperature, with_entropy)
            value = loss_fn(mb, *(lp if with_entropy else (lp, None)))
            # the schedule divides by the number of micro-batches (and, with CP, multiplies by cp: DDP
            # averages gradients over DP x CP, and the CP ranks' gradients are parts of one sum)
            return (output.new_zeros(()) if forward_only else value * n), {}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            part = split_micro_batch(mb, self.layout.cp, self.layout.cp_rank) if self.layout.cp > 1 else None
            if replay is not None:
                replay.feed(model, batch, mb, part)
            with output_layer_returns_hidden(model) if self.fused_lm_head else contextlib.nullcontext({}) as head:
                output = self._forward(model, mb, part)  # the final hidden state on the last stage if fused
            if replay is not None:
                replay.after_forward(model)
            return output, functools.partial(loss, mb, part, head.get("weight"))

        length = max(mb.length for mb in packs)
        # Interleaved (virtual) pipelining asks each model chunk for its own iterator.
        data = iter(packs) if len(self.model) == 1 else [iter(list(packs)) for _ in self.model]
        for m in self.model if forward_only else ():
            m.eval()
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=self.model,
                num_microbatches=n,
                seq_length=length,
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            if self.replay is not None:
                self.replay.clear()
            for m in self.model if forward_only else ():
                m.train()

    def _forward(self, model, mb: PackedMicroBatch, part: ContextParallelSlice | None):
        dev = self.device
        src = part or mb
        tokens, positions = src.tokens.to(dev), src.position_ids.to(dev)
        if self.use_te:
            # THD: with CP, Transformer Engine takes the whole row's (2*cp-padded) cu_seqlens and this
            # rank's load-balanced tokens, as Megatron-LM feeds it.
            params = mb.packed_seq_params()
            for name in ("cu_seqlens_q", "cu_seqlens_kv"):
                setattr(params, name, getattr(params, name).to(dev))
            if part is not None:
                params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded = params.cu_seqlens_q, params.cu_seqlens_kv
            return model(tokens, positions, None, packed_seq_params=params)
        mask = part.attention_mask() if part is not None else mb.attention_mask()
        with per_sequence_rope(model, positions, cp=self.layout.cp):
            return model(tokens, positions, mask.to(dev))

    def _position_logprobs(self, output, mb, part, head_weight, temperature: float, with_entropy: bool):
        """Per-position target logprobs [1, L] (and entropy) of the last stage's output. With
        algo.fused_lm_head, `output` is the final hidden state [1, L, h] and `head_weight` the output
        weight [V_local, h]: the LM head is applied chunk by chunk inside fused_linear_logprobs.
        With context parallelism the output covers this rank's tokens only: their values are gathered
        over the CP group back into packed order."""
        local = self._local_position_logprobs(
            output, part.target_ids if part else mb.target_ids, temperature, with_entropy, head_weight
        )
        if part is None:
            return local
        if with_entropy:
            return tuple(gather_token_order(x, part, self.layout.cp_group) for x in local)
        return gather_token_order(local, part, self.layout.cp_group)

    def _local_position_logprobs(self, output, target_ids, temperature, with_entropy, head_weight):
        tp_group = self.layout.tp_group
        if head_weight is not None:
            # under sequence parallelism `output` holds this TP rank's 1/TP of the positions: the op
            # gathers them and hands back every position's values
            shape = target_ids.shape
            lp, ent = fused_linear_logprobs(
                output.reshape(-1, output.shape[-1]),
                head_weight,
                target_ids.to(output.device).reshape(-1),
                tp_group=tp_group,
                temperature=temperature,
                with_entropy=with_entropy,
                vocab_size=self.arch.vocab_size,
                sequence_parallel=bool(self.config.sequence_parallel),
                gradient_accumulation_fusion=bool(self.config.gradient_accumulation_fusion),
            )
            return (lp.view(shape), ent.view(shape)) if with_entropy else lp.view(shape)
        logits = mask_padded_vocab_logits(output, self.arch.vocab_size)
        return vocab_parallel_logprobs(
            logits, target_ids.to(logits.device), tp_group, temperature=temperature, with_entropy=with_entropy
        )

    # ---------------------------------------------------------------- optimizer
    def zero_grad(self) -> None:
        self._offload.require("zero_grad", ("grads",))
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
        self._offload.require("optimizer_step", ("params", "grads", "optimizer"))
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if not (loss_finite and math.isfinite(norm)):
            self.optimizer.zero_grad()
            for m in self.model:
                m.zero_grad_buffer()
            return False, norm
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(1)
        return bool(ok), float(grad_norm if grad_norm is not None else norm)

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ---------------------------------------------------------------- checkpoints and weights
    def _sharded_state_dict(self, extra: dict, is_loading: bool = False, metadata: dict | None = None):
        model_sd = {}
        for i, m in enumerate(self.model):
            key = "model" if len(self.model) == 1 else f"model{i}"
            model_sd[key] = m.module.sharded_state_dict(metadata=metadata)
        return {
            **model_sd,
            # dp_reshardable: each rank writes its own optimizer shard, no gather (resume keeps TP/PP/EP).
            "optimizer": self.optimizer.sharded_state_dict(
                model_sd if len(self.model) > 1 else model_sd["model"],
                is_loading=is_loading,
                metadata={"distrib_optim_sharding_type": "dp_reshardable"},
            ),
            "scheduler": self.scheduler.state_dict(),
            **extra,
        }

    def save_checkpoint(self, path: str, extra: dict) -> None:
        """Model, optimizer and lr schedule in megatron-core dist_checkpointing (torch_dist) format."""
        self._offload.require("save_checkpoint", ("params", "optimizer"))
        from megatron_dapo.trainer.checkpoint import megatron_save

        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        megatron_save(self._sharded_state_dict(extra), path)
        dist.barrier()

    def load_checkpoint(self, path: str, extra: dict) -> dict:
        """Load what save_checkpoint wrote (any data- or context-parallel size; same TP/PP/EP)."""
        self._offload.require("load_checkpoint", ("params", "optimizer"))
        from megatron.core import dist_checkpointing

        from megatron_dapo.bridge.layer_layout import sharded_state_dict_metadata

        if not os.path.isdir(path):
            raise FileNotFoundError(f"actor checkpoint {path} does not exist")
        materialize_optimizer_state(self.optimizer)
        # Checkpoints of all-MoE models saved before they were built stacked hold per-layer keys.
        meta = sharded_state_dict_metadata([m.module for m in self.model], path)
        state = dist_checkpointing.load(self._sharded_state_dict(extra, is_loading=True, metadata=meta), path)
        for i, m in enumerate(self.model):
            load_model_state(m.module, state["model" if len(self.model) == 1 else f"model{i}"])
        with torch.no_grad():  # the fp32 main params are views of the model's leaf parameters
            self.optimizer.load_state_dict(state["optimizer"])
        restore_adam_steps(self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        return {k: state[k] for k in extra}

    def export_hf_weights(self, byte_budget: int | None = None, dst_rank=0) -> Iterator:
        """See bridge.export_hf_weights (its plan is agreed by all ranks here, not at the first item)."""
        self._offload.require("export_hf_weights", ("params",))
        from megatron_dapo.bridge import export_hf_weights

        return export_hf_weights(self.model, byte_budget=byte_budget, dst_rank=dst_rank)

    def export_sources(self) -> list[int]:
        """One rank per pipeline stage, plus each expert-parallel rank holding experts (bridge.export_sources)."""
        from megatron_dapo.bridge import export_sources

        return export_sources(self.model)

    # ---------------------------------------------------------------- offload (colocated placement)
    def _param_tensors(self) -> list:
        # m.module: DDP's own `buffers` attribute (its grad buffers) hides nn.Module.buffers()
        return [t for m in self.model for t in (*m.module.parameters(), *m.module.buffers())]

    def _grad_tensors(self) -> list:
        # DDP's contiguous grad buffers (param.main_grad views them), expert-parallel ones included.
        return [b.grad_data for m in self.model for b in (*m.buffers, *m.expert_parallel_buffers)]

    def _optimizer_tensors(self) -> list:
        chain = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [
            t for opt in chain if getattr(opt, "optimizer", None) is not None for t in optimizer_tensors(opt.optimizer)
        ]

    def offload(self, what=None) -> dict[str, int]:
        return self._offload.offload(what)

    def reload(self, what=None) -> dict[str, int]:
        return self._offload.reload(what)
