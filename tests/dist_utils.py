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


def kill_tree(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL a torchrun launcher and everything below it, at once (no rank gets to clean up).

    torchrun starts each rank in a session of its own, so killing the launcher's process group would
    leave the ranks running: the descendants are collected first, then every process group among
    them (a rank's own helpers, e.g. checkpoint writers) and every descendant is killed."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except ProcessLookupError:
            pass
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    if alive:
        raise AssertionError(f"processes still alive after SIGKILL: {[p.pid for p in alive]}")


def start_torchrun(
    script: str | Path, nproc: int, *args: str, env: dict | None = None, stdout=subprocess.PIPE
) -> subprocess.Popen:
    """Start `script` on `nproc` ranks, the launcher in a new session; returns at once (stop it with
    `kill_tree`)."""
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--master-addr={LOOPBACK}",
        f"--master-port={free_port()}",
        str(script),
        *map(str, args),
    ]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.Popen(
        cmd, stdout=stdout, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> str:
    """Launch `script` (a path, or a file name in tests/workers/) on `nproc` ranks; return its output."""
    name = Path(script).name
    proc = start_torchrun(script, nproc, *args, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # the ranks too: each is in a session of its own
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun {name} timed out after {timeout}s\n{out[-8000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {name} (nproc={nproc}) failed rc={proc.returncode}\n{out[-8000:]}")
    return out
