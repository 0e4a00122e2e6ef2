"""The payload of `/update_weights_from_tensor`: named tensors pickled as SGLang 0.5.23 pickles them.

A sender (a colocated trainer) serializes with torch's `ForkingPickler`, as SGLang's
`MultiprocessingSerializer.serialize` does: CPU tensors travel as shared-memory handles, CUDA tensors
as IPC handles, so sender and server must share a host and the sender must keep the tensors alive
until the server answers. The payload is a list of `(name, tensor)` or, with load_format="flattened_bucket",
`{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}` with SGLang's
metadata class (srt/weight_sync/tensor_bucket.py).

Unpickling runs only an explicit allow-list of globals, as SGLang's `SafeUnpickler` does
(srt/utils/common.py): data types and torch's tensor / storage rebuild functions, never whole
modules (torch.* holds callables such as torch.load), nothing that fills memory it is asked for by
size, and nothing that makes a descriptor, process, thread or socket: `multiprocessing.resource_sharer.
DupFd` duplicates a descriptor when it is built and starts a listener thread to hand it out, so a
refused payload of them filled the fd table. Storages therefore arrive by shared-memory file name
only (what `forking_dumps` sends), never by fd. SGLang's metadata class is mapped onto
`FlattenedTensorMetadata` here, so a payload built with SGLang installed loads without it.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """Field for field SGLang 0.5.23's class of the same name; end_idx - start_idx = bytes."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_REBUILD = {
    "torch._utils": [
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_device_tensor_from_cpu_tensor",
    ],
    "torch._tensor": ["_rebuild_from_type_v2"],
    "torch.storage": ["UntypedStorage", "TypedStorage"],
    "torch.serialization": ["_get_layout"],
    "torch.nn.parameter": ["Parameter"],
    "torch.multiprocessing.reductions": [
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_meta_tensor",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
    ],
    # not bytes / bytearray: called with a size they fill that many bytes (a 30-byte payload asking for
    # 16 GiB); pickles carry byte strings as opcodes, without the class
    "builtins": ["bool", "dict", "float", "frozenset", "int", "list", "set", "slice", "str", "tuple"],
    "collections": ["OrderedDict"],
    "copyreg": ["__newobj__", "__newobj_ex__", "_reconstructor"],
    "torch": [
        "Size",
        "device",
        "dtype",
        "Tensor",
        "FloatTensor",
        "DoubleTensor",
        "HalfTensor",
        "BFloat16Tensor",
        "ByteTensor",
        "CharTensor",
        "ShortTensor",
        "IntTensor",
        "LongTensor",
        "BoolTensor",
    ],
}
ALLOWED_GLOBALS = {(m, n) for m, names in _REBUILD.items() for n in names}
# every dtype object (torch.float32, torch.bfloat16, ...) pickles as a global of the torch module
ALLOWED_GLOBALS |= {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == SGLANG_METADATA:
            return FlattenedTensorMetadata
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in serialized_named_tensors")


_shm_manager_started = False


def _start_shm_manager_detached() -> None:
    """Start torch's shared-memory manager (`torch_shm_manager`, one per sending process, started by its first
    "file_system" storage) with its standard streams on /dev/null. It lives as long as any process maps memory
    it handed out, a server included, so with the sender's streams it would keep the sender's stdout pipe open
    after the sender exits, and a parent reading that pipe to its end (torchrun's launcher, a test) would
    wait for the server. The streams are redirected for the moment of the start only."""
    global _shm_manager_started
    if _shm_manager_started:
        return
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        torch.empty(1, dtype=torch.uint8).share_memory_()  # starts the manager (strategy: file_system)
        _shm_manager_started = True
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def _file_system_sharing():
    """CPU storages go by shared-memory file name (torch's "file_system" strategy) while pickling: the default
    file-descriptor strategy hands descriptors over multiprocessing's resource sharer, which only a process
    started by the sender (sharing its authkey) may connect to, not an unrelated server."""
    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        _start_shm_manager_detached()
        yield
    finally:
        tmp.set_sharing_strategy(previous)


def forking_dumps(obj) -> bytes:
    """Pickle `obj` with torch's shared-memory tensor reductions, as SGLang's MultiprocessingSerializer
    (CPU storages by shared-memory file name, `_file_system_sharing`)."""
    with _file_system_sharing():
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """What SGLang's MultiprocessingSerializer.serialize produces for a list of (name, tensor)."""
    return forking_dumps(list(named))


class _SGLangNamesPickler(pickle._Pickler):
    """ForkingPickler's reductions (torch's shared-memory / CUDA IPC tensors), with `FlattenedTensorMetadata`
    written under SGLang's module and class name: SGLang's SafeUnpickler admits only that name, and the
    sender need not have SGLang installed. (The pure-Python pickler: the C one insists the name import.)"""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            module, cls = SGLANG_METADATA
            self.write(pickle.GLOBAL + f"{module}\n{cls}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


def serialize_flattened_bucket(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> bytes:
    """The payload of one `load_format="flattened_bucket"` update, as SGLang's senders pickle
    `{"flattened_tensor": ..., "metadata": [...]}` (storages by handle, as `forking_dumps`)."""
    with _file_system_sharing():
        buf = io.BytesIO()
        _SGLangNamesPickler(buf).dump({"flattened_tensor": flat, "metadata": list(metadata)})
        return buf.getvalue()


def flattened_metadata(named: list[tuple[str, torch.Tensor]]) -> list[FlattenedTensorMetadata]:
    """Each tensor's place in the flat bytes of `named` back to back (SGLang's FlattenedTensorBucket)."""
    out, start = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        out.append(FlattenedTensorMetadata(name, t.shape, t.dtype, start, start + n, n))
        start += n
    return out


def load_named_tensors(raw: bytes, flattened: bool) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of a payload; ValueError naming what is wrong with it."""
    payload = SafeUnpickler(io.BytesIO(raw)).load()
    if not flattened:
        if not isinstance(payload, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in payload
        ):
            raise ValueError("expected a list of (name, tensor) pairs")
        return [(str(n), t) for n, t in payload]
    if not isinstance(payload, dict) or not {"flattened_tensor", "metadata"} <= set(payload):
        raise ValueError("load_format=flattened_bucket expects a dict with flattened_tensor and metadata")
    flat, out = payload["flattened_tensor"], []
    for m in payload["metadata"]:
        if not isinstance(m, FlattenedTensorMetadata):
            raise ValueError(f"metadata entries must be FlattenedTensorMetadata, got {type(m).__name__}")
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise ValueError(
                f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) outside the flattened tensor ({flat.numel()} bytes)"
            )
        out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)))
    return out
