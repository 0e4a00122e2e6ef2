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
