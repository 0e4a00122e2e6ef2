"""The shared backend suites (tests/algo/test_backends.py, tests/algo/test_policy_variants.py,
tests/kernels/test_fused_linear.py) against the Triton kernels on CPU (the policy variants' suite: dapo
on the kernel, gspo / cispo through the dispatcher's torch path).

Triton decides between compiling and interpreting when a kernel is decorated (at import), from
TRITON_INTERPRET; this pytest process may already have imported triton without it, so each suite
runs in a fresh subprocess with TRITON_INTERPRET=1 and only the "triton-interpret" backend
(tests/backends.py). Every test of the suite must run and pass: none skipped or deselected, at least
`min_passed` (the suite's count of tests at the time of writing) passed. kernels/test_fused_linear.py
includes its TP=2 gloo torchrun run (sequence parallel, padded vocabulary, temperature).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "suite,min_passed",
    [("algo/test_backends.py", 20), ("algo/test_policy_variants.py", 45), ("kernels/test_fused_linear.py", 21)],
)
def test_triton_kernels_interpreted_match_references(suite, min_passed):
    env = dict(os.environ, TRITON_INTERPRET="1", MEGATRON_DAPO_TEST_BACKENDS="triton-interpret", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / suite)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed, summary
    assert "skipped" not in summary and "deselected" not in summary, f"every test must run: {summary}"
