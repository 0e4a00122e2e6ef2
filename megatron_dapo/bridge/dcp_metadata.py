"""Check the one pickle of a torch_dist / DCP checkpoint before torch reads it.

megatron-core's torch_dist format is torch.distributed.checkpoint (DCP), whose `.metadata` file
torch loads with plain `pickle.load`. A crafted one would run code on load. `check_dcp_metadata`
unpickles it first with an allow-list: the dataclasses and enums of `torch.distributed.checkpoint`
(plain records whose constructors only store fields), `torch.Size`, torch dtypes, the layout
decoder, paths and plain containers. Anything else is a ManifestError naming the file and the global.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pickle
from pathlib import Path

from megatron_dapo.bridge.manifest import ManifestError

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_PLAIN = {("builtins", n) for n in ("set", "frozenset", "slice", "complex", "bytearray")} | {
    ("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # DCP records the checkpoint id
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
            raise ManifestError(f"{self.path}: refers to {module}.{name}, which a checkpoint's metadata "
                                f"never needs (refusing to unpickle it)")
        return obj


def check_dcp_metadata(root: str | Path) -> None:
    """ManifestError unless every `.metadata` pickle under `root` holds only allowed types."""
    for path in sorted(Path(root).rglob(".metadata")):
        if not path.is_file():
            continue
        try:
            with open(path, "rb") as f:
                _AllowListUnpickler(f, path).load()
        except ManifestError:
            raise
        except Exception as e:  # truncated or not a pickle at all
            raise ManifestError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {str(e)[:80]})") from None
