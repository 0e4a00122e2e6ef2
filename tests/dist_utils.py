"""Run a test script under torchrun on loopback, with a free port and a timeout.

Worker scripts live in tests/workers/. They assert their own numbers and exit non-zero
on failure; this helper surfaces their output in the pytest failure message.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
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
    script: str | Path,
    nproc: int,
    *args: str,
    env: dict | None = None,
    stdout=subprocess.PIPE,
    torchrun_args: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start `script` on `nproc` ranks, the launcher in a new session; returns at once (stop it with
    `kill_tree`). `torchrun_args`: more of torchrun's own options (e.g. --max-restarts=1)."""
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
        *torchrun_args,
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


def _finish(proc: subprocess.Popen, name: str, nproc: int, timeout: float) -> tuple[str, str | None]:
    """Wait for a launch; return (its output, why it failed or None)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # the ranks too: each is in a session of its own
        out, _ = proc.communicate()
        return out, f"torchrun {name} timed out after {timeout}s"
    if proc.returncode != 0:
        return out, f"torchrun {name} (nproc={nproc}) failed rc={proc.returncode}"
    return out, None


def failure_report(error: str, out: str, tail: int = 8000) -> str:
    """`error`, each rank's exception lines (a long traceback pushes the first failure out of the tail), then
    the output's tail."""
    raised = [line for line in out.splitlines() if re.match(r"(\[rank\d+\]: )?[\w.]*(Error|Exception)\b.*: ", line)]
    return "\n".join([error, "exceptions raised:", *dict.fromkeys(raised), "output tail:", out[-tail:]])


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> str:
    """Launch `script` (a path, or a file name in tests/workers/) on `nproc` ranks; return its output."""
    out, error = _finish(start_torchrun(script, nproc, *args, env=env), Path(script).name, nproc, timeout)
    if error:
        raise AssertionError(failure_report(error, out))
    return out


@dataclass
class CheckResults:
    """What became of each check given to `run_check_launches`: passed, or failed with its launch's output."""

    passed: set[str] = field(default_factory=set)
    output: str = field(default="", repr=False)  # of every launch, in turn
    failures: dict[str, str] = field(default_factory=dict, repr=False)  # check -> message and output

    def assert_passed(self, checks: list[str]) -> str:
        """Raise for the first of `checks` that did not pass; else return the launches' output."""
        for check in checks:
            if check in self.failures:
                raise AssertionError(self.failures[check])
            assert check in self.passed, f"check {check} did not run: {self.failures.get('', '')}"
        return self.output


def run_check_launches(script: str, nproc: int, checks: list[str], tmpdir: Path, timeout: float) -> CheckResults:
    """Run `checks` in turn in one launch of `script` (a worker taking CHECK[,CHECK...] TMPDIR and logging
    `CHECK PASSED <name>` after each). A failing check ends its launch: the checks after it run in a new
    one, so that each check gets its own verdict; all launches share `timeout`."""
    deadline, results, name = time.monotonic() + timeout, CheckResults(), Path(script).name
    remaining = list(checks)
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            results.failures[""] = f"the {timeout}s of the launches of {name} were spent before it"
            break
        out, error = _finish(start_torchrun(script, nproc, ",".join(remaining), str(tmpdir)), name, nproc, left)
        done = set(re.findall(r"CHECK PASSED (\S+)", out))
        results.passed |= done
        results.output += out
        rest = [c for c in remaining if c not in done]  # the checks run in order: rest[0] failed
        failed = rest[0] if rest else remaining[-1] if error else None
        if failed is not None:
            why = error or "exited without its CHECK PASSED line"
            results.failures[failed] = failure_report(f"{name}: check {failed} failed ({why})", out)
        remaining = rest[1:]
    return results
