"""The Megatron actor: logprob recompute and DAPO policy updates on megatron-core.

One `MegatronActor` per trainer rank, built after `init_distributed` / `init_model_parallel`:

    actor = MegatronActor(cfg)                      # DapoConfig; HF weights from cfg.model.hf_path
    old = actor.compute_logprobs(batch)             # list of [response_len] fp32 tensors, every rank
    metrics = actor.train_step(shard)               # dict of floats (same on every rank)
    actor.save_checkpoint(dir); actor.load_checkpoint(dir)   # model + optimizer + scheduler, torch_dist
    for name, tensor in actor.export_weights(): ... # HF names, full tensors on rank 0 (collective)

`batch` is a `megatron_dapo.coordinator.batch.RolloutBatch`; a train step takes this rank's
`megatron_dapo.shards.DPShard` of it (or the whole batch, the same on every rank, and cuts it
the same way). A train step:

1. rows are split over data-parallel ranks by group (no group straddles two ranks), balancing tokens,
   per mini-batch (`shard_batch`; done by the coordinator when it hands out shards);
2. the old-policy logprobs of the rank's rows are recomputed with the current weights (no grad);
3. for each of `ppo_epochs` epochs, for each mini-batch of `ppo_mini_batch_size` groups: the
   rows are packed into micro-batches by the token budget `algo.max_tokens_per_micro_batch`, and
   megatron-core's pipeline schedule runs forward / backward with the DAPO loss normalised by the
   loss-token count of the whole mini-batch (all micro-batches, all DP ranks; it comes with the
   shard); then one optimizer step (grad clipping, lr schedule with warm-up). A non-finite loss or
   gradient norm skips that step (counted in `actor/skipped_steps`).

Micro-batch losses are returned to the schedule multiplied by the number of micro-batches (the
schedule divides by it); the DAPO loss already carries the DP factor that DDP's averaging removes,
so gradients equal those of the whole mini-batch as one batch on one process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_dapo.algo.loss import LOG_RATIO_BOUND
from megatron_dapo.bridge.parallel import unwrap_model
from megatron_dapo.bridge.spec_keys import load_model_state
from megatron_dapo.config import derived
from megatron_dapo.config.derived import token_sum_norm
from megatron_dapo.shards import shard_batch, split_groups_over_ranks
from megatron_dapo.kernels.dispatch import dapo_policy_loss, vocab_parallel_logprobs
from megatron_dapo.kernels.fused_linear import fused_linear_logprobs
from megatron_dapo.models import ModelParallel, QwenArch, build_gpt_model, mask_padded_vocab_logits
from megatron_dapo.models.specs import te_available
from megatron_dapo.trainer.cp_split import ContextParallelSlice, gather_token_order, split_micro_batch
from megatron_dapo.trainer.lr_schedule import build_lr_scheduler
from megatron_dapo.trainer.packing import (
    PackedMicroBatch,
    pack,
    padded_length,
    per_sequence_rope,
    plan_micro_batches,
)
from megatron_dapo.trainer.routing_replay import RoutingReplay, routing_shape_of
from megatron_dapo.types import DPShard

log = logging.getLogger(__name__)

_MAX_METRICS = ("actor/ratio_max",)


def dapo_loss_options(cfg) -> dict:
    """The config's keyword arguments of `dapo_policy_loss` (the same for every micro-batch).

    token_sum_norm is a constant (algo.loss_scale_factor or data.max_response_length): left unset,
    seq-mean-token-sum-norm would divide by each micro-batch's padded width instead."""

    a = cfg.algo
    return dict(
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        token_sum_norm=token_sum_norm(cfg),
        rollout_is_cap=a.rollout_is.cap if a.rollout_is.enable else None,
    )


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


