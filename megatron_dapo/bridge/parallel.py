"""Where this rank sits in megatron-core's parallel layout, as the bridge needs it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    rank: int
    tp_rank: int
    tp_size: int
    etp_rank: int
    etp_size: int
    ep_rank: int
    ep_size: int
    pp_rank: int
    dp_rank: int  # data parallel rank (with context parallel) of dense parameters
    edp_rank: int  # expert data parallel rank of expert parameters

    @classmethod
    def current(cls) -> "RankLayout":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return cls(
            rank=dist.get_rank() if dist.is_initialized() else 0,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            edp_rank=ps.get_expert_data_parallel_rank(),
        )

    def split(self, expert: bool) -> tuple[int, int]:
        """(rank, size) of the group a parameter is TP-split over."""
        return (self.etp_rank, self.etp_size) if expert else (self.tp_rank, self.tp_size)

    def is_source(self, expert: bool) -> bool:
        """Whether this rank's replica of a parameter is the one the exporter gathers."""
        return (self.edp_rank if expert else self.dp_rank) == 0

    def split_ranks(self, expert: bool) -> frozenset[int]:
        """The global ranks of the group this rank's share of a parameter is TP-split over (itself included)."""
        if self.split(expert)[1] == 1:
            return frozenset([self.rank])
        import torch.distributed as dist

        return frozenset(dist.get_process_group_ranks(self.split_group(expert)))

    def split_group(self, expert: bool):
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()


def local_units(model_chunks, arch, layout: RankLayout):
    """[(unit, parameter)] of every parameter of this rank's chunks."""
    from megatron_dapo.bridge.mapping import resolve

    num_local_experts = arch.num_experts // layout.ep_size if arch.is_moe else 0
    out = []
    for chunk in model_chunks:
        chunk = unwrap_model(chunk)
        for name, param in chunk.named_parameters():
            out.append((resolve(name, chunk, arch, layout.ep_rank, num_local_experts), param))
    return out


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def model_arch(model_chunks):
    arch = getattr(unwrap_model(model_chunks[0]), "arch", None)
    if arch is None:
        raise ValueError("model chunks carry no `.arch`: build them with megatron_dapo.models.build_gpt_model")
    return arch
