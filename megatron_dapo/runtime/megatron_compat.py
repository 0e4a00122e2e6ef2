"""The megatron-core releases this package supports, and the one place their differences are handled.

Supported: ``megatron-core>=0.16.1,<0.20`` (``SUPPORTED_RANGE``; pyproject.toml states the same range and
tests/runtime/test_megatron_compat.py checks they agree). Tested: 0.16.1 (the whole suite) and 0.19.2 (the
megatron-core-dependent tests, ``make test-megatron-latest``). 0.17 and 0.18 are in the range untested;
the checks below look for the feature, not the version number, so they take whichever side a release is on.

What differs between 0.16.1 and 0.19.2 on this package's code paths (models/provider.py and specs.py,
runtime/cpu.py, bridge/ and trainer/ checkpoints, the optimizer and DDP, router replay):

* dist_checkpointing's common (non-tensor) state. 0.16.1 has rank 0 write ``common.pt`` alone, before the
  save's collectives, through a registry of save strategies (``strategies/base.py``); 0.19.2 stores it as
  the ShardedObject ``common_state`` inside the torch_dist (DCP) files, written in the collective save, and
  the registry is gone. ``deferred_rank0_writes`` and ``common_state_in_dcp`` cover it; a checkpoint of
  either format is read by ``read_common_state``. 0.19.2 still reads ``common.pt`` checkpoints (0.16.1
  cannot read the common state of a 0.19.2 save).
* GPTModel is deprecated in 0.19 (a warning at construction) in favour of HybridModel; the providers stay
  on GPTModel (``gpt_model_class``): docs/design/megatron-core-versions.md says why and when that changes.

Checked and the same in both: ``moe_utils.te_general_gemm`` (0.16.1 never defines it without Transformer
Engine, 0.19.2 sets it to None; runtime/cpu.py defines it only when absent), ``maybe_move_tensor_to_cpu``,
the CUDA RNG-state functions and the first-dim collectives CPU mode replaces (``CPU_MODE_REPLACES``),
TransformerConfig's fields, ``get_gpt_decoder_block_spec``, DistributedDataParallel(Config),
OptimizerConfig / ``get_megatron_optimizer`` and ``router_replay.RouterReplayAction``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
from pathlib import Path

SUPPORTED_RANGE = ">=0.16.1,<0.20"
TESTED_VERSIONS = ("0.16.1", "0.19.2")

# What the Qwen3 / Qwen3-MoE / Qwen2.5 providers build their models from (models/provider.py, specs.py,
# core_attention.py). GPTModel is deprecated in 0.19; a release without one of these needs the move that
# docs/design/megatron-core-versions.md describes, and tests/runtime/test_megatron_compat.py names them.
PROVIDERS_BUILD_ON = (
    ("megatron.core.models.gpt", "GPTModel"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec"),
    ("megatron.core.transformer", "TransformerConfig"),
    ("megatron.core.transformer.spec_utils", "ModuleSpec"),
    ("megatron.core.transformer.torch_norm", "WrappedTorchNorm"),
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention"),
    ("megatron.core.tensor_parallel.mappings", "gather_from_sequence_parallel_region"),
)

# The module-level names runtime/cpu.py replaces. Replacing a name megatron-core no longer has would
# change nothing and leave CPU mode silently broken, so tests check that each exists.
CPU_MODE_REPLACES = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim"),
)

COMMON_PT = "common.pt"  # megatron-core <= 0.16's file of the common state
COMMON_STATE_KEY = "common_state"  # the ShardedObject holding it inside the DCP files (0.19)


def megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def missing_names(names) -> list[str]:
    """The `module.name` entries of `names` ((module, name) pairs) that megatron-core does not provide."""
    missing = []
    for module, name in names:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name}")
    return missing


def gpt_model_class():
    """megatron-core's GPTModel, which the Qwen3 / Qwen3-MoE / Qwen2.5 providers build.

    Deprecated in 0.19 in favour of HybridModel, which has no local (non-Transformer-Engine) layer spec and
    no QK norm in its attention layer spec yet; the move waits until GPTModel is removed or those exist
    (docs/design/megatron-core-versions.md)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel


def common_state_in_dcp() -> bool:
    """Whether the installed megatron-core's `dist_checkpointing.save` stores the common state as the
    `common_state` object inside the DCP files (0.19.2) rather than as rank 0's `common.pt` (0.16.1)."""
    try:
        from megatron.core.dist_checkpointing.strategies.base import register_default_strategy  # noqa: F401
    except ImportError:
        return True
    return False


