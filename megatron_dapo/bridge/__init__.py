"""HF <-> megatron-core bridge for Qwen3 / Qwen3-MoE / Qwen2.5 (one code path for conversion and weight sync).

Public API:
    load_hf_into_megatron(model_chunks, hf_dir)                      -> None (every rank, no collectives)
    export_hf_weights(model_chunks, byte_budget=None, dst_rank=0)    -> Iterator[(hf_name, tensor | None)]
        (collective; full tensors on dst_rank, on every rank with dst_rank=None, on the rank that
        rebuilds each with dst_rank=EACH_SOURCE)
    export_sources(model_chunks)                                     -> the ranks that rebuild tensors
    save_megatron_checkpoint(model_chunks, out_dir), load_megatron_checkpoint(model_chunks, ckpt)
        (collective; megatron-core dist_checkpointing in Megatron-LM's directory layout, any layout)
    hf_to_megatron(...), megatron_to_hf(...)                          -> the conversions (spawn their ranks)
    hf_names(arch)                                                   -> canonical HF tensor order
    HFCheckpointReader, ShardedSafetensorsWriter                     -> safetensors I/O
    hf_loader.HFWeightLoader(hf_model)                               -> HF checkpoint tensors into a
        transformers model in memory (the embedded server, the FSDP2 actor)
"""

from megatron_dapo.bridge.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
from megatron_dapo.bridge.convert import ConversionError, hf_to_megatron, megatron_to_hf
from megatron_dapo.bridge.export import EACH_SOURCE, Traffic, export_hf_weights, export_sources
from megatron_dapo.bridge.hf_io import CheckpointError, HFCheckpointReader, ShardedSafetensorsWriter
from megatron_dapo.bridge.load import check_hf_checkpoint, load_hf_into_megatron
from megatron_dapo.bridge.mapping import RULES, MappingError, hf_names, hf_shape

__all__ = [
    "EACH_SOURCE",
    "Traffic",
    "export_hf_weights",
    "export_sources",
    "load_hf_into_megatron",
    "check_hf_checkpoint",
    "save_megatron_checkpoint",
    "load_megatron_checkpoint",
    "hf_to_megatron",
    "megatron_to_hf",
    "ConversionError",
    "CheckpointError",
    "MappingError",
    "HFCheckpointReader",
    "ShardedSafetensorsWriter",
    "RULES",
    "hf_names",
    "hf_shape",
]