class MegatronActor:
    def __init__(self, cfg, hf_dir: str | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = cfg
        p, m, o, a = cfg.parallel, cfg.model, cfg.optimizer, cfg.algo
        hf_dir = hf_dir or m.hf_path or None
        source = hf_dir if hf_dir else m.hf_config
        if not source:
            raise ValueError("model.hf_path (or model.hf_config) is required to build the actor's model")
        self.use_te = m.transformer_impl == "transformer_engine" and te_available() and torch.cuda.is_available()
        arch = QwenArch.from_hf(source)
        par = ModelParallel(
            tp=p.tp,
            pp=p.pp,
            vpp=p.vpp,
            ep=p.ep,
            etp=p.etp,
            cp=p.cp,
            dtype=m.dtype,
            sequence_parallel=p.sequence_parallel,
        )
        # grouped GEMM of the experts exists only with Transformer Engine (TEGroupedMLP)
        overrides = (
            {
                "moe_token_dispatcher_type": p.moe_token_dispatcher,
                "moe_grouped_gemm": m.moe_grouped_gemm and self.use_te,
            }
            if arch.is_moe
            else {}
        )
        if m.recompute_granularity != "none":
            overrides["recompute_granularity"] = m.recompute_granularity
            if m.recompute_granularity == "full":
                overrides.update(recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers)
        if m.moe_aux_loss_coeff is not None:
            overrides["moe_aux_loss_coeff"] = m.moe_aux_loss_coeff
        # algo.routing_replay: null means rollout for an MoE model (R3, trainer/routing_replay.py)
        replay = arch.is_moe and a.routing_replay != "none"
        if replay:
            overrides["moe_enable_routing_replay"] = True
        if p.cp > 1 and self.use_te:  # Transformer Engine's CP attention; the local spec's gathers K/V
            overrides["cp_comm_type"] = p.cp_comm_type or "p2p"
        elif p.cp > 1 and p.cp_comm_type not in (None, "all_gather"):
            raise ValueError(
                f"parallel.cp_comm_type={p.cp_comm_type} needs Transformer Engine on a GPU; this rank runs the "
                f"local spec, whose context-parallel attention all-gathers K/V (set it to all_gather or null)"
            )
        chunks = build_gpt_model(arch, par, use_te=self.use_te, config_overrides=overrides)
        if hf_dir:
            from megatron_dapo.bridge import load_hf_into_megatron

            load_hf_into_megatron(chunks, hf_dir)
        self.arch = chunks[0].arch
        self.config = chunks[0].config
        self.config.finalize_model_grads_func = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=o.use_distributed_optimizer, overlap_grad_reduce=False
        )
        self.model = [DistributedDataParallel(self.config, ddp_config, c) for c in chunks]
        dtype = par.torch_dtype
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
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
            ),
            self.model,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group()
        self.max_tokens = a.max_tokens_per_micro_batch or (cfg.data.max_prompt_length + cfg.data.max_response_length)
        # Context parallelism cuts every packed sequence into 2*cp chunks; sequence parallel then scatters
        # each CP rank's row over TP ranks: lengths must divide evenly.
        self.seq_multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        self.pad_multiple = self.seq_multiple * (p.tp if self.config.sequence_parallel else 1)
        # algo.fused_lm_head: the last stage returns hidden states; logprobs come from
        # fused_linear_logprobs (chunked, never the [T, V] logits).
        self.fused_lm_head = derived.fused_lm_head(cfg)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.replay = (
            RoutingReplay(
                self.model,
                routing_shape_of(self.arch),
                ps.get_tensor_model_parallel_rank(),
                ps.get_tensor_model_parallel_world_size(),
                bool(self.config.sequence_parallel),
            )
            if replay
            else None
        )

    # ---------------------------------------------------------------- forward machinery
    def _packs(self, batch, rows: list[int]) -> list[PackedMicroBatch]:
        """Rows packed by the token budget; the same micro-batch count on every DP rank."""
        lengths = [padded_length(len(batch.input_ids[r]), self.seq_multiple) for r in rows]
        plan = plan_micro_batches(lengths, self.max_tokens)
        count = torch.tensor([len(plan)], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
        count = int(count)
        if len(self.model) > 1:  # the interleaved schedule runs micro-batches in groups of pp
            count = -(-count // self.pp_size) * self.pp_size
        plan = plan_micro_batches(lengths, self.max_tokens, min_count=count)
        length = None
        if self.pp_size > 1:
            # Pipeline stages exchange activations of one fixed shape: pad every pack to the longest.
            longest = torch.tensor([max([1] + [sum(lengths[i] for i in b) for b in plan])], dtype=torch.long)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.dp_group)
            length = -(-int(longest) // self.pad_multiple) * self.pad_multiple
        return [
            pack(
                batch.input_ids,
                batch.prompt_lengths,
                [rows[i] for i in b],
                length,
                self.pad_multiple,
                seq_multiple=self.seq_multiple,
            )
            for b in plan
        ]

    def _cp_slice(self, mb: PackedMicroBatch) -> ContextParallelSlice | None:
        return split_micro_batch(mb, self.cp_size, self.cp_rank) if self.cp_size > 1 else None

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
        with per_sequence_rope(model, positions, cp=self.cp_size):
            return model(tokens, positions, mask.to(dev))

    def _logprobs(
        self,
        logits: torch.Tensor,
        mb: PackedMicroBatch,
        temperature: float,
        with_entropy: bool,
        head_weight: torch.Tensor | None = None,
        part: ContextParallelSlice | None = None,
    ):
        """Per-position target logprobs [1, L] (and entropy) of the last stage's output. With
        algo.fused_lm_head, `logits` is the final hidden state [1, L, h] and `head_weight` the output
        weight [V_local, h]: the LM head is applied chunk by chunk inside fused_linear_logprobs.
        With context parallelism the output covers this rank's tokens only: their values are gathered
        over the CP group back into packed order."""
        local = self._local_position_logprobs(
            logits, part.target_ids if part else mb.target_ids, temperature, with_entropy, head_weight
        )
        if part is None:
            return local
        if with_entropy:
            return tuple(gather_token_order(x, part, self.cp_group) for x in local)
        return gather_token_order(local, part, self.cp_group)

    def _local_position_logprobs(self, logits, target_ids, temperature, with_entropy, head_weight):
        if head_weight is not None:
            # under sequence parallelism `logits` holds this TP rank's 1/TP of the positions: the op
            # gathers them and hands back every position's values
            shape = target_ids.shape
            lp, ent = fused_linear_logprobs(
                logits.reshape(-1, logits.shape[-1]),
                head_weight,
                target_ids.to(logits.device).reshape(-1),
                tp_group=self.tp_group,
                temperature=temperature,
                with_entropy=with_entropy,
                vocab_size=self.arch.vocab_size,
                sequence_parallel=bool(self.config.sequence_parallel),
                gradient_accumulation_fusion=bool(self.config.gradient_accumulation_fusion),
            )
            return (lp.view(shape), ent.view(shape)) if with_entropy else lp.view(shape)
        logits = mask_padded_vocab_logits(logits, self.arch.vocab_size)
        out = vocab_parallel_logprobs(
            logits, target_ids.to(logits.device), self.tp_group, temperature=temperature, with_entropy=with_entropy
        )
        return out

    def _run(self, packs, forward_only: bool, loss_fn, batch=None):
        """Run the pipeline schedule over `packs`; with `batch` carrying routed experts (R3) every
        micro-batch's forward (and its recompute in backward) replays the rollout's routing."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replay = self.replay if batch is not None and batch.routed_experts is not None else None

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            part = self._cp_slice(mb)
            if replay is not None:
                replay.feed(model, batch, mb, part)
            with output_layer_returns_hidden(model) if self.fused_lm_head else contextlib.nullcontext({}) as head:
                output = self._forward(model, mb, part)  # the final hidden state on the last stage if fused
            if replay is not None:
                replay.after_forward(model)
            if not self.fused_lm_head:
                return output, functools.partial(loss_fn, mb=mb, part=part)
            return output, functools.partial(loss_fn, mb=mb, head_weight=head.get("weight"), part=part)

        length = max(mb.length for mb in packs)
        # Interleaved (virtual) pipelining asks each model chunk for its own iterator.
        data = iter(packs) if len(self.model) == 1 else [iter(list(packs)) for _ in self.model]
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=self.model,
                num_microbatches=len(packs),
                seq_length=length,
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            if self.replay is not None:
                self.replay.clear()

    # ---------------------------------------------------------------- logprobs
    @torch.no_grad()
    def _local_logprobs(self, batch, rows: list[int], measure_routing: bool = False) -> dict[int, torch.Tensor]:
        """{row: [response_len] fp32 logprobs} for `rows` (filled on the last pipeline stage only). A batch
        carrying routed experts is replayed (R3); `measure_routing` also counts where the trainer's own
        router agrees with them (actor/routing_agreement)."""
        for m in self.model:
            m.eval()
        out: dict[int, torch.Tensor] = {}

        def loss_fn(logits, mb, head_weight=None, part=None):
            lp = mb.gather(self._logprobs(logits, mb, batch.temperature, False, head_weight, part).float())
            for i, r in enumerate(mb.rows):
                out[r] = lp[i, : int(mb.target_valid[i].sum())].cpu()
            return logits.new_zeros(()), {}

        measure = measure_routing and self.replay is not None and batch.routed_experts is not None
        with self.replay.measuring_agreement() if measure else contextlib.nullcontext():
            self._run(self._packs(batch, rows), forward_only=True, loss_fn=loss_fn, batch=batch)
        for m in self.model:
            m.train()
        return out

    def compute_logprobs(self, batch, rows: list[int] | None = None) -> list[torch.Tensor]:
        """Logprobs of every response token under the current weights (temperature-scaled as
        `batch.temperature`), for `rows` (default: all), returned on every rank. Collective. With
        routing replay on, a batch that carries routed experts is routed as they say; one that carries
        none (the weight-sync probe) is routed by the trainer's own routers."""
        rows = list(range(batch.num_samples)) if rows is None else list(rows)
        mine = self._split(batch, rows)[self.dp_rank]
        local = self._local_logprobs(batch, mine)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local if self.is_last_stage else {})
        merged: dict[int, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return [merged[r] for r in rows]

    def _split(self, batch, rows: list[int]) -> list[list[int]]:
        groups = batch.group_index.tolist()
        chosen = sorted({groups[r] for r in rows})
        tokens = [len(x) for x in batch.input_ids]
        keep = set(rows)
        per_rank = split_groups_over_ranks(groups, tokens, chosen, self.dp_size)
        return [[r for r in rs if r in keep] for rs in per_rank]

    # ---------------------------------------------------------------- training
    def train_step(self, data) -> dict[str, float]:
        """One trainer step. Collective. `data`: this rank's `DPShard` of the step batch (as the
        coordinator hands it out), or the whole `RolloutBatch` (the same on every rank; cut here)."""
        a = self.cfg.algo
        if isinstance(data, DPShard):
            if (data.dp_rank, data.dp_size) != (self.dp_rank, self.dp_size):
                raise ValueError(
                    f"shard of DP rank {data.dp_rank}/{data.dp_size} given to DP rank {self.dp_rank}/{self.dp_size}"
                )
            shard = data
        else:
            self._check_batch(data)
            shard = shard_batch(data, self.dp_size, a.ppo_mini_batch_size)[self.dp_rank]
        batch = shard.batch
        self._check_batch(batch)
        # the old policy's logprobs for all of this rank's rows, before any update
        old = self._local_logprobs(batch, list(range(batch.num_samples)), measure_routing=True)
        totals: dict[str, float] = {}
        maxima: dict[str, float] = {}
        n_steps = skipped = 0
        grad_norms = []
        for _epoch in range(a.ppo_epochs):
            for mine, counts in zip(shard.mini_batches, shard.mini_batch_counts):
                lr = self._current_lr()  # the lr this step applies (the scheduler moves after it)
                metrics, ok, grad_norm = self._mini_batch_step(batch, mine, old, counts)
                metrics["actor/lr"] = lr
                n_steps += 1
                skipped += 0 if ok else 1
                if ok:
                    grad_norms.append(grad_norm)
                for k, v in metrics.items():
                    if k in _MAX_METRICS:
                        maxima[k] = max(maxima.get(k, -math.inf), v)
                    else:
                        totals[k] = totals.get(k, 0.0) + v
        out = {k: v / n_steps for k, v in totals.items()}
        out.update(maxima)
        out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["actor/optimizer_steps"] = float(n_steps - skipped)
        out["actor/skipped_steps"] = float(skipped)
        out.update(self._replay_metrics())
        self.skipped_steps += skipped
        return out

    def _replay_metrics(self) -> dict[str, float]:
        """actor/routing_agreement (share of rollout token-layer top-k sets the trainer's own router
        chose too, measured in the old-logprob pass) and actor/routing_replay_bytes (the int64 expert
        ids handed to the routers this step, all ranks and passes). Collective; empty without replay."""
        if self.replay is None:
            return {}
        m = self.replay.take_metrics()
        vec = torch.tensor([m["bytes"], m["agree"], m["compared"]], dtype=torch.float64)
        dist.all_reduce(vec)
        out = {"actor/routing_replay_bytes": float(vec[0])}
        if vec[2] > 0:
            out["actor/routing_agreement"] = float(vec[1] / vec[2])
        return out

    def _current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _check_batch(self, batch) -> None:
        n = batch.num_samples
        for name in ("prompt_lengths", "response_lengths", "rollout_logprobs", "response_loss_mask", "token_versions"):
            if len(getattr(batch, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(batch, name))} entries for {n} samples")
        if batch.advantages.shape != (n,) or batch.group_index.shape != (n,):
            raise ValueError(f"RolloutBatch.advantages / group_index must have shape ({n},)")
        if self.replay is not None and (batch.routed_experts is None or len(batch.routed_experts) != n):
            got = "none" if batch.routed_experts is None else f"{len(batch.routed_experts)} entries"
            raise ValueError(
                f"RolloutBatch.routed_experts has {got} for {n} samples: algo.routing_replay=rollout (the default "
                "for an MoE model) trains on the servers' routed experts; set algo.routing_replay=none to route "
                "with the trainer's own routers"
            )
        for r in range(n):
            resp = len(batch.input_ids[r]) - batch.prompt_lengths[r]
            if resp != batch.response_lengths[r]:
                raise ValueError(
                    f"RolloutBatch row {r}: response_lengths says {batch.response_lengths[r]} but "
                    f"input_ids minus the prompt has {resp} tokens"
                )
            if len(batch.rollout_logprobs[r]) != resp:
                raise ValueError(
                    f"RolloutBatch row {r}: {len(batch.rollout_logprobs[r])} rollout logprobs for "
                    f"{resp} response tokens"
                )

    def _mini_batch_step(self, batch, rows: list[int], old: dict[int, torch.Tensor], counts: tuple[int, int]):
        a = self.cfg.algo
        loss_options = dapo_loss_options(self.cfg)
        packs = self._packs(batch, rows)
        # The exact global normalisers of the mini-batch (loss tokens / sequences over every
        # micro-batch of every DP rank), known before the first backward: they come with the shard.
        global_tokens, global_seqs = float(counts[0]), float(counts[1])
        num_mb = len(packs)
        sums: dict[str, float] = {}
        maxima: dict[str, float] = {}
        use_is = a.rollout_is.enable

        def loss_fn(logits, mb: PackedMicroBatch, head_weight=None, part=None):
            lp_pos, ent_pos = self._logprobs(logits, mb, batch.temperature, True, head_weight, part)
            if not mb.rows:  # all padding (this rank has fewer micro-batches than others): no loss
                return lp_pos.sum() * 0.0, {}
            lp = mb.gather(lp_pos.float())
            old_rows, roll_rows, mask, adv = self._loss_inputs(batch, mb, old, lp)
            # clamped like the policy log-ratio, so a far-off rollout logprob cannot overflow exp
            log_w = (old_rows - roll_rows).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            is_weights = torch.exp(log_w) * (mask > 0) if use_is else None
            loss, metrics = dapo_policy_loss(
                lp,
                old_rows,
                adv,
                mask,
                global_num_tokens=max(global_tokens, 1.0),
                rollout_is_weights=is_weights,
                global_num_seqs=max(global_seqs, 1.0),
                dp_world_size=self.dp_size,
                **loss_options,
            )
            ent = mb.gather(ent_pos.float())
            # Token-mean entropy over the mini-batch, with the same global normalisation as the loss.
            ent_mean = (ent * mask).sum() * self.dp_size / max(global_tokens, 1.0)
            if a.entropy_coeff:
                loss = loss - a.entropy_coeff * ent_mean
            with torch.no_grad():
                add = self._loss_metrics(loss, ent_mean, metrics)
                per_token = self.dp_size / max(global_tokens, 1.0)
                # with routing replay on and off alike: how far the trainer's old logprobs are from the rollout's
                add["actor/train_rollout_logprob_abs_diff"] = (
                    float(((old_rows - roll_rows).abs() * mask).sum()) * per_token
                )
                if use_is:
                    w = torch.clamp(is_weights, max=a.rollout_is.cap) if a.rollout_is.cap else is_weights
                    add["actor/rollout_is_weight_mean"] = float((w * mask).sum()) * per_token
                for k, v in add.items():
                    sums[k] = sums.get(k, 0.0) + v
                ratio_max = float(metrics["ratio_max"]) if metrics["num_tokens"] > 0 else 0.0
                maxima["actor/ratio_max"] = max(maxima.get("actor/ratio_max", 0.0), ratio_max)
            # The schedule divides by the number of micro-batches; the loss is already this
            # micro-batch's exact share of the mini-batch loss. (With CP the schedule also multiplies by
            # cp: DDP averages gradients over DP x CP, and the CP ranks' gradients are parts of one sum.)
            return loss * num_mb, {}

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(packs, forward_only=False, loss_fn=loss_fn, batch=batch)
        metrics = self._reduce_metrics(sums, maxima)
        loss_finite = math.isfinite(metrics.get("actor/pg_loss", 0.0))
        ok, grad_norm = self._optimizer_step(loss_finite)
        if not ok:
            log.warning("optimizer step skipped: loss %s, grad norm %s", metrics.get("actor/pg_loss"), grad_norm)
        metrics["actor/nonfinite_loss"] = 0.0 if loss_finite else 1.0
        return metrics, ok, grad_norm

    def _loss_inputs(self, batch, mb: PackedMicroBatch, old: dict[int, torch.Tensor], lp: torch.Tensor):
        """The micro-batch's old and rollout logprobs, loss mask and advantages, in `lp`'s [rows, tokens]
        layout and on its device (old logprobs exist on the last pipeline stage only)."""
        old_rows, roll_rows, mask = torch.zeros(lp.shape), torch.zeros(lp.shape), torch.zeros(lp.shape)
        for i, r in enumerate(mb.rows):
            k = batch.response_lengths[r]
            if k == 0:
                continue
            old_rows[i, :k] = old[r] if self.is_last_stage else 0.0
            roll_rows[i, :k] = torch.as_tensor(batch.rollout_logprobs[r], dtype=torch.float32)
            mask[i, :k] = float(batch.response_loss_mask[r])
        adv = batch.advantages[mb.rows].float()
        dev = lp.device
        return old_rows.to(dev), roll_rows.to(dev), mask.to(dev), adv.to(dev)

    @staticmethod
    def _loss_metrics(loss: torch.Tensor, ent_mean: torch.Tensor, metrics: dict) -> dict[str, float]:
        """One micro-batch's contribution to the step's actor/* metrics (summed over micro-batches)."""
        return {
            "actor/pg_loss": float(loss),
            "actor/entropy": float(ent_mean),
            "actor/pg_clipfrac_upper": float(metrics["clipfrac_upper"]),
            "actor/pg_clipfrac_lower": float(metrics["clipfrac_lower"]),
            "actor/pg_clipfrac_dual": float(metrics["clipfrac_dual"]),
            "actor/approx_kl": float(metrics["approx_kl"]),
            "actor/ratio_mean": float(metrics["ratio_mean"]),
        }

    def _reduce_metrics(self, sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
        """Metrics of the last pipeline stage, summed over micro-batches, averaged over DP, on every rank."""
        keys = sorted(sums)
        keys_all: list = [None] * dist.get_world_size()
        dist.all_gather_object(keys_all, keys if self.is_last_stage else [])
        keys = sorted({k for ks in keys_all for k in ks})
        vec = torch.tensor([sums.get(k, 0.0) if self.is_last_stage else 0.0 for k in keys], dtype=torch.float64)
        mx = torch.tensor([maxima.get(k, 0.0) for k in _MAX_METRICS], dtype=torch.float64)
        if vec.numel():
            dist.all_reduce(vec)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        # Every TP (and CP) rank of a last stage holds the same values: average over the
        # world / pp last-stage ranks, i.e. over DP.
        vec /= dist.get_world_size() // self.pp_size
        out = dict(zip(keys, vec.tolist()))
        out.update(zip(_MAX_METRICS, mx.tolist()))
        return out

    def _optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
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
            self.optimizer_steps += 1
        return bool(ok), float(grad_norm if grad_norm is not None else norm)

    # ---------------------------------------------------------------- checkpoints and weights
    def _sharded_state_dict(self, is_loading: bool = False, metadata: dict | None = None):
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
            "actor": {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps},
        }

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer and lr schedule in megatron-core dist_checkpointing (torch_dist) format.
        Collective. `path` must not hold a checkpoint; the caller renames it into place."""
        from megatron_dapo.trainer.checkpoint import megatron_save

        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        megatron_save(self._sharded_state_dict(), path)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Load what :meth:`save_checkpoint` wrote (any data- or context-parallel size; same TP/PP/EP). Collective."""
        from megatron.core import dist_checkpointing

        if not os.path.isdir(path):
            raise FileNotFoundError(f"actor checkpoint {path} does not exist")
        from megatron_dapo.bridge.layer_layout import sharded_state_dict_metadata

        self._materialize_optimizer_state()
        # Checkpoints of all-MoE models saved before they were built stacked hold per-layer keys.
        meta = sharded_state_dict_metadata([m.module for m in self.model], path)
        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True, metadata=meta), path)
        for i, m in enumerate(self.model):
            load_model_state(m.module, state["model" if len(self.model) == 1 else f"model{i}"])
        with torch.no_grad():  # the fp32 main params are views of the model's leaf parameters
            self.optimizer.load_state_dict(state["optimizer"])
        self._restore_adam_steps()
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["actor"]["optimizer_steps"])
        self.skipped_steps = int(state["actor"]["skipped_steps"])

    def _materialize_optimizer_state(self) -> None:
        """Give every parameter an (empty) Adam state before loading one.

        A fresh optimizer has no state until its first step, and megatron-core 0.16.1's distributed
        optimizer reads each state's `step` to build the sharded state dict it loads into (its
        init_state_fn sets exp_avg / exp_avg_sq only): the torch Adam used without TE / apex
        would fail there.
        """
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in inner:
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

    def _restore_adam_steps(self) -> None:
        """Torch Adam's per-parameter `step` after a load.

        Without TE / apex, megatron-core keeps Adam's step in the param groups of the checkpoint and
        re-applies it before loading the parameter states, and that load then overwrites it with the
        placeholder of the state it loads into: set it from the param groups again.
        """
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            torch_opt = getattr(opt, "optimizer", None)
            for group in getattr(torch_opt, "param_groups", []):
                if "step" not in group:
                    continue
                for p in group["params"]:
                    torch_opt.state[p]["step"] = torch.tensor(float(group["step"]))

    def export_weights(self, byte_budget: int | None = None, dst_rank=0) -> Iterator:
        """`(hf_name, full tensor or None)` pairs for the weight sync (see bridge.export_hf_weights; its
        plan is agreed by all ranks here, not at the first item)."""
        from megatron_dapo.bridge import export_hf_weights

        return export_hf_weights(self.model, byte_budget=byte_budget, dst_rank=dst_rank)

    def export_sources(self) -> list[int]:
        """The ranks that rebuild HF tensors (collective; see bridge.export_sources)."""
        from megatron_dapo.bridge import export_sources

        return export_sources(self.model)
