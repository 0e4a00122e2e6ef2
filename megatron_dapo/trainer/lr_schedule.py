"""The learning-rate and weight-decay schedule, one for both actors.

megatron-core's `OptimizerParamScheduler` drives any optimizer's param groups (megatron's
DistributedOptimizer or torch AdamW under FSDP2), counted in optimizer steps: linear warm-up over
`optimizer.lr_warmup_steps` from 0 to `lr`, then `lr_decay_style` down to `min_lr` by
`config.derived.lr_decay_steps`; weight decay stays `optimizer.weight_decay` (a param group's
`wd_mult` 0 exempts biases and norm weights).
"""

from __future__ import annotations

from megatron_dapo.config import derived


def build_lr_scheduler(optimizer, cfg):
    # megatron-core pulls in its whole optimizer stack; only an actor being built needs it
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = cfg.optimizer
    decay = derived.lr_decay_steps(cfg)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_steps,
        lr_decay_steps=max(decay, opt.lr_warmup_steps + 1),
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )
