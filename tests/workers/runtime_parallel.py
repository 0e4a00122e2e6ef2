"""Real megatron-core training steps on CPU/gloo, checked against a single-process reference.

Usage (under torchrun): runtime_parallel.py CHECK[,CHECK...] TMPDIR
  CHECK in: tp_logits, tp2, pp2, dp2_distopt, ep2, ep2pp2, ckpt_tp2_to_tp1

Every rank builds the full (TP=1, PP=1, EP=1) reference model with the same weights, runs the
same global batch through it with plain autograd and torch AdamW, and compares its loss,
gradients, gradient norm and updated parameters with the parallel run (sliced to the rank's shard).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from runtime_common import (
    SEQ,
    assert_close,
    batch,
    build_gpt,
    full_params,
    gather_tp_last_dim,
    load_full,
    local_params,
    run,
    shard_of,
    tiny_config,
)

from megatron_dapo.runtime.distributed import init_model_parallel
from tests.workers.actor_checks import run_checks

# Adam's eps is large on purpose: with eps << |grad| the first Adam step is lr * sign(grad), blind to
# the gradient's scale (clipping included) and hypersensitive to rounding in near-zero components.
LR, WD, CLIP, BETAS, EPS = 1e-2, 0.1, 0.5, (0.9, 0.95), 1e-4

_reference_cache: dict[bool, dict[str, torch.Tensor]] = {}


def reference_weights(moe: bool) -> dict[str, torch.Tensor]:
    """Full-model weights, identical on every rank (built at TP=PP=EP=1, broadcast from rank 0)."""
    if moe not in _reference_cache:
        init_model_parallel(seed=1234)
        torch.manual_seed(1234)
        model = build_gpt(tiny_config(moe=moe))
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        _reference_cache[moe] = full_params(model)
    return _reference_cache[moe]


def reference_model(moe: bool):
    init_model_parallel(seed=1234)
    model = build_gpt(tiny_config(moe=moe))
    load_full(model, reference_weights(moe), tiny_config(moe=moe))
    return model


def mean_token_loss(model, bt):
    """Mean next-token cross entropy of one micro-batch (megatron's vocab-parallel CE)."""
    per_token = model(bt["tokens"], bt["position_ids"], bt["attention_mask"], labels=bt["labels"])
    return per_token.float().mean()


def microbatches(step: int, dp_rank: int, n_mb: int, mbs: int):
    return [batch(seed=10_000 * step + 100 * dp_rank + i, b=mbs) for i in range(n_mb)]


def reference_step_data(moe, steps, dp, n_mb, mbs):
    """Run the reference through `steps` optimizer steps; return per-step (dp losses, grads, norm, params)."""
    model = reference_model(moe)
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.ndim > 1]
    no_decay = [p for p in params.values() if p.ndim <= 1]  # megatron skips wd on 1-D params
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    out = []
    for step in range(steps):
        opt.zero_grad()
        dp_losses = []
        for r in range(dp):
            losses = [mean_token_loss(model, bt) for bt in microbatches(step, r, n_mb, mbs)]
            # The parallel run: each DP rank averages over its micro-batches, DDP averages over DP ranks.
            loss = torch.stack(losses).mean()
            (loss / dp).backward()
            dp_losses.append(loss.item())
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP).item()
        opt.step()
        out.append((dp_losses, grads, norm, full_params(model)))
    return out


def parallel_model(moe, tp, pp, ep, distributed_optimizer):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    init_model_parallel(tp=tp, pp=pp, ep=ep, seed=1234)
    config = tiny_config(moe=moe)
    model = build_gpt(config)
    load_full(model, reference_weights(moe), config)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=False
        ),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=WD,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            adam_eps=EPS,
            clip_grad=CLIP,
            use_distributed_optimizer=distributed_optimizer,
            params_dtype=torch.float32,
        ),
        [ddp],
    )
    # The scheduler is what applies megatron's per-group wd_mult (no decay on 1-D params).
    OptimizerParamScheduler(
        opt,
        init_lr=LR,
        max_lr=LR,
        min_lr=LR,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=WD,
        end_wd=WD,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    return config, ddp, opt


def check_train_steps(name, moe=False, tp=1, pp=1, ep=1, distributed_optimizer=False, n_mb=2, mbs=2, steps=2):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = dist.get_world_size() // (tp * pp)
    ref = reference_step_data(moe, steps, dp, n_mb, mbs)
    config, ddp, opt = parallel_model(moe, tp, pp, ep, distributed_optimizer)
    dp_rank = ps.get_data_parallel_rank()
    last_stage = ps.is_pipeline_last_stage()

    def forward_step(data_iterator, model):
        bt = next(data_iterator)
        out = model(bt["tokens"], bt["position_ids"], bt["attention_mask"], labels=bt["labels"])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return out, loss_func

    for step, (ref_losses, ref_grads, ref_norm, ref_params) in enumerate(ref):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches(step, dp_rank, n_mb, mbs)),
            model=[ddp],
            num_microbatches=n_mb,
            seq_length=SEQ,
            micro_batch_size=mbs,
            forward_only=False,
        )
        if last_stage:
            loss = torch.stack([r["loss"] for r in results]).mean()
            assert_close(f"{name} step {step} loss", loss, torch.tensor(ref_losses[dp_rank]), rtol=1e-5, atol=1e-6)
        if not distributed_optimizer:
            # With the distributed optimizer each rank's grad buffer is only reduced on its own shard;
            # there the gradient norm and the update below carry the check.
            err = 0.0
            for gname, p in local_params(ddp, config):
                want = shard_of(ref_grads[gname], gname, p, config)
                err = max(err, assert_close_quiet(f"{name} grad {gname}", p.main_grad, want))
            print(f"[rank {dist.get_rank()}] {name} step {step} grads: max abs err {err:.3e} ok", flush=True)
        ok, norm, _ = opt.step()
        assert ok, f"{name}: optimizer step was skipped"
        assert_close(f"{name} step {step} grad norm", torch.tensor(norm), torch.tensor(ref_norm), rtol=1e-5, atol=1e-6)
        err = 0.0
        for gname, p in local_params(ddp, config):
            want = shard_of(ref_params[gname], gname, p, config)
            err = max(err, assert_close_quiet(f"{name} param {gname}", p.detach(), want, rtol=1e-5, atol=1e-4 * LR))
        print(f"[rank {dist.get_rank()}] {name} step {step} params after step: max abs err {err:.3e} ok", flush=True)


def assert_close_quiet(name, got, want, rtol=1e-5, atol=1e-6):
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        raise AssertionError(f"{name}: max abs err {(got - want).abs().max().item():.3e}")
    return (got - want).abs().max().item()


def check_tp_logits():
    ref = reference_model(moe=False)
    bt = batch(seed=7)
    with torch.no_grad():
        want = run(ref, bt)
        init_model_parallel(tp=2, seed=1234)
        config = tiny_config()
        model = build_gpt(config)
        load_full(model, reference_weights(False), config)
        shard = run(model, bt)
        assert shard.shape[-1] * 2 == want.shape[-1], "TP=2 logits should be vocab-sharded"
        assert_close("tp2 logits vs tp1", gather_tp_last_dim(shard), want, rtol=1e-5, atol=1e-5)


def check_ckpt_tp2_to_tp1(tmpdir):
    """dist_checkpointing (torch_dist) save at TP=2, load at TP=1 into a differently initialised model."""
    from megatron.core import dist_checkpointing

    bt = batch(seed=8)
    with torch.no_grad():
        want = run(reference_model(moe=False), bt)  # the same weights at TP=1
    init_model_parallel(tp=2, seed=1234)
    config = tiny_config()
    model = build_gpt(config)
    load_full(model, reference_weights(False), config)
    ckpt = f"{tmpdir}/ckpt_tp2"
    if dist.get_rank() == 0:
        import os

        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)

    init_model_parallel(tp=1, seed=4321)
    torch.manual_seed(4321)
    fresh = build_gpt(tiny_config())
    with torch.no_grad():
        before = run(fresh, bt)
    assert (before - want).abs().max() > 1e-2, "a fresh model should differ before loading"
    state = dist_checkpointing.load(fresh.sharded_state_dict(), ckpt)
    fresh.load_state_dict(state)
    with torch.no_grad():
        got = run(fresh, bt)
    # Same weights, same TP=1 kernels as the reference: the loaded model must match it to the bit.
    assert_close("ckpt tp2 -> tp1 logits", got, want, rtol=0, atol=0)


CHECKS = {  # fn(hf_dir, tmpdir), as tests.workers.actor_checks.run_checks calls them: the model here is our own
    "tp_logits": lambda hf_dir, tmpdir: check_tp_logits(),
    "tp2": lambda hf_dir, tmpdir: check_train_steps("tp2", tp=2),
    "pp2": lambda hf_dir, tmpdir: check_train_steps("pp2 (1F1B)", pp=2, n_mb=4, mbs=1),
    "dp2_distopt": lambda hf_dir, tmpdir: check_train_steps(
        "dp2 distopt", distributed_optimizer=True, n_mb=2, mbs=1, steps=3
    ),
    "ep2": lambda hf_dir, tmpdir: check_train_steps("ep2 moe", moe=True, ep=2),
    "ep2pp2": lambda hf_dir, tmpdir: check_train_steps("ep2 x pp2 moe", moe=True, ep=2, pp=2, n_mb=2, mbs=1),
    "ckpt_tp2_to_tp1": lambda hf_dir, tmpdir: check_ckpt_tp2_to_tp1(tmpdir),
}


if __name__ == "__main__":  # dist_checkpointing.save spawns a process: keep the guard
    run_checks(sys.argv[1:], CHECKS)
