"""Check the pickles of a torch_dist / DCP checkpoint before torch reads them.

megatron-core's torch_dist format is torch.distributed.checkpoint (DCP), whose `.metadata` file
torch loads with plain `pickle.load`. A crafted one would run code on load. `check_dcp_metadata`
unpickles it first with an allow-list: the dataclasses and enums of `torch.distributed.checkpoint`
(plain records whose constructors only store fields), `torch.Size`, torch dtypes, the layout
decoder, paths and plain containers. Anything else is a ManifestError naming the file and the global.
DCP also keeps non-tensor values as pickles inside the data files, which it loads with
`weights_only=False`: each is read here with torch's `weights_only=True` loader first.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
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


def _check_byte_items(root: Path, metadata) -> None:
    """DCP stores non-tensor values as torch.save blobs inside the data files and loads them with
    `weights_only=False`; read each with `weights_only=True` first (megatron-core's hold plain data)."""

    import torch
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
            torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            raise ManifestError(f"{root / name}: item {index.fqn!r} is not plain data ({reason})") from None


def check_dcp_metadata(root: str | Path) -> None:
    """ManifestError unless every `.metadata` pickle under `root` holds only allowed types and every
    non-tensor item it lists loads as plain data."""
    for path in sorted(Path(root).rglob(".metadata")):
        if path.is_file():
            _check_byte_items(path.parent, _load_metadata(path))
