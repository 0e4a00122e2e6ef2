"""The shared backend suite (tests/test_algo.py) against the Triton kernels on CPU.

Triton decides between compiling and interpreting when a kernel is decorated (at import), from
TRITON_INTERPRET; this pytest process may already have imported triton without it, so the suite
runs in a fresh subprocess with TRITON_INTERPRET=1 and only the "triton-interpret" backend.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_triton_kernels_interpreted_match_references():
    env = dict(os.environ, TRITON_INTERPRET="1", MEGATRON_DAPO_TEST_BACKENDS="triton-interpret", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_algo.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20, summary
    assert "skipped" not in summary and "deselected" not in summary, f"every test must run: {summary}"
