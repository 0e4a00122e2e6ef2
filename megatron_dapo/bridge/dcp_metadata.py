"""Check the pickles of a torch_dist / DCP checkpoint before torch reads them.

megatron-core's torch_dist format is torch.distributed.checkpoint (DCP), whose `.metadata` file
torch loads with plain `pickle.load`. A crafted one would run code on load. `check_dcp_metadata`
unpickles it first with an allow-list: the dataclasses and enums of `torch.distributed.checkpoint`
(plain records whose constructors only store fields), `torch.Size`, torch dtypes, the layout
decoder, paths and plain containers. Anything else is a ManifestError naming the file and the global.

The other pickles are read with torch's `weights_only=True` loader first, admitting exactly what a
Megatron-LM save holds (`megatron_safe_globals`): DCP's non-tensor items in the data files (which DCP
itself loads with `weights_only=False`), `common.pt` and any other `.pt` file, the `io.BytesIO`
objects nested in them (whoever reads one back unpickles it) and Transformer Engine's `_extra_state`
byte tensors (megatron-core decodes those with plain `pickle.loads`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import pickle
import re
import threading
from pathlib import Path

from megatron_dapo.bridge.manifest import ManifestError

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_PLAIN = {("builtins", n) for n in ("set", "frozenset", "slice", "complex", "bytearray")} | {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),  # DCP records the checkpoint id
}


def _allowed(module: str, name: str):
    """The object a pickle may reference, or None."""
    if (module, name) in _PLAIN:
        return getattr(importlib.import_module(module), name)
    if module == "torch":
        import torch

        obj = getattr(torch, name, None)
        return obj if isinstance(obj, torch.dtype) else None
    if module.startswith(_DCP_MODULES) and "." not in name:
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
    return None


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, f, path: Path):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        obj = _allowed(module, name)
        if obj is None:
            raise ManifestError(
                f"{self.path}: refers to {module}.{name}, which a checkpoint's metadata "
                f"never needs (refusing to unpickle it)"
            )
        return obj


def _load_metadata(path: Path):
    try:
        with open(path, "rb") as f:
            return _AllowListUnpickler(f, path).load()
    except ManifestError:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise ManifestError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {str(e)[:80]})") from None


def _numpy_rng_globals() -> list:
    """What `np.random.get_state()` pickles to (Megatron-LM's `rng_state` holds it): the key array."""
    import numpy as np

    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    return [multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


_SAFE_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def megatron_safe_globals():
    """While inside, torch's `weights_only` loader admits its own types plus exactly megatron-core's
    `SAFE_GLOBALS` (argparse.Namespace, its enums and OptimizerConfig, BytesIO, ...) and numpy's RNG
    state. Globals anything else registered in this process (`torch.serialization.add_safe_globals`)
    are set aside meanwhile, so the verdict does not depend on what was imported before. The list is
    process-wide: the lock keeps two checks from restoring each other's."""
    import torch
    from megatron.core.safe_globals import SAFE_GLOBALS

    with _SAFE_GLOBALS_LOCK:
        registered = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        try:
            torch.serialization.add_safe_globals([*SAFE_GLOBALS, *_numpy_rng_globals()])
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(registered)


def _first_line(e: Exception) -> str:
    """The reason in one line: torch's weights_only refusal names the global after a paragraph of advice."""
    text = str(e)
    refusal = re.search(r"^.*GLOBAL.*$", text, re.MULTILINE)
    return ((refusal.group(0) if refusal else text).strip().splitlines() or [type(e).__name__])[0][:160]


def _nested_pickles(obj, extra_state: bool):
    """The pickles inside a loaded object: each io.BytesIO's bytes (torch.save format) and, under a
    TE `_extra_state` key, each non-empty uint8 tensor (a bare pickle). Yields (kind, bytes). Each
    object is visited once, so shared references (a crafted pickle can nest them) cost nothing extra."""
    import torch

    todo, seen = [obj], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, io.BytesIO):
            yield "torch", obj.getvalue()
        elif isinstance(obj, torch.Tensor):
            if extra_state and obj.dtype == torch.uint8 and obj.numel() > 0:
                yield "pickle", obj.detach().cpu().numpy().tobytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):  # Namespace, OptimizerConfig, ...
            todo.extend(vars(obj).values())


class _BarePickleUnpickler(pickle.Unpickler):
    """A bare pickle (TE's `_extra_state`, written by `pickle.dumps` at protocol 4+, which torch's own
    weights_only unpickler cannot read) resolving only the globals torch's weights_only loader admits
    at this moment; no persistent ids (storages)."""

    def find_class(self, module: str, name: str):
        from torch import _weights_only_unpickler as weights_only

        allowed = {**weights_only._get_allowed_globals(), **weights_only._get_user_allowed_globals()}
        if f"{module}.{name}" not in allowed:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return allowed[f"{module}.{name}"]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id (external storage)")


def _check_plain(blob: bytes, extra_state: bool = False, kind: str = "torch") -> None:
    """Raise unless `blob` (torch.save format, or a bare pickle) and every pickle nested in it load
    with the weights_only loader's globals under `megatron_safe_globals`."""
    import torch

    with megatron_safe_globals():
        if kind == "torch":
            obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        else:
            obj = _BarePickleUnpickler(io.BytesIO(blob)).load()
    for nested_kind, nested in _nested_pickles(obj, extra_state):
        _check_plain(nested, extra_state, nested_kind)


def _check_byte_items(root: Path, metadata) -> None:
    """DCP stores non-tensor values as torch.save blobs inside the data files and loads them with
    `weights_only=False`; read each as plain data first."""

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        name = str(info.relative_path)
        if "/" in name or name in ("", ".", ".."):
            raise ManifestError(f"{root / '.metadata'}: item {index.fqn!r} points outside the checkpoint ({name!r})")
        if getattr(info, "transform_descriptors", None):
            raise ManifestError(f"{root / name}: item {index.fqn!r} is stored with transforms this check cannot read")
        with open(root / name, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            _check_plain(blob, extra_state="_extra_state" in index.fqn)
        except Exception as e:
            raise ManifestError(f"{root / name}: item {index.fqn!r} is not plain data ({_first_line(e)})") from None


def _check_torch_file(path: Path) -> None:
    """megatron-core reads `common.pt` (args, iteration, ...) and object shards with torch.load."""
    try:
        _check_plain(path.read_bytes())
    except Exception as e:
        raise ManifestError(f"{path}: is not plain data ({_first_line(e)})") from None


def check_dcp_metadata(root: str | Path) -> None:
    """ManifestError unless every `.metadata` pickle under `root` holds only allowed types and every
    non-tensor item it lists, and every `.pt` file, loads as plain data."""
    for path in sorted(Path(root).rglob(".metadata")):
        if path.is_file():
            _check_byte_items(path.parent, _load_metadata(path))
    for path in sorted(Path(root).rglob("*.pt")):
        if path.is_file():
            _check_torch_file(path)
