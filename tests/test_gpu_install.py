"""constraints/gpu.txt and the `gpu` extra agree with SGLang 0.5.23's own requirements (tools/check_gpu_install.py;
`make check-gpu-install` also resolves the whole GPU install in CI). SGLang's METADATA comes from the wheel the
SGLang peer tests install (PyPI needed, as for those)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_gpu_install", ROOT / "tools" / "check_gpu_install.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def _sglang_metadata() -> str:
    from tests import sglang_peer

    cache = sglang_peer.ensure_installed()
    return (cache / f"sglang-{check.SGLANG}.dist-info" / "METADATA").read_text()


def test_the_gpu_pins_agree_with_sglangs_requirements():
    text = _sglang_metadata()
    for python in check.PYTHONS:
        theirs = check.metadata_requirements(text, python)
        pins = check.constraint_pins(check.CONSTRAINTS, python)
        assert check.pin_conflicts(theirs, pins, check.project_requirements(python)) == [], python
        exact = {r.name: str(r.specifier) for r in theirs if r.name in ("torch", "transformers", "tokenizers")}
        assert exact == {"torch": "==2.14.1", "transformers": "==5.19.0", "tokenizers": "==0.23.2"}
    assert check.constraint_pins(check.CONSTRAINTS, "3.11")["megatron-core"] == Version("0.16.1")
    assert check.constraint_pins(check.CONSTRAINTS, "3.12")["megatron-core"] == Version("0.19.2")


def test_a_disagreement_is_named():
    text = _sglang_metadata()
    theirs = check.metadata_requirements(text, "3.12")
    pins = check.constraint_pins(check.CONSTRAINTS, "3.12")
    ours = check.project_requirements("3.12")
    problems = check.pin_conflicts(theirs, {**pins, "transformers": Version("5.25.0")}, ours)
    assert "constraints/gpu.txt pins transformers==5.25.0; SGLang 0.5.23 requires transformers==5.19.0" in problems
    assert "constraints/gpu.txt must pin transformers==5.19.0 (SGLang 0.5.23's); it pins 5.25.0" in problems
    problems = check.pin_conflicts(theirs, pins, [*ours, Requirement("torch>=2.15")])
    assert problems == ["pyproject.toml requires torch>=2.15; SGLang 0.5.23 pins torch==2.14.1",
                        "pyproject.toml requires torch>=2.15; constraints/gpu.txt pins torch==2.14.1"]  # fmt: skip
