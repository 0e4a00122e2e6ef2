"""Run a test script under torchrun on loopback, with a free port and a timeout.

Worker scripts live in tests/workers/. They assert their own numbers and exit non-zero
on failure; this helper surfaces their output in the pytest failure message.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_dapo.runtime.net import LOOPBACK, free_port

WORKERS = Path(__file__).parent / "workers"


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> str:
    """Launch `script` (a path, or a file name in tests/workers/) on `nproc` ranks; return its output."""
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--master-addr={LOOPBACK}",
        f"--master-port={free_port()}",
        str(script), *map(str, args),
    ]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's ranks share its new session: kill the whole group, not just the launcher.
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun {script.name} timed out after {timeout}s\n{out[-8000:]}")
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} (nproc={nproc}) failed rc={proc.returncode}\n{out[-8000:]}")
    return out
