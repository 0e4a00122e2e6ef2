"""torchrun worker (2 ranks, gloo) for tests/kernels/test_fused_linear.py: fused_linear_logprobs with the
(padded) vocabulary split over a TP group of 2 equals the unsharded float64 reference -- logprobs,
entropy, dH (after the op's all-reduce) and each rank's dW shard. Two layouts: padding in rank 1's
half, and rank 1 holding padding only; and sequence parallel: each rank passes its half of the tokens,
gets every token's values and its half of dH, and the op saves only that half for backward.
argv[1]: the op's backend ("torch" or "triton"; "triton" on CPU needs TRITON_INTERPRET=1).
Exits non-zero (assertion) on any mismatch.

`naive_reference` is also the TP=1 reference of tests/kernels/test_fused_linear.py.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

TOL = dict(atol=2e-5, rtol=1e-5)  # fp32 op vs float64 reference


def naive_reference(hidden, weight, target, temperature, vocab_size):
    """Full logits, log_softmax and entropy in float64 autograd (hidden / weight: float64 leaves)."""
    logits = (hidden @ weight[:vocab_size].t()) / temperature  # the padding rows are not vocabulary
    logp = torch.log_softmax(logits, dim=-1)
    valid = (target >= 0) & (target < vocab_size)
    lp = torch.where(valid, logp.gather(1, target.clamp(0, vocab_size - 1)[:, None]).squeeze(1), 0.0)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return lp, ent


def make_case(t, h, rows, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(rows, h, generator=g, dtype=torch.float64) * 0.5
    a, b = torch.randn(t, generator=g, dtype=torch.float64), torch.randn(t, generator=g, dtype=torch.float64)
    return g, hidden, weight, a, b


def check(rank, world, vocab_size, label, backend, sequence_parallel=False):
    t, h, v_local, temp = (14 if sequence_parallel else 13), 8, 27, 0.7
    g, hidden, weight, a, b = make_case(t, h, world * v_local, seed=1)  # the same tensors on every rank
    target = torch.randint(0, vocab_size, (t,), generator=g)
    target[0], target[1], target[2] = v_local - 1, v_local, -100  # both sides of the boundary; ignored
    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rlp, rent = naive_reference(rh, rw, target, temp, vocab_size)
    ((rlp * a).sum() + (rent * b).sum()).backward()

    from megatron_dapo.kernels import fused_linear_logprobs

    shard = slice(rank * v_local, (rank + 1) * v_local)
    rows = slice(rank * t // world, (rank + 1) * t // world) if sequence_parallel else slice(None)
    x = hidden[rows].float().requires_grad_()
    w = weight[shard].float().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(tuple(s.shape)) or s, lambda s: s):
        lp, ent = fused_linear_logprobs(
            x,
            w,
            target,
            tp_group=dist.group.WORLD,
            temperature=temp,
            vocab_size=vocab_size,
            chunk_tokens=5,
            sequence_parallel=sequence_parallel,
            backend=backend,
        )
    assert (t, h) not in saved or not sequence_parallel, f"rank {rank}: the gathered hidden was saved: {saved}"
    ((lp * a.float()).sum() + (ent * b.float()).sum()).backward()
    for name, got, want in (
        ("logprobs", lp, rlp),
        ("entropy", ent, rent),
        ("dH", x.grad, rh.grad[rows]),
        ("dW shard", w.grad, rw.grad[shard]),
    ):
        err = (got.double() - want.detach()).abs().max().item()
        torch.testing.assert_close(got.double(), want.detach(), **TOL, msg=lambda m: f"rank {rank} {label} {name}: {m}")
        print(f"rank {rank}: {label} {name} max err {err:.2e}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    backend = sys.argv[1] if len(sys.argv) > 1 else "torch"
    check(rank, world, vocab_size=50, label="padded", backend=backend)  # rank 1: 23 real rows + 4 padding
    check(rank, world, vocab_size=27, label="rank1-padding-only", backend=backend)
    check(rank, world, vocab_size=50, label="sequence-parallel", backend=backend, sequence_parallel=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: FUSED LINEAR TP OK backend={backend}", flush=True)


if __name__ == "__main__":
    main()