@contextlib.contextmanager
def deferred_rank0_writes():
    """Inside: the files rank 0 writes alone during `dist_checkpointing.save`, outside its collectives,
    append their error to the yielded list instead of raising, so the other ranks never wait for rank 0
    in a collective it left. Both files are still written as megatron-core writes them.

    `metadata.json` (every release: rank 0, right before the closing barrier) through the serialization
    module's `save_config`, which has no hook and is wrapped for the block; `common.pt` (0.16.1: rank 0,
    before the collectives) through a deferring common-save strategy registered as the default for the
    block (0.16.1 refuses a `common_strategy` argument). Where the common state is saved inside the
    collective DCP save (0.19.2), a failure there already reaches every rank."""
    from megatron.core.dist_checkpointing import serialization

    errors: list[BaseException] = []

    def deferring(write):
        def call(*args):
            try:
                write(*args)
            except Exception as e:
                errors.append(e)

        return call

    save_config = serialization.save_config
    restore_common = (lambda: None) if common_state_in_dcp() else _defer_common_pt(deferring)
    serialization.save_config = deferring(save_config)
    try:
        yield errors
    finally:
        serialization.save_config = save_config
        restore_common()


@contextlib.contextmanager
def writer_errors_kept():
    """Inside: a failed write keeps its message in megatron-core's error.

    megatron-core 0.19's torch_dist writer runs its last write bucket in the saving thread and asserts on
    the result, so a failed write there (a full disk) surfaces as "error: <class 'OSError'>", its message
    ("No space left on device") only logged. Inside this block that bucket's writer raises its error
    instead, which megatron-core's own handler reports with the message. A no-op where the writer runs
    every bucket in a worker process (0.16.1), whose errors keep their message."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not hasattr(FileSystemWriterAsync, "write_preloaded_data_multithread"):
        yield
        return
    original = FileSystemWriterAsync.__dict__["write_preloaded_data"]
    write = original.__func__

    @functools.wraps(write)
    def raising(*args, **kwargs):
        out = write(*args, **kwargs)
        if kwargs.get("results_queue", True) is None and out is not None and isinstance(out[1], BaseException):
            raise out[1]
        return out

    FileSystemWriterAsync.write_preloaded_data = staticmethod(raising)
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data = original


def _defer_common_pt(deferring):
    """Register a `common.pt` writer that defers its errors as 0.16.1's default; returns the undo."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_common_strategy
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

    class DeferredCommonSave(TorchCommonSaveStrategy):
        save_common = deferring(TorchCommonSaveStrategy.save_common)

    default = get_default_save_common_strategy()
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, DeferredCommonSave("torch", 1))
    return lambda: register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, default)


def _common_state_storage(ckpt_dir: Path):
    """The DCP storage record (relative_path, offset, length) of the `common_state` item, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if index.fqn.startswith(COMMON_STATE_KEY + "/"):
            return info
    return None


def common_state_file(ckpt_dir: str | Path) -> str:
    """Where a dist_checkpointing directory keeps its common state: `common.pt`, or (saved by 0.19) the
    DCP data file holding the `common_state` object, e.g. `__0_0.distcp`."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / COMMON_PT).is_file():
        return COMMON_PT
    info = _common_state_storage(ckpt_dir)
    if info is None:
        raise FileNotFoundError(f"{ckpt_dir} holds no common state (neither {COMMON_PT} nor a {COMMON_STATE_KEY} item)")
    return str(info.relative_path)


def read_common_state(ckpt_dir: str | Path) -> dict:
    """The common state of a dist_checkpointing directory of either format, read with torch's
    `weights_only` loader throughout (the caller admits megatron-core's globals, e.g. with
    `bridge.dcp_metadata.megatron_safe_globals`): `common.pt`, or the `common_state` item's bytes read
    straight from its DCP data file (DCP's own load would unpickle them with `weights_only=False`)."""
    import torch

    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / COMMON_PT).is_file():
        return torch.load(ckpt_dir / COMMON_PT, map_location="cpu", weights_only=True)
    info = _common_state_storage(ckpt_dir)
    if info is None or getattr(info, "transform_descriptors", None) or "/" in str(info.relative_path):
        raise FileNotFoundError(f"{ckpt_dir} holds no readable common state ({COMMON_PT} or a {COMMON_STATE_KEY} item)")
    with open(ckpt_dir / info.relative_path, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if isinstance(obj, io.BytesIO):  # a ShardedObject's data, saved as a nested torch.save
        obj = torch.load(obj, map_location="cpu", weights_only=True)
    return obj[0]  # megatron-core stores [ShardedObject.data]
