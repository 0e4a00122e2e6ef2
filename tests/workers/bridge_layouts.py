"""Load tiny HF models into megatron-core at several layouts; compare logits with HF and exports with the files.

usage: bridge_layouts.py LAYOUT[,LAYOUT...] WORKDIR    (LAYOUT: a key of LAYOUTS; the checks of actor_checks.run_checks)
Prints one line `RESULT <variant> <layout> rel=<max rel err>` per variant on the last stage's rank 0;
a layout with any failure fails its check.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bridge_common import hf_logits, megatron_logits, rel_err  # noqa: E402

LAYOUTS = {
    "tp1": dict(tp=1),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "ep2": dict(ep=2),
    "tp2pp2": dict(tp=2, pp=2),
    "tp2ep2": dict(tp=2, ep=2),
    "pp2vpp2": dict(pp=2, vpp=2),
}
# name -> (family, overrides of the tiny config)
VARIANTS = {
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2": ("qwen2", {}),
    # padded vocabulary (250 -> 256) with tied embeddings: the last PP stage loads its copy of the embedding
    "qwen2_tied_v250": ("qwen2", dict(vocab_size=250, tie_word_embeddings=True)),
    # norm_topk_prob=False <-> megatron moe_router_pre_softmax=True; dense layer every 2nd via decoder_sparse_step
    "qwen3_moe_nonorm": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2)),
}
TOL = 1e-5


def variants_for(layout: str) -> list[str]:
    if "ep" in layout:
        return ["qwen3_moe", "qwen3_moe_nonorm"]
    return list(VARIANTS)


def layout_failures(layout: str, workdir: Path) -> list[str]:
    """Load every variant of `layout`'s families at `layout`; what differs from HF or from the files."""
    from safetensors.torch import load_file

    from megatron_dapo.bridge import export_hf_weights, load_hf_into_megatron
    from megatron_dapo.models import ModelParallel, QwenArch, build_gpt_model
    from megatron_dapo.runtime.distributed import init_model_parallel

    rank = dist.get_rank()
    ids = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(0))
    failures = []
    sizes = LAYOUTS[layout]
    init_model_parallel(**sizes)
    for name in variants_for(layout):
        hf_dir = save_variant(workdir, name)
        arch = QwenArch.from_hf(hf_dir)
        par = ModelParallel(**sizes, sequence_parallel=arch.is_moe and sizes.get("tp", 1) > 1)
        chunks = build_gpt_model(hf_dir, par)
        load_hf_into_megatron(chunks, hf_dir)
        got = megatron_logits(chunks, ids, arch.vocab_size)
        if got is not None:
            err = rel_err(got, hf_logits(hf_dir, ids))
            if rank == dist.get_world_size() - 1:
                print(f"RESULT {name} {layout} rel={err:.3e}", flush=True)
            if not err < TOL:
                failures.append(f"{name} {layout}: logits rel err {err:.3e} >= {TOL}")
        # Round trip: exporting what was loaded gives back every file tensor bit for bit.
        on_disk = load_file(str(hf_dir / "model.safetensors")) if rank == 0 else None
        seen = []
        budget = 1 << 16 if layout in ("tp2", "tp2ep2") else None
        for hf_name, tensor in export_hf_weights(chunks, byte_budget=budget):
            seen.append(hf_name)
            if rank == 0:
                ref = on_disk.get(hf_name)
                if ref is None or tensor.shape != ref.shape or not torch.equal(tensor, ref):
                    failures.append(f"{name} {layout}: exported {hf_name} differs from the file")
            elif tensor is not None:
                failures.append(f"{name} {layout}: rank {rank} received {hf_name}")
        if rank == 0 and sorted(seen) != sorted(on_disk):
            failures.append(
                f"{name} {layout}: exported names differ from the file: {sorted(set(seen) ^ set(on_disk))[:4]}"
            )
        # The order is identical on every rank and every call.
        orders = [None] * dist.get_world_size()
        dist.all_gather_object(orders, seen)
        if any(o != orders[0] for o in orders):
            failures.append(f"{name} {layout}: export order differs between ranks")
        if layout == "tp2ep2" and name == "qwen3_moe":
            # dst_rank=None: every rank receives every full tensor, equal to the file's.
            for hf_name, tensor in export_hf_weights(chunks, dst_rank=None):
                if tensor is None or tensor.shape != torch.Size(_shape(arch, hf_name)):
                    failures.append(f"{name} {layout}: broadcast export gave rank {rank} no/misshaped {hf_name}")
                    break
            if rank == 0:
                print(f"RESULT {name} {layout} broadcast-export ok", flush=True)
            failures += each_source_failures(chunks, arch, on_disk, f"{name} {layout}", rank)
        del chunks
    return failures


