"""Which of megatron-core's two decoder-layer layouts a dist_checkpointing checkpoint holds.

megatron-core saves a TransformerBlock in one of two ways:

    stacked     decoder.layers.<name>       one tensor per name with a leading layer axis. What GPTModel
                                            writes for homogeneous layers (dense models, all-MoE models
                                            with moe_layer_freq=1) and what Megatron-LM `--load`s.
    per-layer   decoder.layers.<i>.<name>   one tensor per layer. Forced by a list-valued moe_layer_freq
                                            (mixed dense / MoE models) or `non_homogeneous_layers`
                                            metadata; this package wrote its all-MoE checkpoints this
                                            way before it built them with moe_layer_freq=1.

A model reads either layout when its `sharded_state_dict` gets the matching `non_homogeneous_layers`
metadata; `sharded_state_dict_metadata` reads which one a checkpoint holds from its tensor metadata
(the keys), so old checkpoints keep loading and new ones are Megatron-LM's canonical form.
"""

from __future__ import annotations

import re
from pathlib import Path

_PER_LAYER_KEY = re.compile(r"(^|\.)decoder\.layers\.\d+\.")
_STACKED_KEY = re.compile(r"(^|\.)decoder\.layers\.[^\d.]")


def saved_layer_layout(ckpt_dir: str | Path) -> str | None:
    """'stacked' | 'per-layer' for the decoder layers in a dist_checkpointing directory; None if it has none.

    Reads only the checkpoint's metadata file (no tensor data, no collectives).
    """
    from megatron.core import dist_checkpointing

    keys = list(dist_checkpointing.load_tensors_metadata(str(ckpt_dir)))
    if any(_PER_LAYER_KEY.search(k) for k in keys):
        return "per-layer"
    return "stacked" if any(_STACKED_KEY.search(k) for k in keys) else None


def sharded_state_dict_metadata(model_chunks, ckpt_dir: str | Path) -> dict:
    """`metadata` for the chunks' `sharded_state_dict(...)` so they load the layout `ckpt_dir` holds.

    Raises ValueError when the checkpoint is stacked but the model's layers differ (a mixed dense /
    MoE model can only be stored per layer, so the checkpoint is of another model).
    """
    layout = saved_layer_layout(ckpt_dir)
    config = model_chunks[0].config
    freq = config.moe_layer_freq
    mixed = bool(config.num_moe_experts) and not (isinstance(freq, int) and freq == 1)
    if layout == "stacked" and mixed:
        raise ValueError(
            f"checkpoint {ckpt_dir} stores homogeneous (stacked) decoder layers, but the model mixes "
            f"dense and MoE layers (moe_layer_freq={freq}): it is a checkpoint of another model"
        )
    return {"non_homogeneous_layers": layout == "per-layer"}
