"""Rollout routing replay (R3) against a real embedded server whose router differs from the trainer's.

Usage: routing_replay_checks.py TMPDIR       (torchrun, one rank)

A tiny Qwen3-MoE (16 experts, top-2, norm_topk_prob) serves rollouts with weights W0 in which one expert X
of every MoE layer has a zero router row: X gets logit 0 and is picked only if 14 of the other 15 logits
fall below 0, which the rollout is checked never to do. The trainer gets W1 = W0 with a real router row for
X, so the trainer's own router picks X wherever X's new logit beats the rollout's second choice: those
tokens' routing flips. The gate values of a replayed set are a softmax over the set's own logits, and no
rollout set holds X, so replaying the server's sets on W1 must give the server's logprobs exactly (< 1e-5
in fp32) on every token, flipped ones included; routing by the trainer's own router must not, on the
flipped tokens. The trainer's actor/routing_agreement must equal the share of token-layer sets HF's W1
gates choose alike at the replayed inputs.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from actor_checks import make_config
from forced_routing import forced_routing

from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
from megatron_dapo.trainer.actor import build_actor
from megatron_dapo.types import RolloutBatch

PROMPTS = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9], [2, 7, 1, 8]]
NEW_TOKENS = 12
BATCHING = dict(max_tokens_per_micro_batch=24, ppo_mini_batch_size=3, train_batch_size=3)


def rollout(model_dir: Path, workdir: Path, routing):
    """Samples from a real embedded server on W0, with their routed experts and logprobs."""
    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.rollout.launcher import embedded_server, start_servers
    from megatron_dapo.rollout.types import SamplingParams

    srv = embedded_server(str(model_dir), workdir / "server.log", return_routed_experts=True)
    start_servers([srv], timeout_s=120)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling_seed=3)

    async def generate():
        router = Router([srv.url], routed_experts=routing)
        try:
            return [(await router.generate(p, sampling, rid=f"r{i}"))[0] for i, p in enumerate(PROMPTS)]
        finally:
            await router.aclose()

    try:
        return asyncio.run(generate())
    finally:
        srv.stop()


def batch_of(samples) -> RolloutBatch:
    n = len(samples)
    return RolloutBatch(
        input_ids=[s.prompt_ids + s.output_ids for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
        response_lengths=[len(s.output_ids) for s in samples],
        advantages=torch.ones(n),
        rollout_logprobs=[list(s.logprobs) for s in samples],
        response_loss_mask=[1] * n,
        token_versions=[[0] * len(s.output_ids) for s in samples],
        group_index=torch.arange(n),
        temperature=1.0,
        step=0,
        prompt_indices=list(range(n)),
        routed_experts=[s.routed_experts for s in samples],
    )


EXPERTS, X = 16, 15  # X: the expert whose router row W0 zeroes and W1 sets


def with_router_row_of_x(model_dir: Path, out: Path, seed: int | None) -> Path:
    """A copy of the model whose MoE gates' row X is zero (seed None) or random at the other rows' scale."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed or 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                scale = 3 * p[:X].std()
                p[X] = 0.0 if seed is None else scale * torch.randn(p.shape[1], generator=g)
    model.save_pretrained(out)
    return out


def own_flips(model_dir: Path, batch: RolloutBatch) -> tuple[list[torch.Tensor], float]:
    """Per sample, [response_len] bool: the position predicting response token k had its own (W1, forced
    inputs) top-k set differ from the rollout's in some MoE layer; and HF's agreement share."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    flips = []
    with torch.no_grad(), forced_routing(model, batch) as route:
        for i, (seq, p) in enumerate(zip(batch.input_ids, batch.prompt_lengths)):
            route.use(i)
            out = model(torch.tensor([seq]), output_router_logits=True)
            own = torch.stack([lg.topk(route.ids.shape[-1], dim=-1).indices for lg in out.router_logits], dim=1)
            own = own[:-1].sort(-1).values
            differ = (own != route.ids.long().sort(-1).values).any(-1).any(-1)  # [len - 1]
            flips.append(differ[p - 1 :])
    return flips, route.agree / route.compared


def main(argv):
    workdir = Path(argv[0])
    init_distributed()
    assert dist.get_world_size() == 1
    init_model_parallel(seed=1)
    from megatron_dapo.config.shapes import read_hf_config_file, shape_from_hf
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.types import RoutingShape

    base = save_tiny_hf_model("qwen3_moe", workdir / "base", seed=2, num_experts=EXPERTS)
    w0 = with_router_row_of_x(base, workdir / "w0", seed=None)
    shape = shape_from_hf(read_hf_config_file(str(w0)))
    routing = RoutingShape(shape.num_layers, shape.moe_layers, shape.moe_topk, shape.num_experts)
    samples = rollout(w0, workdir, routing)
    batch = batch_of(samples)
    assert all(not (r == X).any() for r in batch.routed_experts), "the rollout picked expert X"
    w1 = with_router_row_of_x(base, workdir / "w1", seed=7)
    server = [torch.tensor(x) for x in batch.rollout_logprobs]
    flips, hf_agreement = own_flips(w1, batch)
    n_flipped = int(sum(f.sum() for f in flips))
    n_tokens = sum(f.numel() for f in flips)
    print(f"RESULT flipped {n_flipped} of {n_tokens} response positions (HF agreement {hf_agreement:.4f})", flush=True)
    assert 0 < n_flipped < n_tokens, "the perturbation must flip some tokens' routing, not all"

    replayed = build_actor(make_config(w1, **BATCHING))
    got = replayed.compute_logprobs(batch)
    err = max((a - b).abs().max().item() for a, b in zip(got, server))
    err_flipped = max((a - b)[f].abs().max().item() for a, b, f in zip(got, server, flips) if f.any())
    print(f"RESULT replay vs server max abs err {err:.2e} (flipped tokens {err_flipped:.2e})", flush=True)
    assert err < 1e-5, err
    metrics = replayed.train_step(batch)
    agreement = metrics["actor/routing_agreement"]
    print(f"RESULT actor/routing_agreement {agreement:.4f} (HF {hf_agreement:.4f})", flush=True)
    assert abs(agreement - hf_agreement) < 1e-9 and agreement < 1.0, (agreement, hf_agreement)
    assert metrics["actor/train_rollout_logprob_abs_diff"] < 1e-5, metrics

    own = build_actor(make_config(w1, routing_replay="none", **BATCHING))
    assert own.replay is None
    mine = own.compute_logprobs(batch)
    diffs = torch.cat([(a - b)[f].abs() for a, b, f in zip(mine, server, flips)])
    print(
        f"RESULT own routing vs server on flipped tokens: min abs diff {diffs.min():.2e}, max {diffs.max():.2e}",
        flush=True,
    )
    assert diffs.min() > 1e-4, diffs
    print("CHECK PASSED routing_replay", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
