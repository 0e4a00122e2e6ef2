"""DapoStep over the FSDP2 engine: checks under torchrun (gloo), against a plain one-process Hugging Face model.

Usage: fsdp_checks.py CHECK[,CHECK...] TMPDIR   (at 2 ranks; rank 0 also builds the one-process references)

On a tiny Qwen2 model with tied embeddings (as Qwen2.5-3B):
  logprobs: compute_logprobs (packed micro-batches) equals one-sequence-at-a-time HF forwards,
            float64 log-softmax, at temperatures 1.0 and 0.7;
  export:   export_weights yields exactly the safetensors file's names, shapes and values;
  grads:    after the backward of a train step (2 ranks, several uneven micro-batches each) the
            gathered gradients equal the one-process gradients of the whole batch;
  update:   the parameters after that optimizer step equal torch AdamW on one process (grad clip,
            no decay on biases / norms), read back through export_weights;
  skip:     a NaN advantage skips the step and leaves the weights alone;
  ckpt:     a DCP checkpoint restores model + optimizer + schedule into a fresh actor (next step equal).
On a tiny Qwen3-MoE model (transformers 5 holds its experts fused) with full activation recompute:
  moe:      export_weights yields the checkpoint's per-expert names and values, logprobs equal HF,
            and the gradients of a train step equal the one-process ones.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from actor_checks import (  # a sibling worker: tests/workers is sys.path[0] when run as a script
    make_batch,
    run_checks,
    tiny_dir,
    tiny_moe_dir,
)

from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.trainer.actor import build_actor
from megatron_dapo.types import RolloutBatch

LR, EPS, CLIP, WD = 1e-3, 1e-4, 0.5, 0.1


def log(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def make_config(hf_dir, **algo) -> DapoConfig:
    cfg = DapoConfig()
    cfg.trainer.backend = "fsdp2"
    cfg.model.hf_path = str(hf_dir)
    cfg.model.dtype = "fp32"
    cfg.optimizer.lr, cfg.optimizer.adam_eps, cfg.optimizer.clip_grad = LR, EPS, CLIP
    cfg.optimizer.weight_decay = WD
    cfg.optimizer.lr_warmup_steps = 0
    cfg.trainer.total_steps = 10
    cfg.data.max_prompt_length, cfg.data.max_response_length = 16, 32
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    return cfg


def hf_rows(model, batch: RolloutBatch, dtype=torch.float64) -> list[torch.Tensor]:
    """Each sequence alone through the HF model: log-softmax of logits / T at the response tokens."""
    out = []
    for seq, p in zip(batch.input_ids, batch.prompt_lengths):
        logits = model(torch.tensor([seq])).logits[0].to(dtype) / batch.temperature
        out.append(torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, torch.tensor(seq[p:])[:, None])[:, 0])
    return out


def max_err(a, b) -> float:
    assert [x.shape for x in a] == [y.shape for y in b], "response lengths differ"
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def reference(hf_dir, batch: RolloutBatch, cfg: DapoConfig):
    """The whole batch on one process: HF model, DAPO loss, gradients, clip, torch AdamW step."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.algo import dapo_policy_loss

    a = cfg.algo
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        old = [x.float() for x in hf_rows(model.eval(), batch)]
    n, width = batch.num_samples, max(batch.response_lengths)
    lp = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in hf_rows(model, batch, torch.float32)])
    old_rows, roll, mask = torch.zeros(n, width), torch.zeros(n, width), torch.zeros(n, width)
    for i in range(n):
        k = batch.response_lengths[i]
        old_rows[i, :k], roll[i, :k] = old[i], torch.tensor(batch.rollout_logprobs[i])
        mask[i, :k] = batch.response_loss_mask[i]
    w = torch.exp(old_rows - roll) * (mask > 0)
    loss, _ = dapo_policy_loss(
        lp,
        old_rows,
        batch.advantages.float(),
        mask,
        a.clip_ratio_low,
        a.clip_ratio_high,
        a.clip_ratio_c,
        a.loss_agg_mode,
        None,
        w,
        rollout_is_cap=a.rollout_correction.upper,
    )
    loss.backward()
    params = dict(model.named_parameters())
    grads = {k: p.grad.clone() for k, p in params.items()}
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP).item()
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params.values() if p.ndim > 1], "weight_decay": WD},
            {"params": [p for p in params.values() if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.999),
        eps=EPS,
    )
    opt.step()
    return loss.item(), norm, grads, {k: v.detach().clone() for k, v in params.items()}, old


