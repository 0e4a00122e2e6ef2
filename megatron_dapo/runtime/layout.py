"""How a trainer rank sits in the parallel layout: sizes, its own ranks, its process groups.

One frozen value, read once after the process groups exist (in the spirit of torchtitan's
`ParallelDims`), instead of every component asking megatron-core's `parallel_state` on its own:

    layout = ParallelLayout.from_megatron()          # after init_model_parallel
    layout = ParallelLayout.data_parallel_only()     # every rank a data-parallel rank (FSDP2)

A group of None is the default group where the size spans the world (data parallel only), and is
never used where its size is 1. The trainer's step, DP shards and the HF export (bridge/export.py) all
read this one value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel
    dp: int = 1  # data-parallel size (without context parallelism, as megatron-core's DDP reduces over)
    rank: int = 0  # in the default group
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    dp_cp_rank: int = 0  # data-parallel rank with context parallelism: the replica index of a dense parameter
    edp_rank: int = 0  # expert data-parallel rank: the replica index of an expert parameter
    is_last_stage: bool = True  # the pipeline stage that computes logits (and the loss)
    tp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)
    cp_group: Any = field(default=None, compare=False, repr=False)
    etp_group: Any = field(default=None, compare=False, repr=False)

    def tp_split(self, expert: bool) -> tuple[int, int]:
        """(rank, size) of the group a parameter is tensor-split over: expert TP for expert weights."""
        return (self.etp_rank, self.etp) if expert else (self.tp_rank, self.tp)

    def tp_split_group(self, expert: bool):
        return self.etp_group if expert else self.tp_group

    def holds_first_replica(self, expert: bool) -> bool:
        """Whether this rank's copy of a parameter is replica 0 over data (and context) parallelism."""
        return (self.edp_rank if expert else self.dp_cp_rank) == 0

    @classmethod
    def from_megatron(cls) -> ParallelLayout:
        """This rank's layout as megatron-core's parallel state holds it (init_model_parallel first)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            rank=dist.get_rank() if dist.is_initialized() else 0,
            dp_rank=ps.get_data_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            edp_rank=ps.get_expert_data_parallel_rank(),
            is_last_stage=ps.is_pipeline_last_stage(),
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
        )

    @classmethod
    def data_parallel_only(cls) -> ParallelLayout:
        """Every rank of the default group a data-parallel rank (torch.distributed initialised)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        return cls(dp=dist.get_world_size(), rank=rank, dp_rank=rank, dp_cp_rank=rank, edp_rank=rank)
