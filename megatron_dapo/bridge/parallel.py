"""What the bridge reads of a rank's place in the parallel layout (runtime.layout.ParallelLayout)."""

from __future__ import annotations

from megatron_dapo.runtime.layout import ParallelLayout


def tp_split_ranks(layout: ParallelLayout, expert: bool) -> frozenset[int]:
    """The global ranks of the group this rank's share of a parameter is TP-split over (itself included)."""
    if layout.tp_split(expert)[1] == 1:
        return frozenset([layout.rank])
    import torch.distributed as dist

    return frozenset(dist.get_process_group_ranks(layout.tp_split_group(expert)))


def local_units(model_chunks, arch, layout: ParallelLayout):
    """[(unit, parameter)] of every parameter of this rank's chunks."""
    from megatron_dapo.bridge.mapping import resolve

    num_local_experts = arch.num_experts // layout.ep if arch.is_moe else 0
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
