"""HF <-> megatron-core checkpoint conversion, run on its own ranks (gloo on CPU, NCCL on GPUs).

`hf_to_megatron` and `megatron_to_hf` check their inputs in the calling process (architecture,
parallel sizes, tensor names and shapes), then spawn `world` ranks on loopback that do the work
through the bridge. Output goes to a temporary sibling directory that is renamed into place at the
end; on any failure it is removed, so a failed conversion leaves no output directory.
A megatron-core checkpoint written by `hf_to_megatron` gets a manifest (size + SHA-256 of every
file, `bridge.manifest`); `megatron_to_hf` verifies it (or the training checkpoint's) first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_dapo.bridge import fp8
from megatron_dapo.bridge.dcp_metadata import check_dcp_metadata
from megatron_dapo.bridge.manifest import MANIFEST, ManifestError, verify_manifest, write_manifest
from megatron_dapo.models import build_gpt_model
from megatron_dapo.models.arch import QwenArch
from megatron_dapo.models.provider import ModelParallel, check_divisibility
from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
from megatron_dapo.runtime.net import LOOPBACK, free_port

# Files of an HF model directory that are not weights: copied along with the config.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
log = logging.getLogger(__name__)


class ConversionError(RuntimeError):
    pass


@dataclass(frozen=True)
class _Job:
    kind: str  # "hf-to-megatron" | "megatron-to-hf"
    src: str
    tmp_out: str
    parallel: ModelParallel
    hf_config_dir: str
    max_shard_bytes: int = 5 * 1024**3
    weight_format: str = "bf16"  # of the HF checkpoint written (megatron-to-hf): bf16 | fp8_block


def world_size_for(par: ModelParallel) -> int:
    """Ranks needed for a layout: dense ranks tp * dp must also hold whole ep * etp expert groups."""
    expert = par.ep * par.expert_tp
    return par.pp * math.lcm(par.tp, expert)


def copy_hf_side_files(src: Path, dst: Path) -> None:
    """config.json, tokenizer and generation files of an HF directory (everything but weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)


