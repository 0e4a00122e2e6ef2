"""The embedded server against hostile and broken input (issue 13, server side).

Fast tests check the unpickler's allow-list in this process; slow ones drive a real `megatron-dapo serve`
subprocess on 127.0.0.1 through the whole hostile set and end by checking its greedy output is unchanged.
"""

from __future__ import annotations

import importlib
import itertools
import os

import psutil
import pytest
import torch

from megatron_dapo.rollout.embedded.tensor_payload import ALLOWED_GLOBALS

DATA_MODULES = {"builtins", "collections", "copyreg", "torch", "torch._utils", "torch._tensor", "torch.storage",
                "torch.serialization", "torch.nn.parameter", "torch.multiprocessing.reductions"}


def _resources() -> dict:
    me = psutil.Process()
    return {"fds": me.num_fds(), "threads": me.num_threads(), "children": len(me.children(recursive=True)),
            "shm": len(os.listdir("/dev/shm"))}


def _call_with_hostile_args(obj) -> None:
    """Call `obj` as a pickle's REDUCE could: every 0-3 argument combination of descriptor numbers, names,
    None, a dtype, a storage class and a storage."""
    values = [0, 3, "x", None, torch.float32, torch.UntypedStorage, (), torch.UntypedStorage(4)]
    for k in range(4):
        for args in itertools.product(values, repeat=k):
            try:
                obj(*args)
            except Exception:
                pass


def _leaks(module: str, name: str) -> dict:
    """What calling this global with hostile arguments leaves behind in this process: {resource: (before, after)}."""
    obj = getattr(importlib.import_module(module), name)
    before = _resources()
    _call_with_hostile_args(obj)
    after = _resources()
    return {k: (before[k], after[k]) for k in before if after[k] != before[k]}


def test_every_allowed_global_only_builds_data():
    """Every class or function the unpickler would resolve exists, comes from a data / torch rebuild module,
    and, called with any hostile arguments, leaves no descriptor, thread, process or shared-memory file."""
    import warnings

    assert ALLOWED_GLOBALS, "the allow-list is empty"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation warning
        for module, name in sorted(ALLOWED_GLOBALS):
            assert module in DATA_MODULES, f"{module}.{name}: not a data or tensor-rebuild module"
            assert hasattr(importlib.import_module(module), name), f"{module}.{name} does not exist"
            assert not _leaks(module, name), f"{module}.{name} leaves {_leaks(module, name)}"
        # the check sees the class that leaked descriptors from the old allow-list
        assert "fds" in _leaks("multiprocessing.resource_sharer", "DupFd")


def test_unpickler_refuses_descriptor_classes_before_building_any():
    import io
    import pickle

    from megatron_dapo.rollout.embedded.tensor_payload import SafeUnpickler

    before = _resources()["fds"]
    raw = b"(" + b"cmultiprocessing.resource_sharer\nDupFd\n(I0\ntR" * 100 + b"l."
    with pytest.raises(pickle.UnpicklingError, match="multiprocessing.resource_sharer.DupFd is not allowed"):
        SafeUnpickler(io.BytesIO(raw)).load()
    assert _resources()["fds"] == before
