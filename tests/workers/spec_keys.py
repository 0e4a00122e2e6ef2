"""The local and Transformer Engine layer specs' checkpoint keys, and checkpoints crossing between them.

usage: spec_keys.py WORKDIR      (one rank)

Transformer Engine's CUDA modules are stood in for (tests/te_stub.py); everything else is megatron-core
0.16.1's own spec code, through this package's `build_gpt_model(use_te=...)`. For a dense Qwen3, an
all-MoE Qwen3-MoE (stacked layers) and a mixed one (per-layer keys):
  keys     the sharded keys (tensors and objects, with global shapes) of the two specs differ only in
           MoE layers' pre-MLP norm: local `mlp.linear_fc1.layer_norm_weight`, TE `pre_mlp_layernorm.weight`
  local>te a local-spec checkpoint loads into a TE-spec model (load_megatron_checkpoint): its export
           equals the HF files bit for bit
  te>local and the other way round; each spec saves its own name; the pre-check admits TE's _extra_state
Prints `CHECK PASSED <family> <check>`; any failure exits non-zero.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the repository root, not tests/: tests/kernels would shadow the `kernels` package transformers imports
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import te_stub  # noqa: E402

te_stub.install()  # before megatron.core is imported

import torch  # noqa: E402

FAMILIES = {
    "dense": ("qwen3", {}),
    "moe_stacked": ("qwen3_moe", {"mlp_only_layers": []}),
    "moe_mixed": ("qwen3_moe", {"mlp_only_layers": [0]}),
}


def sharded_keys(chunk) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    def shape(sh):  # a ShardedTensorFactory (fc1's gate / up halves) holds the local tensor
        return tuple(sh.global_shape) if hasattr(sh, "global_shape") else tuple(sh.data.shape)

    return {sh.key: (type(sh).__name__, shape(sh)) for sh in nested_values(chunk.sharded_state_dict())}


def moe_layer_prefixes(arch) -> list[str]:
    """The key prefix of each MoE layer: one for stacked layers (all-MoE), one per MoE layer otherwise."""
    if not arch.is_moe:
        return []
    if all(arch.moe_layers):
        return ["decoder.layers."]
    return [f"decoder.layers.{i}." for i, moe in enumerate(arch.moe_layers) if moe]


def check_keys(name, local, te, arch) -> None:
    from megatron_dapo.bridge.spec_keys import other_spec_key

    k_local, k_te = sharded_keys(local), sharded_keys(te)
    local_only, te_only = sorted(set(k_local) - set(k_te)), sorted(set(k_te) - set(k_local))
    same = set(k_local) & set(k_te)
    assert all(k_local[k] == k_te[k] for k in same), [k for k in same if k_local[k] != k_te[k]][:4]
    assert any(k.endswith("._extra_state") for k in same)  # both specs' linears carry extra state
    layers = moe_layer_prefixes(arch)
    if not layers:
        assert not local_only and not te_only, (local_only, te_only)
    else:
        assert local_only == sorted(p + "mlp.linear_fc1.layer_norm_weight" for p in layers), local_only
        assert te_only == sorted(p + "pre_mlp_layernorm.weight" for p in layers), te_only
        assert sorted(other_spec_key(k) for k in local_only) == te_only
        assert sorted(other_spec_key(k) for k in te_only) == local_only
        assert all(k_local[a] == k_te[other_spec_key(a)] for a in local_only)
    print(f"CHECK PASSED {name} keys ({len(same)} shared, local only {local_only}, TE only {te_only})", flush=True)


def check_crossing(name, hf_dir, arch, work: Path, build) -> None:
    from megatron.core import dist_checkpointing

    from megatron_dapo.bridge import export_hf_weights, load_hf_into_megatron
    from megatron_dapo.bridge.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
    from megatron_dapo.bridge.dcp_metadata import check_dcp_metadata
    from megatron_dapo.bridge.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(hf_dir)
    for src, dst in (("local", "te"), ("te", "local")):
        source = build(src == "te", seed=1)
        load_hf_into_megatron(source, hf_dir)
        ckpt = work / f"{name}_{src}"
        sub = save_megatron_checkpoint(source, ckpt)
        check_dcp_metadata(ckpt)  # TE's (empty) _extra_state passes the pickle pre-check
        saved = set(dist_checkpointing.load_tensors_metadata(str(sub)))
        te_names = {p + "pre_mlp_layernorm.weight" for p in moe_layer_prefixes(arch)}
        local_names = {p + "mlp.linear_fc1.layer_norm_weight" for p in moe_layer_prefixes(arch)}
        own, other = (te_names, local_names) if src == "te" else (local_names, te_names)
        assert own <= saved and not other & saved, sorted(saved)  # each spec writes its own name, as Megatron-LM
        target = build(dst == "te", seed=2)
        with torch.no_grad():  # norms start at 1 as in the HF files: make every tensor differ first
            for param in target[0].parameters():
                param.normal_()
        load_megatron_checkpoint(target, ckpt)
        n = 0
        for hf_name, tensor in export_hf_weights(target, dst_rank=None):
            assert torch.equal(tensor, reader.read(hf_name)), f"{src}>{dst}: {hf_name} differs from the HF file"
            n += 1
        assert n == len(reader.names()), (n, len(reader.names()))
        print(f"CHECK PASSED {name} {src}>{dst} ({n} tensors equal the HF files)", flush=True)


def main(argv) -> int:
    from megatron_dapo.models import QwenArch, build_gpt_model
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel

    (workdir,) = argv
    work = Path(workdir)
    init_distributed()
    init_model_parallel(seed=1)
    for name, (family, overrides) in FAMILIES.items():
        hf_dir = save_tiny_hf_model(family, work / f"hf_{name}", seed=5, **overrides)
        arch = QwenArch.from_hf(hf_dir)

        def build(use_te, seed, hf_dir=hf_dir):
            torch.manual_seed(seed)
            return build_gpt_model(hf_dir, {"tp": 1}, use_te=use_te)

        (local,), (te,) = build(False, 0), build(True, 0)
        assert "TEGroupedMLP" in repr(te) if arch.is_moe else "TELayerNormColumnParallelLinear" in repr(te)
        check_keys(name, local, te, arch)
        check_crossing(name, hf_dir, arch, work, build)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
