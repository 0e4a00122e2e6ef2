"""What the peer judges (tests/sglang_peer.py, tests/verl_peer.py) share: a peer's released packages
pip-installed without dependencies into a cache directory, and stub modules standing in for the GPU-only or
heavy packages on their import paths that this environment lacks (never on the paths the tests call)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path


def ensure_installed(cache: Path, packages: tuple[str, ...], needed_by: str) -> Path:
    """`cache` with `packages` installed (pip --no-deps), installed now if it is not complete yet; raises
    (never skips) naming `needed_by` when PyPI cannot provide them. Concurrent installs: the first wins."""
    if (cache / ".complete").exists():
        return cache
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp), *packages]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not install {' '.join(packages)} into {tmp} (pip install --no-deps from PyPI failed); "
            f"{needed_by} need it: {proc.stderr.strip()[-2000:]}"
        )
    (tmp / ".complete").write_text(" ".join(packages) + "\n")
    if cache.exists():  # a concurrent install won; use it
        return cache
    tmp.rename(cache)
    return cache


class Stub(type):
    """Any attribute of a stub class is another stub class (constructible with any arguments)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = Stub(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(cls, name, value)
        return value


class StubModule(types.ModuleType):
    """A stub package: any attribute is a stub class, any submodule another stub module."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = Stub(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the top-level packages `stubbed(name)` says yes to become StubModules."""

    def __init__(self, stubbed: Callable[[str], bool]):
        self.stubbed = stubbed

    def find_spec(self, name, path, target=None):
        if self.stubbed(name.split(".")[0]):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        pass
