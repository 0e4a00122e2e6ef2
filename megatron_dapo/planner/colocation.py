"""Colocated placement (trainer.placement=colocated, docs/placement.md): each GPU's memory in each phase of
the step cycle and what the cycle's transitions cost per step. Pure arithmetic on the per-GPU terms of
`planner.memory`; tests/planner/test_colocation.py checks it against hand computations.

The cycle (one step): rollout (trainer offloaded) -> servers release weights and KV -> trainer reloads
-> train -> trainer offloads gradients and optimizer state -> servers resume weights -> weight update
(CUDA IPC, on the same GPUs) -> trainer offloads parameters -> servers resume KV -> next rollout.

Memory per GPU, by phase (the largest must fit):
  rollout    the server's weights + its KV pool: rollout.mem_fraction_static * GPU memory (the trainer
             holds nothing on the GPU then)
  training   the trainer's stage total (planner.memory: params + grads + the optimizer's GPU part +
             activations + logits); the servers have released everything
  update     the trainer's parameters + the server's weights + one export bucket (rollout.sync.bucket_mb)
Host memory per GPU: the pinned copies of what offload moves (parameters, the optimizer's GPU part), plus
the CPU part of the optimizer with optimizer.cpu_offload.

Transfers per step and GPU over PCIe (trainer/offload.py): offload copies the optimizer's GPU part after
training and the parameters after the update to host memory, reload copies both back; gradients are freed,
not copied (they are dead between steps). Time = bytes / PCIE_GB_S each way, not overlapped with anything.
With optimizer.cpu_offload, each step also copies the offloaded share's fp32 gradients to the host and
its fp32 parameters back (4 + 4 bytes a parameter) and steps Adam on the CPU at CPU_ADAM_PARAMS_S.
Not counted: the servers' release / resume calls (a few CUDA frees and mallocs with SGLang's memory
saver), CUDA context and allocator fragmentation (the plan's headroom).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.planner.memory import RolloutMemory, StageMemory

# GB/s per GPU and direction between pinned host memory and the GPU while all 8 GPUs of a node copy at
# once: a PCIe Gen5 x16 link moves ~55 GB/s alone, but an HGX H100 node's 8 GPUs share two CPUs' PCIe
# switches and memory; 25 GB/s is the rate verl and slime users report for offload on such nodes.
PCIE_GB_S = 25.0
# Parameters per second one GPU's share of the host steps with torch AdamW (fused, fp32, what megatron-core
# 0.16.1's HybridDeviceOptimizer uses): the lesser of its cores' rate (benchmarks/cpu_adam.py: 0.2e9 a
# core on this project's shared CI machine under load, 1e9 idle; RESULTS.md; the loaded figure is taken)
# times the 14 cores a GPU of an HGX H100 node (2 x 56-core Xeon 8480 for 8 GPUs), and its share of host
# memory bandwidth (an Adam step reads parameter, gradient and both moments and writes three of them: 28
# bytes a parameter; 2 sockets x 8 channels of DDR5-4800 = 614 GB/s for 8 GPUs). Both give ~2.7e9.
CPU_ADAM_PARAMS_S_PER_CORE = 2.0e8
CORES_PER_GPU = 14
HOST_MEM_GB_S_PER_GPU = 614.0 / 8
CPU_ADAM_PARAMS_S = min(CPU_ADAM_PARAMS_S_PER_CORE * CORES_PER_GPU, HOST_MEM_GB_S_PER_GPU * 1e9 / 28)


@dataclass(frozen=True)
class ColocatedPhases:
    """One colocated GPU's memory by phase and its transfers per step (bytes; the busiest stage)."""

    rollout_weights: int
    rollout_kv: int
    training: int
    update: int
    host: int  # host memory per GPU
    offload_bytes: int  # device -> host per step
    reload_bytes: int  # host -> device per step
    cpu_optimizer_params: int  # parameters stepped on the CPU per GPU (optimizer.cpu_offload)
    pcie_gb_s: float = PCIE_GB_S
    cpu_adam_params_s: float = CPU_ADAM_PARAMS_S

    @property
    def rollout(self) -> int:
        return self.rollout_weights + max(0, self.rollout_kv)

    @property
    def peak(self) -> int:
        return max(self.rollout, self.training, self.update)

    @property
    def transfer_s(self) -> float:
        """Offload and reload of one step over PCIe."""
        return (self.offload_bytes + self.reload_bytes) / (self.pcie_gb_s * 1e9)

    @property
    def cpu_optimizer_s(self) -> float:
        """optimizer.cpu_offload's extra time per optimizer step: fp32 gradients out, parameters back, Adam on
        the CPU (megatron-core overlaps the copies with the GPU part's step; counted whole here)."""
        n = self.cpu_optimizer_params
        return 8 * n / (self.pcie_gb_s * 1e9) + n / self.cpu_adam_params_s


def colocated_phases(
    cfg: DapoConfig, stages: list[StageMemory], rollout: RolloutMemory, pcie_gb_s: float = PCIE_GB_S
) -> ColocatedPhases:
    worst = max(stages, key=lambda st: st.total)
    moved = max(stages, key=lambda st: st.params + st.optimizer)
    bucket = cfg.rollout.sync.bucket_mb * 2**20
    cpu_params = 0
    if cfg.optimizer.cpu_offload:  # optimizer_cpu = fraction * opt_bytes/param * n + 4 bytes * n
        opt_bytes = 8 if cfg.model.dtype == "fp32" else 12
        cpu_params = max(st.optimizer_cpu for st in stages) // (opt_bytes + 4)
    return ColocatedPhases(
        rollout_weights=rollout.weights,
        rollout_kv=rollout.kv_pool,
        training=worst.total,
        update=max(st.params for st in stages) + rollout.weights + bucket,
        host=max(st.params + st.optimizer + st.optimizer_cpu for st in stages),
        offload_bytes=moved.params + moved.optimizer,
        reload_bytes=moved.params + moved.optimizer,
        cpu_optimizer_params=cpu_params,
        pcie_gb_s=pcie_gb_s,
    )


def optimizer_steps_per_step(cfg: DapoConfig) -> int:
    """Optimizer steps of one training step (one per mini-batch and epoch)."""
    algo = cfg.algo
    return algo.ppo_epochs * max(1, algo.train_batch_size // algo.ppo_mini_batch_size)


def cpu_optimizer_step_s(cfg: DapoConfig, co: ColocatedPhases) -> float:
    """optimizer.cpu_offload's time per training step (0 without it)."""
    return co.cpu_optimizer_s * optimizer_steps_per_step(cfg) if cfg.optimizer.cpu_offload else 0.0


def cycle_s(cfg: DapoConfig, co: ColocatedPhases, update_s: float) -> float:
    """What a colocated step adds to the trainer's compute: offload / reload over PCIe, the CPU optimizer and
    the weight update (`update_s`)."""
    return co.transfer_s + cpu_optimizer_step_s(cfg, co) + update_s
