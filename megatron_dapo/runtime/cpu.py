"""CPU mode: run unmodified megatron-core (0.16.1 to 0.19, runtime/megatron_compat.py) on a machine without CUDA.

megatron-core assumes CUDA throughout: it allocates with ``device=torch.cuda.current_device()``,
calls ``Tensor.cuda()``, asks ``param.type()`` for ``torch.cuda.FloatTensor``, creates streams and
events, and swaps the CUDA RNG state for tensor-parallel regions. Rather than forking it, CPU mode
makes those calls mean "the CPU":

* a ``TorchFunctionMode`` maps CUDA device arguments (``"cuda"``, ``torch.device("cuda", i)``, ints)
  to the CPU, turns ``Tensor.cuda()`` and ``Tensor.pin_memory()`` into no-ops, and reports
  ``Tensor.type()`` with the ``torch.cuda.`` prefix the optimizer and grad clipping check for;
* stand-ins for ``torch.cuda.current_device``, ``Stream``, ``Event``, ``current_stream``, ``stream``,
  ``synchronize`` and the RNG state functions, whose "CUDA generator" is the CPU default generator
  (so megatron's RNG tracker forks the generator that CPU kernels actually draw from);
* the mode is re-entered around the autograd engine: a mode is off while its own handler runs,
  and ``Tensor.backward`` goes through the handler, so backward (megatron's MoE all-to-all
  allocates on "cuda" there) would otherwise run without it;
* two gaps of megatron-core without Transformer Engine: ``moe_utils.te_general_gemm`` is never
  defined (0.16.1; 0.19 sets it to None), and ``maybe_move_tensor_to_cpu`` leaves CPU tensors as
  tensors where the alltoall dispatcher needs numpy split sizes.

The megatron-core functions replaced here are listed in ``megatron_compat.CPU_MODE_REPLACES``: a
release without one of them is refused by name rather than left silently unpatched.

Entry points call :func:`enable_cpu_mode` explicitly. It does nothing when CUDA is available: on GPUs
megatron-core runs untouched.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(d) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # a bare int device index means a CUDA ordinal
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


def _map_device(d):
    return _CPU if _is_cuda_device(d) else d


def _cuda_type_name(t: torch.Tensor) -> str:
    name = torch.Tensor.type(t)  # e.g. "torch.FloatTensor"
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placement requests to the CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if func is torch.Tensor.type:
            target = args[1] if len(args) > 1 else kwargs.pop("dtype")
            if isinstance(target, str):
                target = target.replace("torch.cuda.", "torch.")
            return func(args[0], target, *args[2:], **kwargs)
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if kwargs.pop("pin_memory", False):
            pass  # pinned host memory needs CUDA; plain CPU memory is equivalent here
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / ExternalStream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    """Stands in for torch.cuda.Event; elapsed_time is wall-clock based."""

    def __init__(self, *args, enable_timing: bool = False, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "_NullEvent") -> float:
        return (end._t - self._t) * 1000.0


@contextlib.contextmanager
def _null_stream_ctx(stream=None):
    yield stream


def _install_cuda_standins() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NullStream
    cuda.ExternalStream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.set_stream = lambda stream: None
    cuda.stream = _null_stream_ctx
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    # The "CUDA generator" is the CPU default generator: that is the one CPU kernels draw from.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.random.manual_seed = cuda.manual_seed


def _patch_megatron_core() -> None:
    try:
        from megatron.core.tensor_parallel import random as mp_random
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return  # megatron-core not installed: nothing to patch
    from megatron_dapo.runtime.megatron_compat import CPU_MODE_REPLACES, megatron_core_version, missing_names

    missing = missing_names(CPU_MODE_REPLACES)
    if missing:
        raise RuntimeError(
            f"CPU mode replaces {', '.join(missing)}, which megatron-core {megatron_core_version()} does not "
            "have: this release is outside the tested range (runtime/megatron_compat.py)"
        )

    def _get_rng_state(device=-1, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = _get_rng_state
    mp_random._set_cuda_rng_state = _set_rng_state

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    # token_dispatcher imported the original by name.
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _patch_sequence_parallel_collectives()


def _patch_autograd_engine() -> None:
    """Keep the device mode on while the autograd engine runs backward.

    ``Tensor.backward`` reaches the mode's handler, and a mode is switched off while its own
    handler runs, so the whole backward pass would run without it; megatron's custom autograd
    functions (the MoE all-to-all) allocate with ``device=torch.cuda.current_device()`` in backward.
    The engine entry below dispatches nothing itself, so re-entering the mode around it is safe.
    """
    import torch.autograd as autograd

    engine_run = autograd._engine_run_backward
    if getattr(engine_run, "_cpu_mode", False):
        return

    def _engine_run_backward(*args, **kwargs):
        with _CudaToCpuMode():
            return engine_run(*args, **kwargs)

    _engine_run_backward._cpu_mode = True
    autograd._engine_run_backward = _engine_run_backward


def _patch_sequence_parallel_collectives() -> None:
    """Gloo has no uneven all_gather / reduce_scatter; the MoE alltoall dispatcher with TP > 1 needs them.

    megatron-core's first-dim gather / reduce-scatter (sequence parallel, token dispatch) are replaced
    by equivalents gloo can run: an all_gather of tensors padded to the largest split, and an
    all_reduce of the whole tensor followed by taking this rank's split.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        world = group.size()
        if world == 1:
            return input_
        sizes = output_split_sizes or [input_.shape[0]] * world
        padded = torch.zeros((max(sizes), *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        world = group.size()
        if world == 1:
            return input_
        if input_split_sizes is None:
            assert input_.shape[0] % world == 0, (
                "First dimension of the tensor should be divisible by tensor parallel size"
            )
            input_split_sizes = [input_.shape[0] // world] * world
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.split(list(input_split_sizes), dim=0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def cpu_mode_active() -> bool:
    return _mode is not None


def enable_cpu_mode() -> bool:
    """Make megatron-core run on the CPU; a no-op (returns False) when CUDA is available.

    Idempotent. The device mode is pushed onto the calling thread's torch-function stack and stays
    for the life of the process: call it from the main thread of an entry point, before building
    models.
    """
    global _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _mode is None:
            _install_cuda_standins()
            _patch_megatron_core()
            _patch_autograd_engine()
            _mode = _CudaToCpuMode()
            _mode.__enter__()
    return True
