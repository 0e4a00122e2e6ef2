"""Helper processes that must not outlive the process that started them."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """A daemon thread that ends this process once `parent_pid` is no longer its parent (it was
    killed, even by SIGKILL, which runs no cleanup of its own)."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# Set by a process that starts a rollout server (megatron_dapo.rollout.launcher.ServerProcess) to its own pid: the
# embedded server then exits with it. Such a server runs in a session of its own (so that it is stopped as a
# group), which Slurm's process-group tracking (and a Ray worker's kill) does not reach: without this, a run
# cancelled or killed would leave it running.
EXIT_WITH_PARENT_ENV = "MEGATRON_DAPO_EXIT_WITH_PARENT"


def exit_with_parent_from_env() -> None:
    """`exit_with_parent` of the pid in EXIT_WITH_PARENT_ENV, when the process that started this one set it
    (a server started by hand, `megatron-dapo serve`, has no such parent and keeps running)."""
    pid = os.environ.pop(EXIT_WITH_PARENT_ENV, "")
    if pid:
        exit_with_parent(int(pid))
