"""The DAPO step, once, over any training engine (trainer/engine.py): logprob recompute and policy updates.

One `DapoStep` per trainer rank, built after the process groups exist (`build_actor` in
trainer/actor.py picks the engine by `trainer.backend`):

    actor = DapoStep(MegatronEngine(cfg), cfg)      # or FSDPEngine(cfg)
    old = actor.compute_logprobs(batch)             # list of [response_len] fp32 tensors, every rank
    metrics = actor.train_step(shard)               # dict of floats (same on every rank)
    actor.save_checkpoint(dir); actor.load_checkpoint(dir)   # the engine's model + optimizer + schedule
    for name, tensor in actor.export_weights(): ... # HF names, full tensors on rank 0 (collective)

`batch` is a `megatron_dapo.types.RolloutBatch`; a train step takes this rank's `DPShard` of it (or the
whole batch, the same on every rank, and cuts it the same way, `megatron_dapo.shards`). A train step:

1. the old-policy logprobs of the rank's rows are recomputed with the current weights (no grad);
2. for each of `ppo_epochs` epochs, for each mini-batch of `ppo_mini_batch_size` groups: the rows are
   packed into micro-batches by the token budget `algo.max_tokens_per_micro_batch` and the engine's
   packing rules, the engine runs forward / backward with the DAPO loss normalised by the loss-token
   count of the whole mini-batch (all micro-batches, all DP ranks; it comes with the shard), then one
   optimizer step. A non-finite loss or gradient norm skips that step (counted in `actor/skipped_steps`).

The DAPO loss carries the DP factor that the engines' gradient averaging removes, so gradients equal
those of the whole mini-batch as one batch on one process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_dapo.algo.rollout_correction import (
    MISMATCH_TOKEN_METRICS,
    lag_sums,
    mismatch_sums,
    rollout_correction,
)
from megatron_dapo.config.derived import token_sum_norm
from megatron_dapo.kernels.backend import POLICY_LOSS_NAMES, kernel_policy_loss
from megatron_dapo.runtime.hooks import import_function
from megatron_dapo.shards import shard_batch, split_groups_over_ranks
from megatron_dapo.trainer.engine import TrainEngine
from megatron_dapo.trainer.packing import PackedMicroBatch, pack, padded_length, plan_micro_batches
from megatron_dapo.types import DPShard

log = logging.getLogger(__name__)

_MAX_METRICS = ("actor/ratio_max",)
_STATE_KEY = "actor"  # the step's counters in the engine's checkpoint
_LAG_PREFIX = "actor/_lag"  # per-lag sums, turned into ratios by per_lag_metrics


def per_lag_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """`actor/mismatch_k3_lag{k}` and `actor/mismatch_token_rejected_frac_lag{k}` (over the tokens of lag k)
    from the reduced per-lag sums, which leave the dict."""
    out = {k: v for k, v in metrics.items() if not k.startswith(_LAG_PREFIX)}
    for key, n in metrics.items():
        if key.startswith(_LAG_PREFIX) and key.endswith("/tokens") and n > 0:
            lag = key[len(_LAG_PREFIX) : -len("/tokens")]
            out[f"actor/mismatch_k3_lag{lag}"] = metrics[f"{_LAG_PREFIX}{lag}/k3"] / n
            out[f"actor/mismatch_token_rejected_frac_lag{lag}"] = metrics[f"{_LAG_PREFIX}{lag}/rejected"] / n
    return out


def dapo_loss_options(cfg) -> dict:
    """The config's keyword arguments of the policy loss (the same for every micro-batch).

    token_sum_norm is a constant (algo.loss_scale_factor or data.max_response_length): left unset,
    seq-mean-token-sum-norm would divide by each micro-batch's padded width instead. The clip range is
    the variant's own (algo.gspo / algo.cispo for those; CISPO has no dual clip). rollout_is_cap is None:
    the rollout correction hands the loss finished weights (megatron_dapo.algo.rollout_correction)."""

    algo = cfg.algo
    low, high, dual = algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c
    if algo.policy_loss == "gspo":
        low, high = algo.gspo.clip_ratio_low, algo.gspo.clip_ratio_high
    elif algo.policy_loss == "cispo":
        low, high, dual = algo.cispo.clip_ratio_low, algo.cispo.clip_ratio_high, None
    return dict(
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=dual,
        loss_agg_mode=algo.loss_agg_mode,
        token_sum_norm=token_sum_norm(cfg),
        rollout_is_cap=None,
    )


def policy_loss_fn(cfg):
    """The policy loss of algo.policy_loss: a built-in through the kernel dispatcher, or the user's
    `module:function` (called with dapo_policy_loss's arguments, returning (loss, metrics))."""
    name = cfg.algo.policy_loss
    if name in POLICY_LOSS_NAMES:
        return functools.partial(kernel_policy_loss, name)
    return import_function(name, "algo.policy_loss")


def correction_options(cfg) -> dict:
    """The keyword arguments of `rollout_correction` from algo.rollout_correction."""
    rc = cfg.algo.rollout_correction
    geo = rc.geo_reject
    return dict(
        mode=rc.mode,
        lower=rc.lower,
        upper=rc.upper,
        geo_lower=geo.lower if geo.enable else None,
        geo_upper=geo.upper if geo.enable else None,
    )


class DapoStep:
    def __init__(self, engine: TrainEngine, cfg):
        self.engine, self.cfg = engine, cfg
        self.max_tokens = cfg.algo.max_tokens_per_micro_batch or (
            cfg.data.max_prompt_length + cfg.data.max_response_length
        )
        self.optimizer_steps = 0
        self.skipped_steps = 0

    @property
    def layout(self):
        return self.engine.layout

    @property
    def arch(self):
        return self.engine.arch

    @property
    def replay(self):
        return self.engine.replay

    # ---------------------------------------------------------------- packing
    def _packs(self, batch, rows: list[int]) -> list[PackedMicroBatch]:
        """Rows packed by the token budget and the engine's rules; the same micro-batch count on every DP rank."""
        rules, group = self.engine.packing, self.layout.dp_group
        lengths = [padded_length(len(batch.input_ids[r]), rules.seq_multiple) for r in rows]
        count = torch.tensor([len(plan_micro_batches(lengths, self.max_tokens))], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        count = padded_length(int(count), rules.count_multiple)
        plan = plan_micro_batches(lengths, self.max_tokens, min_count=count)
        length = None
        if rules.same_length:
            longest = torch.tensor([max([1] + [sum(lengths[i] for i in b) for b in plan])], dtype=torch.long)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
            length = padded_length(int(longest), rules.pad_multiple)
        return [
            pack(
                batch.input_ids,
                batch.prompt_lengths,
                [rows[i] for i in b],
                length,
                rules.pad_multiple,
                seq_multiple=rules.seq_multiple,
            )
            for b in plan
        ]

    def _split(self, batch, rows: list[int]) -> list[list[int]]:
        """`rows` over the DP ranks by whole groups, balancing tokens."""
        groups = batch.group_index.tolist()
        chosen = sorted({groups[r] for r in rows})
        tokens = [len(x) for x in batch.input_ids]
        keep = set(rows)
        per_rank = split_groups_over_ranks(groups, tokens, chosen, self.layout.dp)
        return [[r for r in rs if r in keep] for rs in per_rank]

    # ---------------------------------------------------------------- logprobs
    @torch.no_grad()
    def _local_logprobs(self, batch, rows: list[int], measure_routing: bool = False) -> dict[int, torch.Tensor]:
        """{row: [response_len] fp32 logprobs} for `rows` (filled on the last pipeline stage only). A batch
        carrying routed experts is replayed (R3); `measure_routing` also counts where the trainer's own
        router agrees with them (actor/routing_agreement)."""
        out: dict[int, torch.Tensor] = {}

        def collect(mb: PackedMicroBatch, lp_pos: torch.Tensor, _entropy) -> None:
            lp = mb.gather(lp_pos.float())
            for i, r in enumerate(mb.rows):
                out[r] = lp[i, : int(mb.target_valid[i].sum())].cpu()

        replay = self.replay
        measure = measure_routing and replay is not None and batch.routed_experts is not None
        with replay.measuring_agreement() if measure else contextlib.nullcontext():
            self.engine.forward_backward(
                self._packs(batch, rows),
                collect,
                forward_only=True,
                temperature=batch.temperature,
                with_entropy=False,
                batch=batch,
            )
        return out

    def compute_logprobs(self, batch, rows: list[int] | None = None) -> list[torch.Tensor]:
        """Logprobs of every response token under the current weights (temperature-scaled as
        `batch.temperature`), for `rows` (default: all), returned on every rank. Collective. With
        routing replay on, a batch that carries routed experts is routed as they say; one that carries
        none (the weight-sync probe) is routed by the trainer's own routers."""
        rows = list(range(batch.num_samples)) if rows is None else list(rows)
        mine = self._split(batch, rows)[self.layout.dp_rank]
        local = self._local_logprobs(batch, mine)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local if self.layout.is_last_stage else {})
        merged: dict[int, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return [merged[r] for r in rows]

    # ---------------------------------------------------------------- training
    def train_step(self, data) -> dict[str, float]:
        """One trainer step. Collective. `data`: this rank's `DPShard` of the step batch (as the
        coordinator hands it out), or the whole `RolloutBatch` (the same on every rank; cut here)."""
        algo, layout = self.cfg.algo, self.layout
        if isinstance(data, DPShard):
            if (data.dp_rank, data.dp_size) != (layout.dp_rank, layout.dp):
                raise ValueError(
                    f"shard of DP rank {data.dp_rank}/{data.dp_size} given to DP rank {layout.dp_rank}/{layout.dp}"
                )
            shard = data
        else:
            self._check_batch(data)
            shard = shard_batch(data, layout.dp, algo.ppo_mini_batch_size)[layout.dp_rank]
        batch = shard.batch
        self._check_batch(batch)
        if algo.rollout_correction.bypass:
            # the rollout's logprobs stand for the old policy: one forward pass less per step
            old = {r: torch.as_tensor(batch.rollout_logprobs[r], dtype=torch.float32) for r in range(batch.num_samples)}
        else:  # the old policy's logprobs for all of this rank's rows, before any update
            old = self._local_logprobs(batch, list(range(batch.num_samples)), measure_routing=True)
        totals: dict[str, float] = {}
        maxima: dict[str, float] = {}
        n_steps = skipped = 0
        grad_norms = []
        for _epoch in range(algo.ppo_epochs):
            for mine, counts in zip(shard.mini_batches, shard.mini_batch_counts):
                lr = self.engine.current_lr()  # the lr this step applies (the scheduler moves after it)
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
        # per-lag ratios from the sums of every mini-batch (a lag may be absent from some)
        out = per_lag_metrics({k: v / n_steps for k, v in totals.items()})
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
        packs = self._packs(batch, rows)
        sums: dict[str, float] = {}
        maxima: dict[str, float] = {}
        loss_fn = self._loss_fn(batch, old, counts, sums, maxima)
        self.engine.zero_grad()
        self.engine.forward_backward(
            packs, loss_fn, forward_only=False, temperature=batch.temperature, with_entropy=True, batch=batch
        )
        metrics = self._reduce_metrics(sums, maxima)
        loss_finite = math.isfinite(metrics.get("actor/pg_loss", 0.0))
        ok, grad_norm = self.engine.optimizer_step(loss_finite)
        if ok:
            self.optimizer_steps += 1
        else:
            log.warning("optimizer step skipped: loss %s, grad norm %s", metrics.get("actor/pg_loss"), grad_norm)
        metrics["actor/nonfinite_loss"] = 0.0 if loss_finite else 1.0
        return metrics, ok, grad_norm

    def _loss_fn(self, batch, old: dict[int, torch.Tensor], counts: tuple[int, int], sums: dict, maxima: dict):
        """The mini-batch's loss function (trainer/engine.py's LossFn); it adds each micro-batch's
        metrics into `sums` and `maxima`."""
        algo, dp = self.cfg.algo, self.layout.dp
        loss_options = dapo_loss_options(self.cfg)
        loss_of = policy_loss_fn(self.cfg)
        correct = correction_options(self.cfg)
        bypass = algo.rollout_correction.bypass
        # The exact global normalisers of the mini-batch (loss tokens / sequences over every
        # micro-batch of every DP rank), known before the first backward: they come with the shard.
        global_tokens, global_seqs = float(counts[0]), float(counts[1])

        def loss_fn(mb: PackedMicroBatch, lp_pos: torch.Tensor, ent_pos: torch.Tensor) -> torch.Tensor:
            if not mb.rows:  # all padding (this rank has fewer micro-batches than others): no loss
                return lp_pos.sum() * 0.0
            lp = mb.gather(lp_pos.float())
            old_rows, roll_rows, mask, adv = self._loss_inputs(batch, mb, old, lp)
            # bypass: the old policy is the rollout's, so the correction weighs the current policy against it
            behaviour = lp.detach() if bypass else old_rows
            correction = rollout_correction(behaviour - roll_rows, mask, **correct)
            loss, metrics = loss_of(
                lp,
                old_rows,
                adv,
                mask,
                global_num_tokens=max(global_tokens, 1.0),
                rollout_is_weights=correction.weights,
                global_num_seqs=max(global_seqs, 1.0),
                dp_world_size=dp,
                **loss_options,
            )
            ent = mb.gather(ent_pos.float())
            # Token-mean entropy over the mini-batch, with the same global normalisation as the loss.
            ent_mean = (ent * mask).sum() * dp / max(global_tokens, 1.0)
            if algo.entropy_coeff:
                loss = loss - algo.entropy_coeff * ent_mean
            with torch.no_grad():
                add = self._loss_metrics(loss, ent_mean, metrics)
                per_token = dp / max(global_tokens, 1.0)
                per_seq = dp / max(global_seqs, 1.0)
                # with routing replay on and off alike: how far the trainer's old logprobs are from the rollout's
                add["actor/train_rollout_logprob_abs_diff"] = (
                    float(((old_rows - roll_rows).abs() * mask).sum()) * per_token
                )
                if correction.weights is not None:
                    add["actor/rollout_corr_weight_mean"] = float((correction.weights * mask).sum()) * per_token
                for k, v in mismatch_sums(behaviour, roll_rows, mask, correction).items():
                    add[f"actor/mismatch_{k}"] = v * (per_token if k in MISMATCH_TOKEN_METRICS else per_seq)
                # per weight-version lag: numerator and token count, divided after the DP reduction
                for lag, (n, k3, rejected) in lag_sums(
                    behaviour, roll_rows, mask, correction, self._token_lags(batch, mb, lp)
                ).items():
                    add[f"{_LAG_PREFIX}{lag}/tokens"] = n
                    add[f"{_LAG_PREFIX}{lag}/k3"] = k3
                    add[f"{_LAG_PREFIX}{lag}/rejected"] = rejected
                for k, v in add.items():
                    sums[k] = sums.get(k, 0.0) + v
                ratio_max = float(metrics.get("ratio_max", 0.0)) if metrics.get("num_tokens", 1) > 0 else 0.0
                maxima["actor/ratio_max"] = max(maxima.get("actor/ratio_max", 0.0), ratio_max)
            return loss  # this micro-batch's exact share of the mini-batch loss

        return loss_fn

    @staticmethod
    def _token_lags(batch, mb: PackedMicroBatch, lp: torch.Tensor) -> torch.Tensor:
        """[rows, tokens] (lp's layout and device) weight versions between each response token's generating
        weights and this step's (-1 on padding)."""
        lags = torch.full(lp.shape, -1, dtype=torch.long)
        for i, r in enumerate(mb.rows):
            v = batch.token_versions[r]
            lags[i, : len(v)] = batch.step - torch.as_tensor(v, dtype=torch.long)
        return lags.to(lp.device)

    def _loss_inputs(self, batch, mb: PackedMicroBatch, old: dict[int, torch.Tensor], lp: torch.Tensor):
        """The micro-batch's old and rollout logprobs, loss mask and advantages, in `lp`'s [rows, tokens]
        layout and on its device (old logprobs exist on the last pipeline stage only)."""
        old_rows, roll_rows, mask = torch.zeros(lp.shape), torch.zeros(lp.shape), torch.zeros(lp.shape)
        for i, r in enumerate(mb.rows):
            k = batch.response_lengths[r]
            if k == 0:
                continue
            old_rows[i, :k] = old[r] if self.layout.is_last_stage else 0.0
            roll_rows[i, :k] = torch.as_tensor(batch.rollout_logprobs[r], dtype=torch.float32)
            mask[i, :k] = float(batch.response_loss_mask[r])
        adv = batch.advantages[mb.rows].float()
        dev = lp.device
        return old_rows.to(dev), roll_rows.to(dev), mask.to(dev), adv.to(dev)

    @staticmethod
    def _loss_metrics(loss: torch.Tensor, ent_mean: torch.Tensor, metrics: dict) -> dict[str, float]:
        """One micro-batch's contribution to the step's actor/* metrics (summed over micro-batches); a
        custom policy loss may leave metrics out (0)."""
        out = {"actor/pg_loss": float(loss), "actor/entropy": float(ent_mean)}
        for key, name in (
            ("clipfrac_upper", "pg_clipfrac_upper"),
            ("clipfrac_lower", "pg_clipfrac_lower"),
            ("clipfrac_dual", "pg_clipfrac_dual"),
            ("approx_kl", "approx_kl"),
            ("ratio_mean", "ratio_mean"),
        ):
            out[f"actor/{name}"] = float(metrics.get(key, 0.0))
        return out

    def _reduce_metrics(self, sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
        """Metrics of the last pipeline stage, summed over micro-batches, averaged over DP, on every rank."""
        last = self.layout.is_last_stage
        keys_all: list = [None] * dist.get_world_size()
        dist.all_gather_object(keys_all, sorted(sums) if last else [])
        keys = sorted({k for ks in keys_all for k in ks})
        vec = torch.tensor([sums.get(k, 0.0) if last else 0.0 for k in keys], dtype=torch.float64)
        mx = torch.tensor([maxima.get(k, 0.0) for k in _MAX_METRICS], dtype=torch.float64)
        if vec.numel():
            dist.all_reduce(vec)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        # Every TP (and CP) rank of a last stage holds the same values: average over the
        # world / pp last-stage ranks, i.e. over DP.
        vec /= dist.get_world_size() // self.layout.pp
        out = dict(zip(keys, vec.tolist()))
        out.update(zip(_MAX_METRICS, mx.tolist()))
        return out

    # ---------------------------------------------------------------- checkpoints and weights
    def save_checkpoint(self, path: str) -> None:
        """The engine's model, optimizer and lr schedule, and this step's counters. Collective. `path`
        must not hold a checkpoint; the caller renames it into place."""
        self.engine.save_checkpoint(path, {_STATE_KEY: self._counters()})

    def load_checkpoint(self, path: str) -> None:
        """Load what :meth:`save_checkpoint` wrote (the engine says which layouts it reshards to). Collective."""
        state = self.engine.load_checkpoint(path, {_STATE_KEY: self._counters()})[_STATE_KEY]
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def _counters(self) -> dict[str, int]:
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps}

    def export_weights(self, byte_budget: int | None = None, dst_rank=0) -> Iterator:
        """`(hf_name, full tensor or None)` pairs for the weight sync (TrainEngine.export_hf_weights)."""
        return self.engine.export_hf_weights(byte_budget=byte_budget, dst_rank=dst_rank)

    def export_sources(self) -> list[int]:
        """The ranks that rebuild HF tensors (collective; TrainEngine.export_sources)."""
        return self.engine.export_sources()
