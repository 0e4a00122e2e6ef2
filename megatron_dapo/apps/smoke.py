"""`megatron-dapo smoke`: a tiny megatron-core training run that shows the runtime works.

Two processes on 127.0.0.1 (gloo on CPU, NCCL on GPUs) train a tiny Qwen3-shaped GPTModel with
tensor parallelism 2 through megatron-core's DistributedDataParallel, distributed optimizer and
pipeline schedule, on a synthetic next-token task whose answer is learnable: every sequence
counts up by a random stride modulo a small alphabet. The loss falls from ~log(V) towards 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

from megatron_dapo.algo import vocab_parallel_logprobs
from megatron_dapo.models import build_gpt_model
from megatron_dapo.models.provider import mask_padded_vocab_logits
from megatron_dapo.models.tiny import tiny_hf_config
from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
from megatron_dapo.runtime.net import free_port

ALPHABET = 32  # tokens the task uses (of the model's 256)


def synthetic_batch(step: int, batch_size: int, seq_len: int, rank_seed: int = 0):
    """tokens[t+1] = tokens[t] + stride (mod ALPHABET); start and stride drawn per sequence."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank_seed)
    start = torch.randint(0, ALPHABET, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % ALPHABET
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)

    info = init_distributed()
    init_model_parallel(tp=world, seed=args.seed)
    try:
        losses = _train(info, args)
        if rank == 0:
            first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
            print(
                f"smoke: loss {first:.3f} -> {last:.3f} over {len(losses)} steps "
                f"(TP={world}, backend {info.backend}; chance level for the task: {math.log(ALPHABET):.3f})",
                flush=True,
            )
            if not last < 0.5 * first:
                raise SystemExit(f"smoke: the loss did not fall enough ({first:.3f} -> {last:.3f})")
    finally:
        destroy_distributed()


def _train(info, args) -> list[float]:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tqdm import tqdm

    hf_config = tiny_hf_config("qwen3", num_hidden_layers=2, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(args.seed)
    (model,) = build_gpt_model(hf_config)
    config = model.config
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model
    )
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=0.01,
            clip_grad=1.0,
            use_distributed_optimizer=True,
            params_dtype=torch.float32,
        ),
        [ddp],
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.lr,
        lr_warmup_steps=3,
        lr_decay_steps=args.steps,
        lr_decay_style="constant",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )
    tp_group = ps.get_tensor_model_parallel_group()
    mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(args.seq_len)[None]

    def forward_step(data_iterator, m):
        tokens, labels = next(data_iterator)
        logits = m(tokens, positions.expand_as(tokens), mask)

        def loss_func(logits):
            logits = mask_padded_vocab_logits(logits, hf_config.vocab_size)
            loss = -vocab_parallel_logprobs(logits, labels, tp_group).mean()
            return loss, {"loss": loss.detach().clone()}

        return logits, loss_func

    losses = []
    bar = tqdm(range(args.steps), desc="smoke (TP=2)", unit="step", disable=info.rank != 0, dynamic_ncols=True)
    for step in bar:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([synthetic_batch(step, args.batch_size, args.seq_len)]),
            model=[ddp],
            num_microbatches=1,
            seq_length=args.seq_len,
            micro_batch_size=args.batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = opt.step()
        sched.step(1)
        losses.append(float(out[0]["loss"]))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", grad_norm=f"{grad_norm:.2f}", refresh=False)
        if info.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            bar.write(f"step {step:3d}  loss {losses[-1]:.4f}")
    bar.close()
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-dapo smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of processes")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    ctx = mp.spawn(_worker, args=(args.tp, free_port(), args), nprocs=args.tp, join=False)
    try:
        while not ctx.join(timeout=600):
            pass
    except mp.ProcessRaisedException as e:
        print(f"smoke failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"smoke failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
