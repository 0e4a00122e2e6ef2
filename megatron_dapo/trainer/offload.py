"""A training engine's state moved off its device and back (colocated placement: the rollout servers use
the same GPUs between two training phases).

Three parts, offloaded and reloaded separately because the colocated cycle frees them at different
times (after training: gradients and optimizer state; after the weight update, which reads the
parameters: the parameters):

    "params"     the model's parameters and buffers (for megatron-core DDP with the distributed
                 optimizer: its contiguous param buffers, the parameters being views of them)
    "grads"      the gradient buffers (megatron-core DDP's contiguous grad buffers, which `main_grad`
                 views; FSDP2's sharded `.grad`s)
    "optimizer"  the optimizer's own tensors: fp32 master parameters where they are not the model's,
                 Adam moments and steps (megatron-core's HybridDeviceOptimizer: those of its GPU part)

The unit is the storage, not the tensor: each storage a part's tensors live in is copied to host memory
(pinned where CUDA is available, allocated once and reused every cycle) and then resized to 0 bytes,
which frees the device memory while every tensor and view of it stays a valid object (megatron-core's
`param.main_grad`, the buckets' views, FSDP2's shards, the optimizer's state dict keep pointing at it).
Reload resizes each storage back and copies the bytes in: the state is bitwise what it was.
Gradients are not copied: between two steps they are dead (the next step zeroes them before its
backward), so offload just frees them and reload gives zeros (megatron-core's own
`DistributedDataParallel.offload_grad_buffers` does the same).

Why not megatron-core 0.16.1's own helpers (`DistributedDataParallel.offload_grad_buffers`,
`_ParamAndGradBuffer.offload_to_cpu`, `MegatronOptimizer.offload_to_cpu`): they are CUDA-only
(`torch.cuda.synchronize`, `is_cuda` filters, `.pin_memory()`), the parameter path covers only the
distributed optimizer's param buffer (`param_data` is None without it), and the optimizer path rebinds
`p.data` / state entries to fresh unpinned CPU tensors every cycle. The storage path here covers every
layout, both engines, and runs (and is tested) on CPU too, where the "device" is the CPU itself.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from megatron_dapo.errors import EngineOffloadedError

PARTS = ("params", "grads", "optimizer")
DROPPED = frozenset({"grads"})  # freed, not copied: reloaded as zeros


def parts_of(what: Iterable[str] | str | None) -> tuple[str, ...]:
    """The parts named by `what` (None: all three), in PARTS order; an unknown name is refused."""
    if what is None:
        return PARTS
    names = {what} if isinstance(what, str) else set(what)
    unknown = sorted(names - set(PARTS))
    if unknown:
        raise ValueError(f"offload / reload: unknown part(s) {unknown}; the parts are {list(PARTS)}")
    return tuple(p for p in PARTS if p in names)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a torch optimizer holds (its parameters and state), and those of its sub-optimizers
    (megatron-core's HybridDeviceOptimizer keeps its GPU part's fp32 copies in one)."""
    out = []
    for group in optimizer.param_groups:
        out += [p for p in group["params"] if isinstance(p, torch.Tensor)]
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for sub in getattr(optimizer, "sub_optimizers", None) or []:
        out += optimizer_tensors(sub)
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _byte_view(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceOffload:
    """The offload state of one engine. `collectors[part]()` lists the part's tensors (called at each
    offload: optimizer state appears at the first step); a storage shared by two parts belongs to the
    first in PARTS order (an fp32 model's master weights are its parameters)."""

    def __init__(self, device: torch.device, collectors: dict[str, Callable[[], list[torch.Tensor]]]):
        self.device = device
        self.collectors = collectors
        self.pin = device.type == "cuda"
        self.offloaded: set[str] = set()
        self._moved: dict[str, list] = {}  # part -> [(storage, nbytes)]
        self._host: dict[str, list[torch.Tensor]] = {}  # part -> host copies, reused every cycle

    def storages(self) -> dict[str, list]:
        """Each part's distinct device storages, a storage in two parts given to the first."""
        claimed, out = set(), {}
        for part in PARTS:
            out[part] = []
            for t in self.collectors[part]():
                if t is None:
                    continue
                s = local_tensor(t).untyped_storage()
                if s.device.type != self.device.type or s._cdata in claimed:
                    continue
                claimed.add(s._cdata)
                out[part].append(s)
        return out

    def offload(self, what=None) -> dict[str, int]:
        """Free the device storage of the parts in `what` (None: all); returns the device bytes freed per part
        (a part already offloaded: 0)."""
        parts = [p for p in parts_of(what) if p not in self.offloaded]
        storages = self.storages() if parts else {}
        moved = {part: [(s, s.nbytes()) for s in storages[part] if s.nbytes() > 0] for part in parts}
        _synchronize(self.device)  # the last step's kernels may still write these storages
        for part in parts:
            if part in DROPPED:
                continue
            host = self._host.get(part, [])
            if [h.numel() for h in host] != [n for _, n in moved[part]]:
                host = [torch.empty(n, dtype=torch.uint8, pin_memory=self.pin) for _, n in moved[part]]
                self._host[part] = host
            for (s, _), h in zip(moved[part], host):
                h.copy_(_byte_view(s), non_blocking=True)
        _synchronize(self.device)  # the copies must land before their sources are freed
        freed = {}
        for part in parts:
            for s, _ in moved[part]:
                s.resize_(0)
            self._moved[part] = moved[part]
            self.offloaded.add(part)
            freed[part] = sum(n for _, n in moved[part])
        if parts and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver: the servers need them
        return freed

    def reload(self, what=None) -> dict[str, int]:
        """Reallocate the device storage of the parts in `what` (None: all) and copy their bytes back
        (gradients: zeros); returns the device bytes reallocated per part."""
        back = {}
        for part in parts_of(what):
            if part not in self.offloaded:
                continue
            moved = self._moved.pop(part)
            for i, (s, n) in enumerate(moved):
                s.resize_(n)
                view = _byte_view(s)
                if part in DROPPED:
                    view.zero_()
                else:
                    view.copy_(self._host[part][i], non_blocking=True)
            self.offloaded.discard(part)
            back[part] = sum(n for _, n in moved)
        _synchronize(self.device)
        return back

    def require(self, call: str, parts: Iterable[str]) -> None:
        """Refuse `call` while a part it needs is offloaded."""
        missing = [p for p in PARTS if p in set(parts) & self.offloaded]
        if missing:
            raise EngineOffloadedError(
                f"{call} needs the engine's {', '.join(missing)} on the device, but they are offloaded: "
                f"call reload({missing!r}) first"
            )