def exported(actor) -> dict[str, torch.Tensor]:
    return dict(actor.export_weights(dst_rank=None))


def check_logprobs(hf_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    actor = build_actor(make_config(hf_dir, max_tokens_per_micro_batch=40))
    for temperature in (1.0, 0.7):
        batch = make_batch(seed=3, n_groups=4, temperature=temperature)
        with torch.no_grad():
            want = hf_rows(hf, batch)
        packs = actor._packs(batch, actor._split(batch, list(range(batch.num_samples)))[actor.layout.dp_rank])
        assert any(len(p.rows) > 1 for p in packs), "the check needs packed micro-batches"
        got = actor.compute_logprobs(batch)
        err = max_err(got, want)
        log(f"T={temperature}: FSDP actor (packed, budget 40) vs float64 HF logprobs max abs err {err:.2e}")
        assert err < 1e-5, err
        sub = actor.compute_logprobs(batch, rows=[5, 0])
        assert max_err(sub, [want[5], want[0]]) < 1e-5


def check_export(hf_dir):
    from safetensors.torch import load_file

    on_disk = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        on_disk.update(load_file(f))
    actor = build_actor(make_config(hf_dir))
    items = list(actor.export_weights())  # rank 0 receives, rank 1 gets None
    names = [n for n, _ in items]
    assert len(names) == len(set(names))
    assert set(names) == set(on_disk), sorted(set(names) ^ set(on_disk))
    if dist.get_rank() == 0:
        for name, t in items:
            assert t.shape == on_disk[name].shape and torch.equal(t, on_disk[name].float()), name
    else:
        assert all(t is None for _, t in items)
    log(
        f"export: {len(names)} tensors, names / shapes / values equal to the safetensors file "
        f"(tied lm_head absent: {'lm_head.weight' not in names})"
    )


def train_step_checking_grads(actor, batch, ref_grads) -> dict:
    """actor.train_step(batch), asserting the gathered gradients before the optimizer step."""
    grads = {}
    step = actor.engine.optimizer_step

    def capture(loss_finite):
        for name, p in actor.engine.module.named_parameters():
            grads[name] = p.grad.full_tensor().clone()
        return step(loss_finite)

    actor.engine.optimizer_step = capture
    try:
        metrics = actor.train_step(batch)
    finally:
        actor.engine.optimizer_step = step
    log(f"train step metrics: {metrics}")
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/optimizer_steps"] == 1
    gerr = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    gscale = max(v.abs().max().item() for v in ref_grads.values())
    log(f"2-rank FSDP2 gradients vs one-process gradients: max abs err {gerr:.2e} (max |grad| {gscale:.2e})")
    assert set(grads) == set(ref_grads) and gerr < 1e-6 * max(1.0, gscale), gerr
    return metrics


def check_train(hf_dir, tmpdir):
    cfg = make_config(hf_dir, max_tokens_per_micro_batch=24, ppo_mini_batch_size=3, train_batch_size=3)
    batch = make_batch(seed=5)
    g = torch.Generator().manual_seed(9)
    actor = build_actor(cfg)
    old = actor.compute_logprobs(batch)
    batch.rollout_logprobs = [(o + 0.3 * torch.randn(o.shape, generator=g)).tolist() for o in old]
    ref_loss, ref_norm, ref_grads, ref_params, ref_old = reference(hf_dir, batch, cfg)
    assert max_err(old, ref_old) < 1e-5
    packs = actor._packs(batch, actor._split(batch, list(range(batch.num_samples)))[actor.layout.dp_rank])
    log(f"rank 0 micro-batches {[p.rows for p in packs]}")
    assert len(packs) >= 2, "the exactness check needs several micro-batches per rank"

    before = exported(actor)
    metrics = train_step_checking_grads(actor, batch, ref_grads)
    after = exported(actor)
    assert math.isclose(metrics["actor/pg_loss"], ref_loss, rel_tol=1e-5, abs_tol=1e-7), (metrics, ref_loss)
    assert math.isclose(metrics["actor/grad_norm"], ref_norm, rel_tol=1e-5), (metrics["actor/grad_norm"], ref_norm)
    worst = max((after[k] - ref_params[k]).abs().max().item() for k in ref_params)
    moved = max((after[k] - before[k]).abs().max().item() for k in after)
    log(f"params after one AdamW step vs one-process AdamW: max abs err {worst:.2e} (max |update| {moved:.2e})")
    assert worst < 1e-6 and moved > 1e-4, (worst, moved)

    bad = copy.deepcopy(batch)
    bad.advantages[0] = float("nan")
    m_bad = actor.train_step(bad)
    assert m_bad["actor/skipped_steps"] == 1 and m_bad["actor/optimizer_steps"] == 0, m_bad
    assert m_bad["actor/nonfinite_loss"] == 1.0, m_bad
    unchanged = exported(actor)
    assert all(torch.equal(unchanged[k], after[k]) for k in after), "a skipped step must not touch the weights"
    log("non-finite loss: step skipped, weights unchanged")

    ckpt = str(Path(tmpdir) / "fsdp_ckpt")
    actor.save_checkpoint(ckpt)
    batch2 = make_batch(seed=6)
    batch2.rollout_logprobs = [o.tolist() for o in actor.compute_logprobs(batch2)]
    restored = build_actor(cfg)
    restored.load_checkpoint(ckpt)
    assert restored.optimizer_steps == 1 and restored.skipped_steps == 1
    assert all(torch.equal(v, after[k]) for k, v in exported(restored).items())
    m1, m2 = actor.train_step(batch2), restored.train_step(batch2)
    w1, w2 = exported(actor), exported(restored)
    err = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    log(f"DCP checkpoint round trip: next-step params max abs diff {err:.2e}")
    assert err == 0.0 and m1["actor/lr"] == m2["actor/lr"], (err, m1, m2)


def check_moe(hf_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    on_disk = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        on_disk.update(load_file(f))
    cfg = make_config(hf_dir, max_tokens_per_micro_batch=40, ppo_mini_batch_size=3, train_batch_size=3)
    cfg.model.recompute_granularity = "full"
    try:  # routing replay (the MoE default) is the Megatron actor's only: refused by name
        build_actor(cfg)
        raise AssertionError("the FSDP2 actor accepted algo.routing_replay=rollout")
    except ValueError as e:
        assert "algo.routing_replay" in str(e), e
    cfg.algo.routing_replay = "none"
    actor = build_actor(cfg)
    got = exported(actor)
    assert set(got) == set(on_disk), sorted(set(got) ^ set(on_disk))
    assert all(torch.equal(got[k], on_disk[k].float()) for k in on_disk)
    assert any(".mlp.experts.1.up_proj.weight" in k for k in got)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = make_batch(seed=4)
    with torch.no_grad():
        want = hf_rows(hf, batch)
    err = max_err(actor.compute_logprobs(batch), want)
    log(f"MoE: {len(got)} per-expert checkpoint tensors exported; logprobs vs HF max abs err {err:.2e}")
    assert err < 1e-5, err
    g = torch.Generator().manual_seed(2)
    batch.rollout_logprobs = [(o.float() + 0.3 * torch.randn(o.shape, generator=g)).tolist() for o in want]
    _, _, ref_grads, _, _ = reference(hf_dir, batch, cfg)
    train_step_checking_grads(actor, batch, ref_grads)


def _tied_qwen2(tmpdir):
    return tiny_dir(tmpdir, "tiny_qwen2", "qwen2", tie_word_embeddings=True)


CHECKS = {  # fn(hf_dir, tmpdir), as actor_checks.run_checks calls them: the models here are their own
    "logprobs": lambda hf_dir, tmpdir: check_logprobs(_tied_qwen2(tmpdir)),
    "export": lambda hf_dir, tmpdir: check_export(_tied_qwen2(tmpdir)),
    "train": lambda hf_dir, tmpdir: check_train(_tied_qwen2(tmpdir), tmpdir),
    "moe": lambda hf_dir, tmpdir: check_moe(tiny_moe_dir(tmpdir)),
}


if __name__ == "__main__":
    run_checks(sys.argv[1:], CHECKS)
