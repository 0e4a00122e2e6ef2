"""The one lr schedule both actors build: warm-up and decay by the step counts the config implies."""

import math

import torch

from megatron_dapo.config import derived, load_config
from megatron_dapo.trainer.lr_schedule import build_lr_scheduler

CFG = "configs/qwen3/tiny_qwen3_cpu.yaml"


def _lrs(cfg, steps):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))], lr=cfg.optimizer.lr)
    sched = build_lr_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(1)
    return out


def test_decay_steps_count_optimizer_steps_of_the_whole_run():
    cfg = load_config(
        CFG, ["algo.train_batch_size=8", "algo.ppo_mini_batch_size=2", "algo.ppo_epochs=3", "trainer.total_steps=5"]
    )
    assert derived.optimizer_steps_per_train_step(cfg) == 12
    assert derived.lr_decay_steps(cfg) == 60
    cfg.optimizer.lr_decay_steps = 7
    assert derived.lr_decay_steps(cfg) == 7


def test_warmup_then_cosine_decay_match_the_formula():
    cfg = load_config(
        CFG,
        [
            "optimizer.lr=1e-3",
            "optimizer.min_lr=1e-4",
            "optimizer.lr_warmup_steps=4",
            "optimizer.lr_decay_style=cosine",
            "optimizer.lr_decay_steps=20",
        ],
    )
    lrs = _lrs(cfg, 24)
    for t, lr in enumerate(lrs):
        if t <= 4:
            want = 1e-3 * t / 4
        elif t <= 20:
            x = (t - 4) / (20 - 4)
            want = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * x))
        else:
            want = 1e-4
        assert abs(lr - want) < 1e-12, (t, lr, want)


def test_constant_schedule_without_warmup_starts_at_lr():
    cfg = load_config(CFG, ["optimizer.lr=2e-4", "optimizer.lr_warmup_steps=0", "optimizer.lr_decay_style=constant"])
    assert _lrs(cfg, 5) == [2e-4] * 5
