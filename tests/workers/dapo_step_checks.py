"""One DapoStep over both training engines under torchrun (2 gloo ranks): the same step from the same weights.

Usage: dapo_step_checks.py CHECK[,CHECK...] TMPDIR
  same_step: DapoStep(MegatronEngine) and DapoStep(FSDPEngine), both from one tiny Qwen3's HF weights in
             fp32 (DP=2 each), give the same old-policy logprobs, the same train-step metrics (loss,
             entropy, clip fractions, KL, grad norm, lr; two mini-batches of several uneven micro-batches,
             an entropy bonus, rollout-IS weights) and the same weights after the step.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_dapo.runtime.distributed import init_model_parallel
from megatron_dapo.trainer.dapo_step import DapoStep
from megatron_dapo.trainer.fsdp_engine import FSDPEngine
from megatron_dapo.trainer.megatron_engine import MegatronEngine
from tests.workers.actor_checks import exported, log, make_batch, make_config, max_err, run_checks

TOL = 1e-5


def step_config(hf_dir, backend: str):
    cfg = make_config(
        hf_dir,
        max_tokens_per_micro_batch=24,  # several uneven micro-batches per rank
        ppo_mini_batch_size=2,  # two mini-batches: two optimizer steps, the lr schedule moves between them
        train_batch_size=4,
        entropy_coeff=0.01,  # the entropy term's gradient too
        fused_lm_head=False,  # the FSDP2 engine has no fused LM head; the Megatron one's is tested on its own
    )
    cfg.trainer.backend = backend
    cfg.algo.rollout_correction.mode = "token_tis"
    return cfg


def one_step(engine_cls, cfg, batch, rollout_noise: torch.Generator | None = None):
    """Old logprobs, train-step metrics and weights after the step of DapoStep(engine_cls(cfg)). With
    `rollout_noise`, the batch's rollout logprobs are first set a little off this actor's own."""
    actor = DapoStep(engine_cls(cfg), cfg)
    assert (actor.layout.dp, actor.layout.dp_rank) == (dist.get_world_size(), dist.get_rank()), actor.layout
    old = actor.compute_logprobs(batch)
    if rollout_noise is not None:
        batch.rollout_logprobs = [(o + 0.3 * torch.randn(o.shape, generator=rollout_noise)).tolist() for o in old]
    metrics = actor.train_step(batch)
    return old, metrics, exported(actor)


def check_same_step(hf_dir):
    init_model_parallel(tp=1, pp=1, seed=1)
    batch = make_batch(seed=11, n_groups=4)
    m_old, m_metrics, m_weights = one_step(
        MegatronEngine, step_config(hf_dir, "megatron"), batch, torch.Generator().manual_seed(3)
    )
    f_old, f_metrics, f_weights = one_step(FSDPEngine, step_config(hf_dir, "fsdp2"), batch)
    log(f"megatron: {m_metrics}\nfsdp2:    {f_metrics}")
    lp_err = max_err(m_old, f_old)
    assert lp_err < TOL, lp_err
    assert m_metrics.keys() == f_metrics.keys(), (sorted(m_metrics), sorted(f_metrics))
    assert m_metrics["actor/optimizer_steps"] == 2 and m_metrics["actor/skipped_steps"] == 0, m_metrics
    for key, want in m_metrics.items():
        assert math.isclose(f_metrics[key], want, rel_tol=TOL, abs_tol=1e-7), (key, f_metrics[key], want)
    assert m_weights.keys() == f_weights.keys(), sorted(set(m_weights) ^ set(f_weights))
    worst = max((m_weights[k] - f_weights[k]).abs().max().item() for k in m_weights)
    assert worst < TOL, worst
    log(
        f"one DapoStep, two engines: old logprobs max abs diff {lp_err:.1e}; loss {m_metrics['actor/pg_loss']:.8f} "
        f"vs {f_metrics['actor/pg_loss']:.8f}, entropy {m_metrics['actor/entropy']:.8f} vs "
        f"{f_metrics['actor/entropy']:.8f}; weights after the step max abs diff {worst:.1e}"
    )


CHECKS = {"same_step": lambda hf_dir, tmpdir: check_same_step(hf_dir)}


if __name__ == "__main__":
    run_checks(sys.argv[1:], CHECKS)
