"""Engine offload / reload (trainer/offload.py) under torchrun (2 gloo ranks, a tiny Qwen3, DP=2), for the
Megatron and the FSDP2 engine. On CPU the engine's device is the CPU: offload must still free the
storages (0 bytes left), reload must give them back bitwise, and training must not notice.

Usage: offload_checks.py CHECK[,CHECK...] TMPDIR
  offload_megatron, offload_fsdp2: one engine trains two steps plainly; another from the same weights
      trains one step, offloads gradients and optimizer state (the colocated cycle's order), exports its
      weights (the weight update, parameters still resident), offloads the parameters, is refused a
      train step (EngineOffloadedError), reloads everything (parameters and optimizer state bitwise as
      before, gradients zero), goes through a second offload / reload cycle (the host copies reused)
      and trains the second step: its weights equal the plain engine's bitwise.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_dapo.errors import EngineOffloadedError
from megatron_dapo.runtime.distributed import init_model_parallel
from megatron_dapo.trainer.dapo_step import DapoStep
from megatron_dapo.trainer.fsdp_engine import FSDPEngine
from megatron_dapo.trainer.megatron_engine import MegatronEngine
from megatron_dapo.trainer.offload import local_tensor
from tests.workers.actor_checks import exported, log, make_batch, run_checks
from tests.workers.dapo_step_checks import step_config


def storages(engine, part: str) -> list:
    """The part's device storages on this rank (what offload frees)."""
    return engine._offload.storages()[part]


def snapshot(engine, part: str) -> list[torch.Tensor]:
    return [local_tensor(t).detach().clone() for t in engine._offload.collectors[part]() if t is not None]


def assert_bitwise(before: list[torch.Tensor], engine, part: str) -> None:
    after = [local_tensor(t) for t in engine._offload.collectors[part]() if t is not None]
    assert len(after) == len(before), (part, len(after), len(before))
    for i, (a, b) in enumerate(zip(after, before)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (part, i)


def two_steps(engine_cls, cfg, cycle: bool) -> dict[str, torch.Tensor]:
    engine = engine_cls(cfg)
    actor = DapoStep(engine, cfg)
    actor.train_step(make_batch(seed=11, n_groups=4))
    if cycle:
        offload_cycle(engine, actor)
    actor.train_step(make_batch(seed=12, n_groups=4))
    return exported(actor)


def offload_cycle(engine, actor) -> None:
    params, optimizer = snapshot(engine, "params"), snapshot(engine, "optimizer")
    param_bytes = sum(s.nbytes() for s in storages(engine, "params"))
    weights = exported(actor)

    freed = engine.offload({"grads", "optimizer"})
    assert set(freed) == {"grads", "optimizer"} and freed["optimizer"] > 0, freed
    if isinstance(engine, MegatronEngine):
        assert freed["grads"] > 0, freed  # DDP's grad buffers (FSDP2's grads are None after the step)
    for part in ("grads", "optimizer"):
        assert all(s.nbytes() == 0 for s in storages(engine, part)), part
    after = exported(actor)  # the weight update reads the resident parameters
    assert all(torch.equal(after[k], weights[k]) for k in weights)

    freed = engine.offload("params")
    assert freed == {"params": param_bytes}, (freed, param_bytes)
    assert all(s.nbytes() == 0 for s in storages(engine, "params"))
    try:
        actor.train_step(make_batch(seed=12, n_groups=4))
    except EngineOffloadedError as e:
        assert "forward_backward" in str(e) and "params" in str(e), e
    else:
        raise AssertionError("a train step ran on an offloaded engine")
    try:
        engine.offload({"weights"})
    except ValueError as e:
        assert "weights" in str(e), e
    else:
        raise AssertionError("an unknown part was accepted")

    back = engine.reload()
    assert back["params"] == param_bytes and back["optimizer"] == freed_optimizer_bytes(engine), back
    assert_bitwise(params, engine, "params")
    assert_bitwise(optimizer, engine, "optimizer")
    assert all(not local_tensor(t).any() for t in engine._offload.collectors["grads"]() if t is not None)

    host = [id(h) for h in engine._offload._host["params"]]
    engine.offload()
    engine.reload()
    assert [id(h) for h in engine._offload._host["params"]] == host  # pinned copies are allocated once
    assert_bitwise(params, engine, "params")
    assert_bitwise(optimizer, engine, "optimizer")
    log(
        f"{type(engine).__name__}: offload freed {param_bytes} parameter bytes and "
        f"{freed_optimizer_bytes(engine)} optimizer bytes on this rank; reload bitwise"
    )


def freed_optimizer_bytes(engine) -> int:
    return sum(s.nbytes() for s in storages(engine, "optimizer"))


def check_offload(hf_dir, backend: str, engine_cls) -> None:
    init_model_parallel(tp=1, pp=1, seed=1)
    cfg = step_config(hf_dir, backend)
    plain = two_steps(engine_cls, cfg, cycle=False)
    cycled = two_steps(engine_cls, cfg, cycle=True)
    assert plain.keys() == cycled.keys()
    differ = [k for k in plain if not torch.equal(plain[k], cycled[k])]
    assert not differ, differ
    log(f"{backend}: two steps with an offload / reload cycle between them equal two plain steps bitwise")
    dist.barrier()


CHECKS = {
    "offload_megatron": lambda hf_dir, tmpdir: check_offload(hf_dir, "megatron", MegatronEngine),
    "offload_fsdp2": lambda hf_dir, tmpdir: check_offload(hf_dir, "fsdp2", FSDPEngine),
}


if __name__ == "__main__":
    run_checks(sys.argv[1:], CHECKS)
