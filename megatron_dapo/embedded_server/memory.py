"""Releasing and resuming the embedded server's memory, with SGLang 0.5.23's semantics
(`SchedulerWeightUpdaterManager.release_memory_occupation` / `resume_memory_occupation`).

Tags: `weights`, `kv_cache` (none or an empty list: both). SGLang releases only while the server is idle
(nothing running; queued requests only while paused) and, without `--enable-memory-saver`, its memory
saver is a no-op: the tags are recorded, nothing is freed. With it, torch_memory_saver unmaps the tagged
regions and *drops their contents* (its default; `--enable-weights-cpu-backup` keeps a host copy of the
weights): after resuming, the weights are whatever the next update writes (the model's buffers, rotary
tables and the like, are kept: SGLang stashes and restores them). This does the same to the model's
parameters: each one's storage is replaced by an empty one (the device memory, or on the CPU the heap, goes
back: `malloc_trim`), and on resume by fresh, uninitialised storage of its shape. The KV cache of this
engine is per batch (freed when its batch ends, no pool is reserved), so releasing `kv_cache` holds
admission until it is resumed and returns the freed cache memory the allocator still holds.

With the memory saver, while either tag is released the engine starts no step (requests wait, see
`Engine.hold`), and weight updates are refused while the weights are released (SGLang would write into
unmapped memory). Without it, as in SGLang, generation and updates go on (nothing was freed).
"""

from __future__ import annotations

import ctypes
import gc
import logging

import torch

log = logging.getLogger("megatron_dapo.embedded")

WEIGHTS, KV_CACHE = "weights", "kv_cache"
ALL_TAGS = (KV_CACHE, WEIGHTS)  # SGLang's GPU_MEMORY_ALL_TYPES, less cuda_graph (none here)
NOT_IDLE = "release_memory_occupation should be called only when server is idle."  # SGLang's assertion text


def resolve_tags(tags) -> tuple[str, ...]:
    """SGLang's rule: None or [] means every tag."""
    return tuple(tags) if tags else ALL_TAGS


def return_freed_memory(device: torch.device) -> None:
    """Hand freed memory back to the system: the CUDA caching allocator's blocks, or glibc's heap (freed
    tensors below its mmap threshold stay in the process otherwise)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass


class ModelMemory:
    """The model's parameter storage, released and resumed by tag."""

    def __init__(self, model: torch.nn.Module, memory_saver: bool = False, weights_cpu_backup: bool = False):
        self.model, self.memory_saver, self.weights_cpu_backup = model, memory_saver, weights_cpu_backup
        self.released: set[str] = set()
        self._shapes: dict[str, torch.Size] = {}
        self._backup: dict[str, torch.Tensor] = {}

    @property
    def weights_released(self) -> bool:
        return WEIGHTS in self.released

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def release(self, tags) -> None:
        """Call with the engine idle and its step lock held."""
        tags = resolve_tags(tags)
        self.released |= set(tags)
        if not self.memory_saver:
            return  # SGLang's no-op memory saver: the tags are recorded, nothing is freed
        device = next(self.model.parameters()).device
        if WEIGHTS in tags and not self._shapes:
            for name, p in self.model.named_parameters():  # each shared (tied) parameter once
                self._shapes[name] = p.shape
                if self.weights_cpu_backup:
                    self._backup[name] = p.detach().to("cpu", copy=True)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return_freed_memory(device)

    def resume(self, tags) -> None:
        """Call with the engine's step lock held. A tag not released is an error, as in SGLang (its
        `offload_tags.remove`)."""
        tags = resolve_tags(tags)
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise ValueError(f"tags {missing} are not released; released: {sorted(self.released)}")
        self.released -= set(tags)
        if WEIGHTS in tags and self._shapes:
            params = dict(self.model.named_parameters())
            for name, shape in self._shapes.items():
                p = params[name]
                backup = self._backup.pop(name, None)
                if backup is not None:
                    p.data = backup.to(p.device)
                else:  # contents dropped, as torch_memory_saver without CPU backup: the next update writes them
                    p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            self._shapes = {}
