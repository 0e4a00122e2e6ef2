"""DapoStep over the Megatron engine: checks under torchrun (2 ranks), against Hugging Face models of the same weights.

Usage: actor_checks.py CHECK[,CHECK...] TMPDIR
  logprobs_tp2, logprobs_pp2: compute_logprobs equals HF logprobs (< 1e-5), packed equals unpacked
  train_dp2: DP=2 x uneven packed micro-batches gives the update of one big batch on one process
             (HF model + the DAPO loss + torch AdamW), a non-finite loss skips the step, and a
             torch_dist checkpoint restores model + optimizer (the next step matches).
  shards:    a DP=2 step fed each rank's shard (cut by shard_batch, scattered from rank 0 as the
             loop does) equals, bit for bit, the same step fed the whole batch (two mini-batches).
  sum_norm:  the same with seq-mean-token-sum-norm: micro-batches of any padded width divide by
             data.max_response_length, as the one-process reference does.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from forced_routing import forced_routing, random_routing

from megatron_dapo.config.schema import DapoConfig, GeoRejectConfig, RolloutCorrectionConfig
from megatron_dapo.models.tiny import save_tiny_hf_model
from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
from megatron_dapo.trainer.actor import build_actor
from megatron_dapo.types import RolloutBatch

LR, EPS, CLIP = 1e-3, 1e-4, 0.5


def log(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def make_config(hf_dir, tp=1, pp=1, ep=1, cp=1, etp=None, vpp=None, sp=False, **algo) -> DapoConfig:
    cfg = DapoConfig()
    cfg.model.hf_path = str(hf_dir)
    cfg.model.dtype = "fp32"
    cfg.model.transformer_impl = "local"
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp = tp, pp, ep, cp
    cfg.parallel.etp, cfg.parallel.vpp, cfg.parallel.sequence_parallel = etp, vpp, sp
    cfg.optimizer.lr = LR
    cfg.optimizer.adam_eps = EPS  # see tests/workers/runtime_parallel.py: keeps Adam sensitive to grad scale
    cfg.optimizer.clip_grad = CLIP
    cfg.optimizer.weight_decay = 0.1
    cfg.optimizer.lr_warmup_steps = 0
    cfg.trainer.total_steps = 10
    cfg.data.max_prompt_length, cfg.data.max_response_length = 16, 32
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    return cfg


def make_batch(seed: int, n_groups: int = 3, group_size: int = 2, temperature: float = 1.0) -> RolloutBatch:
    """Uneven prompts and responses; rollout logprobs = a perturbed copy filled in later."""
    g = torch.Generator().manual_seed(seed)
    ids, plen, rlen = [], [], []
    for _ in range(n_groups * group_size):
        p = int(torch.randint(2, 9, (1,), generator=g))
        r = int(torch.randint(1, 14, (1,), generator=g))
        ids.append(torch.randint(0, 256, (p + r,), generator=g).tolist())
        plen.append(p)
        rlen.append(r)
    n = len(ids)
    return RolloutBatch(
        input_ids=ids,
        prompt_lengths=plen,
        response_lengths=rlen,
        advantages=torch.randn(n, generator=g),
        rollout_logprobs=[[0.0] * r for r in rlen],
        response_loss_mask=[0 if i == 1 else 1 for i in range(n)],  # one overlong-filtered sample
        token_versions=[[0] * r for r in rlen],
        group_index=torch.arange(n_groups).repeat_interleave(group_size),
        temperature=temperature,
        step=0,
        prompt_indices=list(range(n_groups)),
    )


def hf_logprobs(hf_model, batch: RolloutBatch, agreement: list | None = None) -> list[torch.Tensor]:
    """Each sequence alone through the HF model, float64 log-softmax of logits / temperature (routed as
    the batch's routed experts say, if it carries them; `agreement` then gets the share of their
    token-layer top-k sets HF's own gates choose too)."""
    out = []
    with torch.no_grad(), forced_routing(hf_model, batch) as route:
        for i, (seq, p) in enumerate(zip(batch.input_ids, batch.prompt_lengths)):
            route.use(i)
            logits = hf_model(torch.tensor([seq])).logits[0].double() / batch.temperature
            lp = torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, torch.tensor(seq[p:])[:, None])[:, 0]
            out.append(lp.float())
    if agreement is not None and route.compared:
        agreement.append(route.agree / route.compared)
    return out


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b], "response lengths differ"
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def check_logprobs(hf_dir, tp, pp, ep=1, temperatures=(1.0, 0.7)):
    from transformers import AutoModelForCausalLM

    init_model_parallel(tp=tp, pp=pp, ep=ep, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for temperature in temperatures:
        batch = make_batch(seed=3, temperature=temperature)
        want = hf_logprobs(hf, batch)
        cfg = make_config(hf_dir, tp=tp, pp=pp, ep=ep, max_tokens_per_micro_batch=64)
        actor = build_actor(cfg)
        packed = actor.compute_logprobs(batch)
        err = max_err(packed, want)
        log(f"tp={tp} pp={pp} ep={ep} T={temperature}: actor (packed, budget 64) vs HF logprobs max abs err {err:.2e}")
        assert err < 1e-5, err
        actor.max_tokens = 1  # every sequence alone in its micro-batch
        alone = actor.compute_logprobs(batch)
        err2 = max_err(packed, alone)
        log(f"tp={tp} pp={pp} ep={ep} T={temperature}: packed vs unpacked max abs err {err2:.2e}")
        assert err2 < 3e-6, err2  # float32 rounding of different matmul shapes (logprobs ~ -5.5)
        actor.max_tokens = 10_000  # everything in one micro-batch
        one = actor.compute_logprobs(batch)
        assert max_err(one, want) < 1e-5
    # Packing really packed: the budget-64 plan put several sequences together ...
    rows = list(range(batch.num_samples))
    actor.max_tokens = 64
    packs = actor._packs(batch, actor._split(batch, rows)[actor.layout.dp_rank])
    assert any(len(p.rows) > 1 for p in packs), [p.rows for p in packs]
    # ... and inside per_sequence_rope the model's RoPE table follows the per-sequence positions.
    from megatron_dapo.bridge.parallel import unwrap_model
    from megatron_dapo.trainer.packing import per_sequence_rope

    mb = max(packs, key=lambda p: len(p.rows))
    rope = unwrap_model(actor.engine.model[0]).rotary_pos_emb
    full = type(rope).get_emb(rope, mb.length)
    with per_sequence_rope(actor.engine.model[0], mb.position_ids):
        table = rope(mb.length)
    assert torch.equal(table, full[mb.position_ids[0]]) and not torch.equal(table, full)
    assert torch.equal(rope(mb.length), full)  # restored on exit


# ------------------------------------------------------------------------------- training
def reference_update(hf_dir, batch: RolloutBatch, cfg: DapoConfig, agreement: list | None = None):
    """One optimizer step on the whole batch on one process: HF model, the DAPO loss, torch AdamW."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.algo import POLICY_LOSSES, rollout_correction

    a = cfg.algo
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    old = hf_logprobs(model.eval(), batch, agreement)
    n, width = batch.num_samples, max(batch.response_lengths)
    lp = []
    with forced_routing(model, batch) as route:
        for i, (seq, p) in enumerate(zip(batch.input_ids, batch.prompt_lengths)):
            route.use(i)
            logits = model(torch.tensor([seq])).logits[0] / batch.temperature
            row = torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, torch.tensor(seq[p:])[:, None])[:, 0]
            lp.append(torch.nn.functional.pad(row, (0, width - row.numel())))
    lp = torch.stack(lp)
    old_rows, roll, mask = torch.zeros(n, width), torch.zeros(n, width), torch.zeros(n, width)
    for i in range(n):
        k = batch.response_lengths[i]
        old_rows[i, :k], roll[i, :k] = old[i], torch.tensor(batch.rollout_logprobs[i])
        mask[i, :k] = batch.response_loss_mask[i]
    # the policy loss and clip range of algo.policy_loss, the weights of algo.rollout_correction
    low, high, dual = a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c
    if a.policy_loss == "gspo":
        low, high = a.gspo.clip_ratio_low, a.gspo.clip_ratio_high
    elif a.policy_loss == "cispo":
        low, high, dual = a.cispo.clip_ratio_low, a.cispo.clip_ratio_high, None
    rc, geo = a.rollout_correction, a.rollout_correction.geo_reject
    bounds = (geo.lower, geo.upper) if geo.enable else (None, None)
    if rc.bypass:  # the rollout's logprobs are the old policy; the correction weighs the current one against them
        old_rows, behaviour = roll.clone(), lp.detach()
    else:
        behaviour = old_rows
    w = rollout_correction(behaviour - roll, mask, rc.mode, rc.lower, rc.upper, *bounds).weights
    # token_sum_norm: the one constant divisor of seq-mean-token-sum-norm (ignored by the other modes)
    loss, _ = POLICY_LOSSES[a.policy_loss](
        lp,
        old_rows,
        batch.advantages.float(),
        mask,
        low,
        high,
        dual,
        a.loss_agg_mode,
        None,
        w,
        rollout_is_cap=None,
        token_sum_norm=cfg.data.max_response_length,
    )
    loss.backward()
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.ndim > 1]
    no_decay = [p for p in params.values() if p.ndim <= 1]
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP).item()
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.999),
        eps=EPS,
    )
    opt.step()
    return loss.item(), norm, on_disk_state(model), old


def on_disk_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (transformers 5 fuses MoE experts in memory
    and splits them per expert on save): save it and read the files back."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(f))
    return out


def exported(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.export_weights(dst_rank=None)}


@contextlib.contextmanager
def counting_replay_actions():
    """Counts megatron-core RouterReplay top-k calls by action (a spy on the class, removed on exit)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    counts: dict = {}
    original = RouterReplay.get_replay_topk

    def spy(self, *args, **kwargs):
        action = getattr(self.router_replay_action, "value", None)
        counts[action] = counts.get(action, 0) + 1
        return original(self, *args, **kwargs)

    RouterReplay.get_replay_topk = spy
    try:
        yield counts
    finally:
        RouterReplay.get_replay_topk = original


def check_exact_update(
    hf_dir, ep=1, seed=5, replay_seed=None, recompute=False, pp=1, cp=1, parallel: dict | None = None, **algo
):
    """DP=2 (EP=ep; or CP=cp) x uneven packed micro-batches == one big batch on one process. Returns the actor.
    With `replay_seed` (routing replay, R3) the batch carries random routed experts and the HF reference
    is forced to route as they say; `recompute` recomputes whole layers in backward (REPLAY_BACKWARD).
    `parallel`: further sizes (tp, etp, vpp; sp = sequence parallel)."""
    par = dict(parallel or {})
    sp = par.pop("sp", False)
    init_model_parallel(ep=ep, pp=pp, cp=cp, seed=1, **par)  # DP=2 (pp=1), or DP=1 x CP=2 (or x TP=2)
    # Token budget 24 with responses up to 13 + prompts up to 8: several uneven micro-batches per rank.
    cfg = make_config(
        hf_dir,
        ep=ep,
        pp=pp,
        cp=cp,
        sp=sp,
        **par,
        max_tokens_per_micro_batch=24,
        ppo_mini_batch_size=3,
        train_batch_size=3,
        **algo,
    )
    cfg.model.moe_aux_loss_coeff = 0.0  # the reference computes the policy loss only
    if recompute:
        cfg.model.recompute_granularity = "full"
    batch = make_batch(seed=seed)
    g = torch.Generator().manual_seed(9)
    actor = build_actor(cfg)
    if replay_seed is not None:
        shape = actor.replay.shape
        batch.routed_experts = random_routing(batch, len(shape.moe_layers), shape.num_experts, shape.top_k, replay_seed)
    old = actor.compute_logprobs(batch)
    # Rollout logprobs a little off the trainer's: the truncated IS weights enter the loss.
    batch.rollout_logprobs = [(o + 0.3 * torch.randn(o.shape, generator=g)).tolist() for o in old]
    agreement: list = []
    ref_loss, ref_norm, ref_params, ref_old = reference_update(hf_dir, batch, cfg, agreement)
    assert max_err(old, ref_old) < 1e-5
    rows = actor._split(batch, list(range(batch.num_samples)))[actor.layout.dp_rank]
    packs = actor._packs(batch, rows)
    log(f"dp rank 0 rows {rows}: micro-batches {[p.rows for p in packs]} lengths {[p.length for p in packs]}")
    assert len(packs) >= 2, "the exactness check needs several micro-batches per rank"
    before = exported(actor)
    with counting_replay_actions() as actions:
        metrics = actor.train_step(batch)
    after = exported(actor)
    if replay_seed is not None and recompute:  # the recompute in backward replayed (REPLAY_BACKWARD)
        assert actions.get("replay_backward", 0) > 0, actions
    log(f"train step metrics: {metrics}")
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/optimizer_steps"] == 1
    if replay_seed is not None:
        # the trainer's own routers, at the replayed inputs, choose what HF's own gates choose there
        assert math.isclose(metrics["actor/routing_agreement"], agreement[0], abs_tol=1e-9), (metrics, agreement)
        assert 0 < agreement[0] < 1 and metrics["actor/routing_replay_bytes"] > 0, (agreement, metrics)
    assert math.isclose(metrics["actor/pg_loss"], ref_loss, rel_tol=1e-5, abs_tol=1e-7), (metrics, ref_loss)
    assert math.isclose(metrics["actor/grad_norm"], ref_norm, rel_tol=1e-5), (metrics["actor/grad_norm"], ref_norm)
    worst, worst_rel = 0.0, 0.0
    for name, want in ref_params.items():
        got = after[name]
        delta_ref = (want - before[name]).abs().max().item()
        err = (got - want).abs().max().item()
        worst = max(worst, err)
        if delta_ref > 0:
            worst_rel = max(worst_rel, err / delta_ref)
        assert err <= 1e-6 + 1e-5 * want.abs().max().item(), f"{name}: update differs by {err:.2e}"
    moved = max((after[k] - before[k]).abs().max().item() for k in after)
    log(
        f"DP={actor.layout.dp} (EP={ep}, CP={cp}, PP={pp} {par}) packed update vs one-process HF reference: "
        f"loss {metrics['actor/pg_loss']:.6f} vs {ref_loss:.6f}, "
        f"grad norm {metrics['actor/grad_norm']:.6f} vs {ref_norm:.6f}, params max abs err {worst:.2e} "
        f"(max |update| {moved:.2e}, worst err / update {worst_rel:.2e})"
    )
    assert moved > 1e-4, "the step should move the parameters"
    return actor, cfg, batch, after


def check_variants(hf_dir):
    """GSPO with a sequence-level correction and geometric rejection, CISPO with IcePop: DP=2 x uneven
    micro-batches == one big batch on one process, as for DAPO."""
    check_exact_update(
        hf_dir,
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-mean",
        rollout_correction=RolloutCorrectionConfig(
            mode="seq_tis", upper=2.0, geo_reject=GeoRejectConfig(enable=True, lower=0.8, upper=1.25)
        ),
    )
    check_exact_update(
        hf_dir, policy_loss="cispo", rollout_correction=RolloutCorrectionConfig(mode="icepop", lower=0.5, upper=1.5)
    )
    # bypass: the rollout logprobs stand for the old policy, and a step runs no forward-only pass
    actor, _, batch, _ = check_exact_update(
        hf_dir, rollout_correction=RolloutCorrectionConfig(mode="token_tis", upper=2.0, bypass=True)
    )
    calls = []
    original = actor.engine.forward_backward

    def counting(packs, fn, forward_only, **kw):
        calls.append(forward_only)
        return original(packs, fn, forward_only=forward_only, **kw)

    actor.engine.forward_backward = counting
    actor.train_step(batch)
    assert calls and not any(calls), calls
    log(f"bypass: a train step ran {len(calls)} forward-backward passes, none forward-only")


def check_train(hf_dir, tmpdir):
    actor, cfg, batch, after = check_exact_update(hf_dir)

    # A non-finite loss (a NaN advantage) skips the step and says so.
    bad = copy.deepcopy(batch)
    bad.advantages[0] = float("nan")
    m_bad = actor.train_step(bad)
    assert m_bad["actor/skipped_steps"] == 1 and m_bad["actor/optimizer_steps"] == 0, m_bad
    assert m_bad["actor/nonfinite_loss"] == 1.0, m_bad
    unchanged = exported(actor)
    assert all(torch.equal(unchanged[k], after[k]) for k in after), "a skipped step must not touch the weights"
    log(f"non-finite loss: step skipped, weights unchanged (skipped={m_bad['actor/skipped_steps']:.0f})")

    # Checkpoint: save, then a fresh actor (HF weights) loads it; the next step matches exactly.
    check_resume(actor, cfg, after, str(Path(tmpdir) / "actor_ckpt"))


def check_resume(actor, cfg, after, ckpt, resumed_cfg=None, resume_layout=None, tol=0.0):
    """`actor` (whose weights are `after`) saves to `ckpt`; a fresh actor (HF weights) of `resumed_cfg`
    (default: cfg) loads it and holds the same weights, and its next step equals the uninterrupted actor's
    (to `tol`). `resume_layout` (init_model_parallel kwargs) rebuilds the parallel state for the resumed
    actor, after the uninterrupted actor's next step."""
    actor.save_checkpoint(ckpt)
    batch2 = make_batch(seed=6)
    batch2.rollout_logprobs = [o.tolist() for o in actor.compute_logprobs(batch2)]
    m1 = actor.train_step(batch2)
    w1 = exported(actor)
    if resume_layout is not None:
        init_model_parallel(**resume_layout, seed=1)
    restored = build_actor(resumed_cfg or cfg)
    restored.load_checkpoint(ckpt)
    assert all(torch.equal(v, after[k]) for k, v in exported(restored).items())
    m2 = restored.train_step(batch2)
    w2 = exported(restored)
    err = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    moved = max((w1[k] - after[k]).abs().max().item() for k in w1)
    log(
        f"checkpoint round trip {resume_layout or ''}: next-step params max abs diff {err:.2e} "
        f"(update {moved:.1e}), lr {m1['actor/lr']} vs {m2['actor/lr']}"
    )
    assert err <= tol and moved > 1e-4 and m1["actor/lr"] == m2["actor/lr"], (err, m1, m2)
    return w1


def check_warmup(hf_dir):
    init_model_parallel(seed=1)
    cfg = make_config(hf_dir, ppo_mini_batch_size=1, train_batch_size=3)
    cfg.optimizer.lr_warmup_steps = 4
    actor = build_actor(cfg)
    batch = make_batch(seed=7)
    batch.rollout_logprobs = [o.tolist() for o in actor.compute_logprobs(batch)]
    lrs = []
    for _ in range(2):
        m = actor.train_step(batch)  # 3 mini-batches: 3 optimizer steps each
        lrs.append(m["actor/lr"])
    log(f"warm-up lr (mean over the 3 optimizer steps of each train step): {lrs}")
    # megatron-core's linear warm-up: lr_k = lr * k / warmup for optimizer step k = 0, 1, ...; then constant.
    want = [LR * (0 + 1 + 2) / 4 / 3, LR * (3 / 4 + 1 + 1) / 3]
    assert all(math.isclose(x, y) for x, y in zip(lrs, want)), (lrs, want)


def check_shards(hf_dir):
    """Shards, as the coordinator hands them out, give exactly the whole batch's step."""
    from megatron_dapo.shards import data_parallel_ranks, scatter_shards, shard_batch

    init_model_parallel(seed=1)  # DP=2
    cfg = make_config(hf_dir, max_tokens_per_micro_batch=24, ppo_mini_batch_size=2, train_batch_size=4)
    batch = make_batch(seed=11, n_groups=4)
    whole, sharded = build_actor(cfg), build_actor(cfg)
    g = torch.Generator().manual_seed(3)
    batch.rollout_logprobs = [
        (o + 0.3 * torch.randn(o.shape, generator=g)).tolist() for o in whole.compute_logprobs(batch)
    ]
    shards = shard_batch(batch, 2, cfg.algo.ppo_mini_batch_size) if dist.get_rank() == 0 else None
    shard = scatter_shards(shards, data_parallel_ranks(sharded.layout.dp_rank))
    assert 0 < shard.batch.num_samples < batch.num_samples and len(shard.mini_batches) == 2
    got_rows = [None, None]
    dist.all_gather_object(got_rows, [tuple(x) for x in shard.batch.input_ids])
    assert sorted(r for rows in got_rows for r in rows) == sorted(tuple(x) for x in batch.input_ids)
    m_whole = whole.train_step(batch)
    m_shard = sharded.train_step(shard)
    w1, w2 = exported(whole), exported(sharded)
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    moved = max((w1[k] - v).abs().max().item() for k, v in exported(build_actor(cfg)).items())
    log(
        f"shard-fed vs whole-batch step: params max abs diff {diff:.1e} (update {moved:.1e}), "
        f"rank 0 trained {shard.batch.num_samples} of {batch.num_samples} rows; metrics equal: {m_whole == m_shard}"
    )
    assert moved > 1e-4 and all(torch.equal(w1[k], w2[k]) for k in w1), diff
    assert m_whole == m_shard, (m_whole, m_shard)


def tiny_dir(tmpdir, name: str, family: str, **kw) -> Path:
    """A tiny HF model under tmpdir, saved by rank 0 on first use (checks of one launch share it)."""
    path = Path(tmpdir) / name
    if dist.get_rank() == 0 and not path.exists():
        save_tiny_hf_model(family, path, seed=0, **kw)
    dist.barrier()
    return path


def tiny_moe_dir(tmpdir) -> Path:
    return tiny_dir(tmpdir, "tiny_qwen3_moe", "qwen3_moe")


def check_moe(hf_dir, tmpdir):
    moe_dir = tiny_moe_dir(tmpdir)
    check_logprobs(moe_dir, tp=1, pp=1, ep=2, temperatures=(1.0,))
    check_exact_update(moe_dir, ep=2, seed=8, routing_replay="none")  # the trainer's own routing
    # R3: random routed experts replayed in the old-logprob pass, the training forward and its
    # full-layer recompute in backward equal an HF reference forced to route the same way
    check_exact_update(moe_dir, ep=2, seed=8, replay_seed=4, recompute=True)


def check_moe_replay_pp2(hf_dir, tmpdir):
    """R3 under PP=2 (1F1B: a stage runs forwards of later micro-batches before the recompute of an
    earlier one), each stage replaying its own MoE layers' rows."""
    check_exact_update(tiny_moe_dir(tmpdir), pp=2, seed=8, replay_seed=5, recompute=True)


def check_moe_replay_sp(hf_dir, tmpdir):
    """R3 under TP=2 with sequence parallelism and EP=2 (expert TP 1): each TP rank's routers see only its
    contiguous half of the packed row and must be fed exactly those rows."""
    check_exact_update(
        tiny_moe_dir(tmpdir), ep=2, seed=8, replay_seed=6, recompute=True, parallel=dict(tp=2, etp=1, sp=True)
    )


def check_moe_replay_vpp(hf_dir, tmpdir):
    """R3 under PP=2 x VPP=2 (the tiny MoE's 4 layers: one per virtual chunk, the interleaved schedule) with
    full recompute: each chunk replays only its own MoE layer's rows, in its own forward / backward order."""
    check_exact_update(tiny_moe_dir(tmpdir), pp=2, seed=8, replay_seed=7, recompute=True, parallel=dict(vpp=2))


def check_variants_moe(hf_dir, tmpdir):
    """GSPO, the MoE users' loss, with routing replay under TP=2 + sequence parallel + EP=2, full recompute and
    the fused LM head (on by default for this engine); CISPO with IcePop and replay at EP=2: each equals HF forced
    to the same routing, on one process, as DAPO does."""
    moe_dir = tiny_moe_dir(tmpdir)
    check_exact_update(
        moe_dir,
        ep=2,
        seed=8,
        replay_seed=11,
        recompute=True,
        parallel=dict(tp=2, etp=1, sp=True),
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-mean",
        rollout_correction=RolloutCorrectionConfig(mode="token_tis", upper=2.0),
    )
    check_exact_update(
        moe_dir,
        ep=2,
        seed=8,
        replay_seed=12,
        policy_loss="cispo",
        rollout_correction=RolloutCorrectionConfig(mode="icepop", lower=0.5, upper=1.5),
    )


CHECKS = {
    "logprobs_tp2": lambda hf_dir, tmpdir: check_logprobs(hf_dir, tp=2, pp=1),
    "logprobs_pp2": lambda hf_dir, tmpdir: check_logprobs(hf_dir, tp=1, pp=2),
    "train_dp2": check_train,
    "moe_ep2": check_moe,
    "moe_replay_pp2": check_moe_replay_pp2,
    "moe_replay_sp": check_moe_replay_sp,
    "moe_replay_vpp": check_moe_replay_vpp,
    "shards": lambda hf_dir, tmpdir: check_shards(hf_dir),
    "warmup": lambda hf_dir, tmpdir: check_warmup(hf_dir),
    "sum_norm": lambda hf_dir, tmpdir: check_exact_update(hf_dir, loss_agg_mode="seq-mean-token-sum-norm"),
    "variants": lambda hf_dir, tmpdir: check_variants(hf_dir),
    "variants_moe": check_variants_moe,
}


def run_checks(argv, checks: dict) -> None:
    """Run the comma-separated checks of argv[0] (each `fn(hf_dir, tmpdir)`, a tiny Qwen3 in argv[1])."""
    names, tmpdir = argv[0].split(","), argv[1]
    unknown = [c for c in names if c not in checks]
    if unknown:
        raise SystemExit(f"unknown checks {unknown}")
    init_distributed()
    hf_dir = Path(tmpdir) / "tiny_qwen3"
    if dist.get_rank() == 0:
        save_tiny_hf_model("qwen3", hf_dir, seed=0)
    dist.barrier()
    for name in names:
        started = time.perf_counter()
        checks[name](hf_dir, tmpdir)
        dist.barrier()
        log(f"CHECK PASSED {name} in {time.perf_counter() - started:.1f} s")  # where a launch's time goes
    destroy_distributed()


if __name__ == "__main__":
    run_checks(sys.argv[1:], CHECKS)
