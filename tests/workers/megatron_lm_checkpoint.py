"""Checkpoints as Megatron-LM (tag core_v0.16.1) `save_checkpoint` writes them with its defaults.

usage: megatron_lm_checkpoint.py HF_DIR WORKDIR      (one rank)

HF_DIR is a tiny all-MoE Qwen3; the model is a plain megatron-core GPTModel for it (no megatron_dapo
code: `moe_layout.plain_gpt_model`). Megatron-LM's training code is not installable, so its state dict is
put together here from megatron-core's own parts the way `megatron/training/checkpointing.py`
(`generate_state_dict`, `get_rng_state`, `_build_sharded_state_dict_metadata`) does, after one real
training step through megatron-core's DistributedDataParallel and optimizer:

    args                      an argparse.Namespace with the value types Megatron-LM's holds (torch dtypes,
                              AttnBackend, ModelType, lists)
    checkpoint_version, iteration, num_floating_point_operations_so_far
    model                     GPTModel.sharded_state_dict(metadata)
    optimizer                 the optimizer's sharded_state_dict (WORKDIR/plain: Adam, WORKDIR/distributed:
                              the distributed optimizer, dp_reshardable)
    opt_param_scheduler       OptimizerParamScheduler.state_dict()
    rng_state                 ShardedObject('rng_state', [python, numpy, torch, "cuda" (CPU mode), tracker
                              states], (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)

each in CKPT/iter_0000005 with CKPT/latest_checkpointed_iteration.txt = "5". WORKDIR/<name>_expected.pt holds
the model's HF tensors (`export_hf_weights`, in memory) for the test to compare the conversion with.
WORKDIR/hostile_{rng,nested,args,extra_state} are the distributed-optimizer checkpoint with an os.system
payload in the RNG state's numpy entry, in a BytesIO inside the RNG state, in `args`, and in a linear
layer's `_extra_state` as a pickle in a byte tensor (Transformer Engine's format, read with pickle.loads).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bridge_common import causal_mask  # noqa: E402
from moe_layout import plain_gpt_model  # noqa: E402

ITERATION = 5


class RunsShell:
    """Pickles to os.system(touch MARKER): what a crafted checkpoint would run on load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def megatron_lm_args(distributed: bool) -> argparse.Namespace:
    """The value types of Megatron-LM's `args` (658 fields there; these are its non-plain kinds)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        ckpt_format="torch_dist",
        transformer_impl="local",
        use_distributed_optimizer=distributed,
        tensor_model_parallel_size=1,
        num_layers=4,
        lr=1e-3,
        seed=1234,
        load=None,
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        params_dtype=torch.float32,
        main_grads_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        cp_comm_type=["p2p"],
        profile_ranks=[0],
    )


def rng_state() -> list:
    """`get_rng_state` of megatron/training/checkpointing.py, without data_parallel_random_init."""
    from megatron.core import tensor_parallel

    return [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state(),  # CPU mode: the CPU generator's
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
    ]


def trained_model(hf_dir, distributed: bool):
    """A plain GPTModel (norms perturbed so a misplaced norm shows), DDP-wrapped, after one Adam step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(3)
    model = plain_gpt_model(hf_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed, params_dtype=torch.float32),
        [ddp],
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    ids = torch.randint(0, model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    ddp.zero_grad_buffer()
    opt.zero_grad()
    logits = ddp(ids, torch.arange(8)[None].expand(2, 8), causal_mask(8))
    logits.float().square().mean().backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    sched.step(1)
    return model, ddp, opt, sched


def save_like_megatron_lm(ckpt: Path, model, ddp, opt, sched, args, rng, extra_state=None) -> None:
    """save_checkpoint(ITERATION, ...) of Megatron-LM with --ckpt-format torch_dist."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    sd_metadata = {**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    state["model"] = model.sharded_state_dict(metadata=sd_metadata)  # save_checkpoint unwraps DDP first
    state["optimizer"] = opt.sharded_state_dict(state, metadata=sd_metadata)
    state["opt_param_scheduler"] = sched.state_dict()
    state["rng_state"] = ShardedObject(
        "rng_state",
        rng,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )
    state["num_floating_point_operations_so_far"] = 0
    if extra_state is not None:  # what Transformer Engine's linear layers store (a pickle in a byte tensor)
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        for sh in nested_values(state["model"]):
            if isinstance(sh, ShardedObject) and sh.key.endswith("linear_qkv._extra_state"):
                sh.data = extra_state
    sub = ckpt / f"iter_{ITERATION:07d}"
    sub.mkdir(parents=True)
    dist_checkpointing.save(state, str(sub), content_metadata=metadata)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def main(argv) -> int:
    from megatron_dapo.bridge import export_hf_weights
    from megatron_dapo.models import QwenArch
    from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel

    hf_dir, workdir = argv
    work = Path(workdir)
    init_distributed()
    assert dist.get_world_size() == 1
    init_model_parallel(seed=1)
    random.seed(7)
    np.random.seed(7)
    for name, distributed in (("plain", False), ("distributed", True)):
        model, ddp, opt, sched = trained_model(hf_dir, distributed)
        save_like_megatron_lm(work / name, model, ddp, opt, sched, megatron_lm_args(distributed), rng_state())
        model.arch = QwenArch.from_hf(hf_dir)  # what the exporter reads the HF layout from
        torch.save(dict(export_hf_weights([model], dst_rank=None)), work / f"{name}_expected.pt")
        print(f"CHECK PASSED saved {name}", flush=True)

    marker = work / "pwned"
    hostile_rng = rng_state()
    hostile_rng[0]["np_rng_state"] = RunsShell(marker)
    nested = io.BytesIO()
    torch.save({"state": RunsShell(marker)}, nested)
    nested_rng = rng_state()
    nested_rng[0]["rng_tracker_states"] = {"model-parallel-rng": nested}
    hostile_args = megatron_lm_args(True)
    hostile_args.tokenizer = RunsShell(marker)
    te_pickle = torch.frombuffer(bytearray(pickle.dumps({"recipe": RunsShell(marker)})), dtype=torch.uint8)
    for name, args, rng, extra_state in (
        ("hostile_rng", megatron_lm_args(True), hostile_rng, None),
        ("hostile_nested", megatron_lm_args(True), nested_rng, None),
        ("hostile_args", hostile_args, rng_state(), None),
        ("hostile_extra_state", megatron_lm_args(True), rng_state(), te_pickle),
    ):
        save_like_megatron_lm(work / name, model, ddp, opt, sched, args, rng, extra_state)
    assert not marker.exists()
    print("CHECK PASSED saved hostile", flush=True)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
