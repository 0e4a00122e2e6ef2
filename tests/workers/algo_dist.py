"""torchrun worker (2 ranks, gloo) for tests/algo/test_distributed.py. Two checks in one launch:

1. TP=2: vocab_parallel_logprobs on each rank's half of the vocabulary (logprobs, entropy and
   the gradient of each shard) equals the unsharded float64 result; torch backend in float64
   and fp32, Triton backend in fp32 (under TRITON_INTERPRET=1 on CPU).
2. DP=2 x 3 uneven micro-batches through DistributedDataParallel: the accumulated gradient with
   the global token / sequence counts equals the gradient of one big batch (float64, torch
   backend; fp32 for the Triton backend), and so do the summed loss and metrics.
Exits non-zero (assertion) on any mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from algo_reference import ref_logprobs_entropy  # noqa: E402

from megatron_dapo.kernels import backend as kernel_backend  # noqa: E402


def backends():
    out = [("torch", torch.float64), ("torch", torch.float32)]
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        out.append(("triton", torch.float32))
    return out


def check_tp(rank, world):
    t, v = 9, 2 * 37
    g = torch.Generator().manual_seed(0)  # the same full logits on every rank
    full = torch.randn(t, v, generator=g, dtype=torch.float64) * 4
    full[0, :] = 1e4
    full[1, 3] = 1e4  # the max in rank 0's half, the target in rank 1's half
    target = torch.randint(0, v, (t,), generator=g)
    target[1], target[2], target[3] = 60, -100, 36  # 36 / 37: both sides of the shard boundary
    target[4] = 37
    glp, gh = torch.randn(t, generator=g, dtype=torch.float64), torch.randn(t, generator=g, dtype=torch.float64)
    temperature = 0.8
    ref_x = full.clone().requires_grad_()
    rlp, rent = ref_logprobs_entropy(ref_x, target, temperature)
    ((rlp * glp).sum() + (rent * gh).sum()).backward()
    shard = slice(rank * v // world, (rank + 1) * v // world)
    for backend, dtype in backends():
        x = full[:, shard].to(dtype).clone().requires_grad_()
        lp, ent = kernel_backend.vocab_parallel_logprobs(
            x, target, dist.group.WORLD, temperature, True, backend=backend
        )
        ((lp * glp.to(dtype)).sum() + (ent * gh.to(dtype)).sum()).backward()
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        for name, a, b in (("logprobs", lp, rlp), ("entropy", ent, rent), ("grad", x.grad, ref_x.grad[:, shard])):
            torch.testing.assert_close(
                a.double(),
                b.detach(),
                atol=tol,
                rtol=tol,
                msg=lambda m: f"TP rank {rank} {backend} {dtype} {name}: {m}",
            )
        print(f"rank {rank}: TP=2 {backend} {dtype} ok", flush=True)


def make_batch(n, s, h, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, s, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 17, (n, s), generator=g)
    old = -torch.rand(n, s, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, s + 1, (n,), generator=g)
    lengths[0] = 0  # an empty sequence
    mask = (torch.arange(s)[None] < lengths[:, None]).double()
    return hidden, targets, old, adv, mask


def policy_loss(model, batch, rows, backend, dtype, mode, **glob):
    hidden, targets, old, adv, mask = (t[rows] for t in batch)
    hidden, old, adv, mask = (t.to(dtype) for t in (hidden, old, adv, mask))
    logits = model(hidden)
    lp = kernel_backend.vocab_parallel_logprobs(logits, targets, None, 1.0, backend=backend)
    return kernel_backend.dapo_policy_loss(lp, old, adv, mask, 0.2, 0.28, 3.0, mode, backend=backend, **glob)


def check_dp(rank, world):
    h, v, s = 6, 17, 8
    batch = make_batch(12, s, h, seed=1)  # the same global batch everywhere; each rank takes its rows
    rank_rows = [list(range(0, 5)), list(range(5, 12))]  # 5 and 7 samples
    micro = {0: [[0, 1], [2], [3, 4]], 1: [[5], [6, 7, 8], [9, 10, 11]]}  # 3 uneven micro-batches each
    mask = batch[4]
    for backend, dtype in [b for b in backends() if b != ("torch", torch.float32)]:
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            torch.manual_seed(3)
            base = torch.nn.Linear(h, v, dtype=dtype)
            ref_model = torch.nn.Linear(h, v, dtype=dtype)
            ref_model.load_state_dict(base.state_dict())
            ddp = torch.nn.parallel.DistributedDataParallel(base)
            # what the actor does: count local loss tokens / sequences, all-reduce the sum
            counts = torch.tensor(
                [mask[rank_rows[rank]].sum(), (mask[rank_rows[rank]].sum(-1) > 0).sum()], dtype=torch.float64
            )
            dist.all_reduce(counts)
            glob = dict(
                global_num_tokens=counts[0].item(),
                global_num_seqs=counts[1].item(),
                dp_world_size=world,
                token_sum_norm=s,
            )
            total = torch.zeros((), dtype=torch.float64)
            kl = torch.zeros((), dtype=torch.float64)
            for i, rows in enumerate(micro[rank]):
                ctx = ddp.no_sync() if i < len(micro[rank]) - 1 else torch.enable_grad()
                with ctx:
                    loss, metrics = policy_loss(ddp, batch, rows, backend, dtype, mode, **glob)
                    loss.backward()
                total += loss.detach().double()
                kl += metrics["approx_kl"].double()
            stacked = torch.stack([total, kl])
            dist.all_reduce(stacked)
            stacked /= world  # DDP's averaging, applied to the logged numbers
            one_loss, one_metrics = policy_loss(
                ref_model, batch, list(range(12)), backend, dtype, mode, token_sum_norm=s
            )
            one_loss.backward()
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            for name, a, b in (
                ("weight grad", base.weight.grad, ref_model.weight.grad),
                ("bias grad", base.bias.grad, ref_model.bias.grad),
                ("loss", stacked[0], one_loss.detach()),
                ("approx_kl", stacked[1], one_metrics["approx_kl"]),
            ):
                torch.testing.assert_close(
                    a.double(),
                    b.double(),
                    atol=tol,
                    rtol=tol,
                    msg=lambda m: f"DP rank {rank} {backend} {mode} {name}: {m}",
                )
            print(f"rank {rank}: DP=2 x 3 micro-batches {backend} {dtype} {mode} ok", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "this worker expects 2 ranks"
    check_tp(rank, world)
    check_dp(rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ALGO DIST OK", flush=True)


if __name__ == "__main__":
    main()
