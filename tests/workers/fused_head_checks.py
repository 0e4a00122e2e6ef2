"""algo.fused_lm_head under torchrun (2 ranks): the fused LM head path equals the logits path.

Usage: fused_head_checks.py CHECK[,CHECK...] TMPDIR
  tp1, tp2:             dense tiny Qwen3 at TP=1 (DP=2) / TP=2 (DP=1), untied output layer
  tp1_tied, tp2_tied:   the same with tied embeddings (the output weight is the embedding's)
  pp2, pp2_tied:        PP=2 (the last stage's output layer; tied: its copy of the embedding)
  tp2_sp:               TP=2 with sequence parallelism (each rank hands the op its half of the positions)
Each: compute_logprobs, then one train step (several packed micro-batches, temperature 0.7, an entropy
bonus so the entropy's gradient is used too) of an actor with algo.fused_lm_head=true and one without,
from the same weights: logprobs, loss, entropy, grad norm and every updated parameter agree to fp32
rounding (1e-5 relative), and the fused op really ran.
"""

from __future__ import annotations

import math
import sys

import torch

import megatron_dapo.trainer.megatron_engine as engine_mod
from megatron_dapo.runtime.distributed import init_model_parallel
from megatron_dapo.trainer.actor import build_actor
from tests.workers.actor_checks import exported, log, make_batch, make_config, max_err, run_checks, tiny_dir

CALLS = {"fused": 0, "shapes": set()}
_fused = engine_mod.fused_linear_logprobs


def _counting(hidden, weight, *args, **kwargs):
    CALLS["fused"] += 1
    CALLS["shapes"].add((tuple(hidden.shape[1:]), tuple(weight.shape), weight.requires_grad))
    return _fused(hidden, weight, *args, **kwargs)


engine_mod.fused_linear_logprobs = _counting


def check_same_step(hf_dir, tp: int, pp: int = 1, sequence_parallel: bool = False):
    init_model_parallel(tp=tp, pp=pp, seed=1)
    kw = dict(max_tokens_per_micro_batch=24, ppo_mini_batch_size=3, train_batch_size=3, entropy_coeff=0.01)
    configs = [make_config(hf_dir, tp=tp, pp=pp, fused_lm_head=fused, **kw) for fused in (False, True)]
    for cfg in configs:
        cfg.parallel.sequence_parallel = sequence_parallel
    plain, fused = (build_actor(cfg) for cfg in configs)
    assert bool(fused.engine.config.sequence_parallel) == sequence_parallel
    assert fused.engine.fused_lm_head and not plain.engine.fused_lm_head
    batch = make_batch(seed=5, temperature=0.7)
    CALLS["fused"] = 0
    old_plain = plain.compute_logprobs(batch)
    assert CALLS["fused"] == 0, "the unfused actor must not use the fused op"
    old_fused = fused.compute_logprobs(batch)
    assert CALLS["fused"] > 0 or not fused.layout.is_last_stage, "the fused actor did not use the fused op"
    lp_err = max_err(old_plain, old_fused)
    assert lp_err < 1e-5, lp_err
    g = torch.Generator().manual_seed(9)
    batch.rollout_logprobs = [(o + 0.3 * torch.randn(o.shape, generator=g)).tolist() for o in old_plain]
    before = exported(plain)
    assert all(torch.equal(v, before[k]) for k, v in exported(fused).items())
    calls = CALLS["fused"]
    m_plain = plain.train_step(batch)
    assert CALLS["fused"] == calls
    CALLS["shapes"].clear()
    m_fused = fused.train_step(batch)
    if fused.layout.is_last_stage:
        assert CALLS["fused"] > calls, "the fused actor's train step did not use the fused op"
        # hidden rows [T, h] and the vocab-parallel output weight [V / tp, h], a parameter with grad
        arch = fused.arch
        assert CALLS["shapes"] == {((arch.hidden_size,), (arch.vocab_size // tp, arch.hidden_size), True)}, CALLS
    worst_metric = 0.0
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/approx_kl", "actor/ratio_mean"):
        a, b = m_plain[key], m_fused[key]
        worst_metric = max(worst_metric, abs(a - b) / max(abs(a), 1e-12))
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), (key, a, b)
    assert m_fused["actor/optimizer_steps"] == 1 and m_fused["actor/skipped_steps"] == 0, m_fused
    for key in ("actor/pg_clipfrac_upper", "actor/pg_clipfrac_lower", "actor/pg_clipfrac_dual"):
        assert abs(m_plain[key] - m_fused[key]) < 1e-6, (key, m_plain[key], m_fused[key])
    w_plain, w_fused = exported(plain), exported(fused)
    assert w_plain.keys() == w_fused.keys()
    worst, worst_rel = 0.0, 0.0
    for name, want in w_plain.items():
        got = w_fused[name]
        update = (want - before[name]).abs().max().item()
        err = (got - want).abs().max().item()
        worst = max(worst, err)
        if update > 0:
            worst_rel = max(worst_rel, err / update)
        assert err <= 1e-6 + 1e-5 * want.abs().max().item(), f"{name}: fused update differs by {err:.2e}"
    head = "model.embed_tokens.weight" if plain.arch.tie_word_embeddings else "lm_head.weight"
    head_update = (w_fused[head] - before[head]).abs().max().item()
    assert head_update > 1e-4, f"{head} did not move under the fused head ({head_update:.2e})"
    moved = max((w_plain[k] - before[k]).abs().max().item() for k in w_plain)
    log(
        f"tp={tp} pp={pp} tied={plain.arch.tie_word_embeddings}: fused vs unfused logprobs max abs diff {lp_err:.2e}; "
        f"loss {m_fused['actor/pg_loss']:.8f} vs {m_plain['actor/pg_loss']:.8f}, "
        f"entropy {m_fused['actor/entropy']:.8f} vs {m_plain['actor/entropy']:.8f}, "
        f"grad norm {m_fused['actor/grad_norm']:.8f} vs {m_plain['actor/grad_norm']:.8f} "
        f"(worst metric rel diff {worst_metric:.2e}); params max abs diff {worst:.2e} "
        f"(max |update| {moved:.2e}, worst diff / update {worst_rel:.2e}; {head} moved {head_update:.2e})"
    )


def _check(layout: str, variant: str):
    tp, pp = (1, 2) if layout == "pp2" else (int(layout[2:]), 1)

    def check(hf_dir, tmpdir):
        if variant == "tied":
            hf_dir = tiny_dir(tmpdir, "tiny_qwen3_tied", "qwen3", tie_word_embeddings=True)
        check_same_step(hf_dir, tp=tp, pp=pp, sequence_parallel=variant == "sp")

    return check


CHECKS = {
    name: _check(*name.partition("_")[::2])  # LAYOUT[_VARIANT]
    for name in ("tp1", "tp2", "pp2", "tp1_tied", "tp2_tied", "pp2_tied", "tp2_sp")
}


if __name__ == "__main__":
    run_checks(sys.argv[1:], CHECKS)