def _default_dtype(hf_config_dir: Path) -> str:
    cfg = json.loads((hf_config_dir / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def _tmp_sibling(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _run(job: _Job, out: Path) -> Path:
    import torch.multiprocessing as mp

    if out.exists():
        raise ConversionError(f"output directory {out} already exists; remove it or choose another --out")
    tmp = Path(job.tmp_out)
    blocker = next((p for p in (out.parent, *out.parent.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConversionError(f"cannot create the output directory {out}: {blocker} is a file, not a directory")
    try:  # e.g. a read-only parent: say so before any rank starts
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConversionError(f"cannot create the output directory {out}: {e.strerror}") from None
    world = world_size_for(job.parallel)
    try:
        ctx = mp.start_processes(
            _worker, args=(world, LOOPBACK, free_port(), job), nprocs=world, start_method="spawn", join=False
        )
        try:
            while not ctx.join():
                pass
        except mp.ProcessRaisedException as e:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            msg = lines[-1] if lines else str(e)
            if len(msg) > 800:  # e.g. dist_checkpointing lists every missing key; the ranks printed it all
                msg = msg[:800] + " ... (full message above)"
            raise ConversionError(msg) from None
        except mp.ProcessExitedException as e:
            raise ConversionError(f"a conversion rank died: {e}") from None
        if job.kind == "hf-to-megatron":
            write_manifest(tmp)  # last: a checkpoint with a manifest is complete
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def verify_checkpoint_integrity(ckpt: Path) -> bool:
    """Check `ckpt` against its manifest: its own (hf-to-megatron output) or, for a training
    checkpoint's `model/` directory, the training checkpoint's. False when there is none (a
    checkpoint of Megatron-LM or of an older version): its files are then unchecked. Either way its
    pickled DCP metadata is then checked against an allow-list, before torch reads it."""
    try:
        if (ckpt / MANIFEST).is_file():
            verify_manifest(ckpt)
        elif (ckpt.parent / MANIFEST).is_file():
            verify_manifest(ckpt.parent, subdir=ckpt.name)
        else:
            check_dcp_metadata(ckpt)
            return False
        check_dcp_metadata(ckpt)
    except ManifestError as e:
        raise ConversionError(str(e)) from None
    return True


def _worker(local_rank: int, world: int, addr: str, port: int, job: _Job) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    init_distributed()
    par = job.parallel
    try:
        init_model_parallel(tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp)
        if job.kind == "hf-to-megatron":
            _hf_to_megatron_rank(job)
        else:
            _megatron_to_hf_rank(job)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        destroy_distributed()


def _hf_to_megatron_rank(job: _Job) -> None:
    import torch.distributed as dist

    from megatron_dapo.bridge.checkpoint import HF_CONFIG_DIR, save_megatron_checkpoint
    from megatron_dapo.bridge.load import load_hf_into_megatron

    chunks = build_gpt_model(job.src, job.parallel)
    load_hf_into_megatron(chunks, job.src, progress=dist.get_rank() == 0)
    save_megatron_checkpoint(chunks, job.tmp_out)
    if dist.get_rank() == 0:
        copy_hf_side_files(Path(job.src), Path(job.tmp_out) / HF_CONFIG_DIR)


def _megatron_to_hf_rank(job: _Job) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_dapo.bridge.checkpoint import load_megatron_checkpoint
    from megatron_dapo.bridge.export import export_hf_weights
    from megatron_dapo.bridge.hf_io import ShardedSafetensorsWriter
    from megatron_dapo.bridge.mapping import hf_names

    chunks = build_gpt_model(job.hf_config_dir, job.parallel)
    load_megatron_checkpoint(chunks, job.src)
    rank0 = dist.get_rank() == 0
    writer = ShardedSafetensorsWriter(job.tmp_out, job.max_shard_bytes) if rank0 else None
    items = export_hf_weights(chunks)
    names = hf_names(chunks[0].arch)
    if rank0:
        items = tqdm(items, total=len(names), desc="export HF tensors", unit="tensor")
    if job.weight_format == "fp8_block":
        items = fp8.quantize_stream(items)
    for name, tensor in items:
        if rank0:
            writer.add(name, tensor)
    if rank0:
        writer.close()
        copy_hf_side_files(Path(job.hf_config_dir), Path(job.tmp_out))
        _set_config_dtype(Path(job.tmp_out) / "config.json", job.parallel.torch_dtype)
        if job.weight_format == "fp8_block":
            _set_quantization_config(Path(job.tmp_out) / "config.json", names)
    dist.barrier()


def _set_quantization_config(path: Path, names) -> None:
    """Mark the config.json at `path` as an FP8 block checkpoint (what SGLang's Fp8Config reads)."""
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = fp8.quantization_config(fp8.not_converted_modules(names))
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _check_weight_format(weight_format: str) -> None:
    if weight_format not in fp8.WEIGHT_FORMATS:
        raise ConversionError(f"weight format {weight_format!r}: expected one of {fp8.WEIGHT_FORMATS}")


def hf_to_fp8(hf_dir: str | Path, out: str | Path, max_shard_bytes: int = 5 * 1024**3) -> Path:
    """An FP8 block-quantized copy of a bf16 / fp32 HF Qwen checkpoint (for the first start of servers run with
    rollout.weight_format=fp8_block): linear weights float8_e4m3fn + `weight_scale_inv`, the rest as it is,
    config.json with quantization_config. One tensor in memory at a time; written to a temporary sibling
    directory renamed into place at the end."""
    from megatron_dapo.bridge.hf_io import ShardedSafetensorsWriter
    from megatron_dapo.bridge.load import check_hf_checkpoint
    from megatron_dapo.bridge.mapping import hf_names

    hf_dir, out = Path(hf_dir), Path(out)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"no config.json in {hf_dir}")
    if json.loads((hf_dir / "config.json").read_text()).get("quantization_config"):
        raise ConversionError(f"{hf_dir}/config.json has a quantization_config already: give the bf16 checkpoint")
    arch = QwenArch.from_hf(hf_dir)
    reader = check_hf_checkpoint(arch, hf_dir)  # names and shapes, before anything is written
    if out.exists():
        raise ConversionError(f"output directory {out} already exists; remove it or choose another --out")
    tmp = _tmp_sibling(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        names = [n for n in hf_names(arch) if n in reader.names()]
        for name, t in fp8.quantize_stream((n, reader.read(n)) for n in names):
            writer.add(name, t)
        writer.close()
        copy_hf_side_files(hf_dir, tmp)
        _set_quantization_config(tmp / "config.json", names)
        os.replace(tmp, out)
    except OSError as e:
        raise ConversionError(f"cannot write {out}: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _set_config_dtype(path: Path, dtype) -> None:
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    cfg["dtype"] = name
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _layout(arch: QwenArch, tp: int, pp: int, ep: int, etp: int | None, dtype: str) -> ModelParallel:
    if ep > 1 and not arch.is_moe:
        raise ConversionError(f"ep={ep} needs a MoE model; {arch.family} has no experts")
    par = ModelParallel(tp=tp, pp=pp, ep=ep, etp=etp, dtype=dtype)
    par = replace(par, sequence_parallel=arch.is_moe and tp > 1)
    par.torch_dtype  # noqa: B018 - validates the dtype name
    check_divisibility(arch, par)
    return par


def hf_to_megatron(
    hf_dir: str | Path,
    out: str | Path,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dtype: str | None = None,
) -> Path:
    """Convert an HF Qwen checkpoint into a megatron-core dist_checkpointing checkpoint saved at TP/PP/EP."""
    from megatron_dapo.bridge.load import check_hf_checkpoint

    hf_dir, out = Path(hf_dir), Path(out)
    arch = QwenArch.from_hf(hf_dir)
    par = _layout(arch, tp, pp, ep, etp, dtype or _default_dtype(hf_dir))
    check_hf_checkpoint(arch, hf_dir)  # names and shapes, before any rank starts
    job = _Job("hf-to-megatron", str(hf_dir), str(_tmp_sibling(out)), par, str(hf_dir))
    return _run(job, out)


def megatron_to_hf(
    ckpt: str | Path,
    out: str | Path,
    hf_config_dir: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    weight_format: str = "bf16",
) -> Path:
    """Convert a dist_checkpointing checkpoint of this package into HF safetensors (+ index, config, tokenizer);
    with weight_format fp8_block, in the FP8 block layout (bridge.fp8; the dtype then applies to the tensors
    left unquantized).

    The checkpoint is read at layout tp/pp/ep (default one rank; any layout works, larger ones need less
    memory per rank). `hf_config_dir` defaults to the checkpoint's `hf_config/` directory.
    """
    from megatron_dapo.bridge.checkpoint import HF_CONFIG_DIR, checkpoint_dir

    ckpt, out = Path(ckpt), Path(out)
    if not (isinstance(max_shard_bytes, int) and max_shard_bytes >= 1):
        raise ConversionError(f"max shard size must be a positive number of bytes, got {max_shard_bytes!r}")
    checkpoint_dir(ckpt)
    if not verify_checkpoint_integrity(ckpt.resolve()):
        log.warning("%s has no manifest.json: its files cannot be checked for corruption", ckpt)
    hf_config_dir = Path(hf_config_dir) if hf_config_dir else ckpt / HF_CONFIG_DIR
    if not (hf_config_dir / "config.json").is_file():
        raise ConversionError(f"no config.json in {hf_config_dir}: pass --hf-config DIR of the HF model")
    arch = QwenArch.from_hf(hf_config_dir)
    saved_config = ckpt / HF_CONFIG_DIR / "config.json"
    if saved_config.is_file() and QwenArch.from_hf(saved_config) != arch:
        saved = QwenArch.from_hf(saved_config)
        diff = [
            f"{k}: {getattr(saved, k)!r} vs {getattr(arch, k)!r}"
            for k in vars(arch)
            if getattr(saved, k) != getattr(arch, k)
        ]
        raise ConversionError(
            f"{hf_config_dir} describes another model than the checkpoint's {saved_config} ({'; '.join(diff[:4])})"
        )
    _check_weight_format(weight_format)
    par = _layout(arch, tp, pp, ep, etp, dtype or _default_dtype(hf_config_dir))
    job = _Job(
        "megatron-to-hf", str(ckpt), str(_tmp_sibling(out)), par, str(hf_config_dir), max_shard_bytes, weight_format
    )
    return _run(job, out)
