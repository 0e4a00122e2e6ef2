"""The coordinator as a subprocess of trainer rank 0: its registry is reached from several threads
of rank 0 at once, and it never outlives rank 0 (a SIGKILLed trainer leaves no coordinator behind)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_registry_calls_from_many_threads_reach_the_coordinator_process():
    from megatron_dapo.config.schema import DapoConfig
    from megatron_dapo.coordinator.process import start_process_coordinator

    coord = start_process_coordinator(DapoConfig(), URLS)
    try:
        errors = []

        def sync_server(url, versions):
            try:
                for v in versions:  # the per-server syncer's calls, one thread per server
                    coord.registry.begin_sync(url)
                    coord.registry.end_sync(url, v)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=sync_server, args=(u, range(1, 6))) for u in URLS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        m = coord.registry.metrics()
        assert [m[f"server/{i}/version"] for i in range(2)] == [5.0, 5.0]
        assert [m[f"server/{i}/syncs"] for i in range(2)] == [5.0, 5.0]
        assert len(coord.registry.take_events()) == 10 and coord.registry.take_events() == []
        with pytest.raises(RuntimeError, match="already syncing"):  # the registry's own error, across processes
            coord.registry.begin_sync(URLS[0])
            coord.registry.begin_sync(URLS[0])
    finally:
        coord.close()


def test_coordinator_exits_when_its_trainer_is_killed():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "workers" / "coordinator_parent.py"), *URLS],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    child = None
    try:
        line = parent.stdout.readline()
        assert line.startswith("COORDINATOR"), line
        child = int(line.split()[1])
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)  # no cleanup runs in the trainer
        parent.wait(30)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "the coordinator outlived its trainer"
    finally:
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