def check_layout(layout: str):
    def check(hf_dir, tmpdir):
        failures = layout_failures(layout, Path(tmpdir))
        assert not failures, "\n".join(f"rank {dist.get_rank()}: {f}" for f in failures)

    return check


def save_variant(workdir: Path, name: str) -> Path:
    """The tiny HF model of variant `name`, written by rank 0 on first use (the others wait)."""
    from megatron_dapo.models.tiny import save_tiny_hf_model

    family, over = VARIANTS[name]
    if dist.get_rank() == 0 and not (workdir / name / "config.json").exists():
        save_tiny_hf_model(family, workdir / name, seed=1, **over)
    dist.barrier()
    return workdir / name


CHECKS = {layout: check_layout(layout) for layout in LAYOUTS}  # fn(hf_dir, tmpdir): see actor_checks.run_checks


def each_source_failures(chunks, arch, on_disk, what: str, rank: int) -> list[str]:
    """dst_rank=EACH_SOURCE: every file tensor yielded, bit for bit, on exactly one source rank; the dense ones
    spread over the expert-parallel sources (a TP group of another DP replica gathering some), so that no source
    yields more than the model's bytes / sources + its largest tensor."""
    from megatron_dapo.bridge import EACH_SOURCE, export_hf_weights, export_sources

    sources = export_sources(chunks)
    mine = {n: t.clone() for n, t in export_hf_weights(chunks, dst_rank=EACH_SOURCE) if t is not None}
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, mine)
    if rank != 0:
        return []
    failures = [
        f"{what}: rank {r} is no source but yielded {sorted(m)[:2]}"
        for r, m in enumerate(each)
        if m and r not in sources
    ]
    got = [(n, t) for m in each for n, t in m.items()]
    if sorted(n for n, _ in got) != sorted(on_disk):
        failures.append(f"{what}: EACH_SOURCE export names differ from the file (or repeat)")
    failures += [f"{what}: EACH_SOURCE {n} differs from the file" for n, t in got if not torch.equal(t, on_disk[n])]
    nbytes = {r: sum(t.numel() * t.element_size() for t in m.values()) for r, m in enumerate(each)}
    model, largest = sum(nbytes.values()), max(t.numel() * t.element_size() for t in on_disk.values())
    if max(nbytes.values()) > model / len(sources) + largest:
        failures.append(f"{what}: EACH_SOURCE bytes per rank {nbytes} over model / {len(sources)} sources + {largest}")
    if len(sources) > 1 and not all(any(".experts." not in n for n in each[r]) for r in sources):
        failures.append(f"{what}: the dense tensors were not spread over the sources {sources}")
    if not failures:
        print(f"RESULT {what} each-source-export ok {nbytes}", flush=True)
    return failures


def _shape(arch, name):
    from megatron_dapo.bridge import hf_shape

    return hf_shape(arch, name)


if __name__ == "__main__":
    from actor_checks import run_checks  # here only: bridge_ckpt_load imports this module

    run_checks(sys.argv[1:], CHECKS)
