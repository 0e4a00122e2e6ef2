"""Trainer rank 0's coordinator client outlives the coordinator (coordinator/restart.py): over the real
process transport, a SIGKILLed coordinator is started again and given what rank 0 kept (the snapshot
after the last step, the registry's versions and out-of-service marks, the version), the call that met
the death answers from the new one, every thread that met it shares one restart, and past the budget
the run stops with a CoordinatorLost naming the dead process and where to resume from. (The whole loop
with a killed coordinator: tests/trainer/test_loop.py, run C.)"""

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from megatron_dapo.coordinator.process import start_process_coordinator
from megatron_dapo.coordinator.restart import RestartingCoordinator
from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.errors import CoordinatorGone, CoordinatorLost

pytestmark = pytest.mark.slow

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


class Recorder:
    """A coordinator's calls, each appended to `log` (one JSON line per call, from every coordinator the
    test starts): take_step answers its step, snapshot a state naming the steps taken."""

    def __init__(self, log: str):
        self.log, self.taken = Path(log), []

    def _record(self, *call):
        with open(self.log, "a") as f:
            f.write(json.dumps([os.getpid(), *call]) + "\n")

    def setup(self):
        self._record("setup")
        return {"train": 1}

    def restore(self, found, state, next_step):
        self._record("restore", state, next_step)
        self.taken = list(state["taken"])

    def start(self):
        self._record("start")

    def stop(self):
        pass

    def take_step(self, step, dp_size):
        self.taken.append(step)
        return step

    def snapshot(self, next_step):
        return {"taken": list(self.taken)}

    def set_version(self, version):
        self._record("set_version", version)


def recorder_objects(log, server_urls):
    return {"coordinator": Recorder(log), "registry": ServerRegistry(server_urls, version=-1)}


def _calls(log: Path) -> list[list]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _pid(coord) -> int:
    return int(coord.where.split()[-1])


@pytest.fixture
def restarting(tmp_path):
    log, aborts = tmp_path / "calls.jsonl", []
    coords = []

    def build(max_restarts=3):
        coord = RestartingCoordinator(
            lambda: start_process_coordinator(str(log), URLS, objects=recorder_objects),
            max_restarts,
            abort_servers=lambda: aborts.append(True),
            resume_hint=lambda: "checkpoints/step_000001",
        )
        coords.append(coord)
        return coord

    yield build, log, aborts
    for c in coords:
        c.close()


def test_a_dead_process_coordinator_is_gone_not_a_call_error(tmp_path):
    coord = start_process_coordinator(str(tmp_path / "calls.jsonl"), URLS, objects=recorder_objects)
    try:
        assert coord.take_step(0, 1) == 0
        os.kill(_pid(coord), signal.SIGKILL)
        with pytest.raises(CoordinatorGone, match=rf"the rollout coordinator \(process {_pid(coord)}\) is gone"):
            coord.take_step(1, 1)
    finally:
        coord.close()


def test_a_killed_coordinator_is_restarted_with_what_rank_0_kept(restarting):
    build, log, aborts = restarting
    coord = build()
    coord.setup()
    coord.start()
    assert [coord.take_step(s, 2) for s in (0, 1)] == [0, 1]
    coord.registry.end_sync(URLS[0], 2)
    coord.registry.mark_down(URLS[1], "lost in the sync of version 2")
    coord.set_version(2)
    first = _pid(coord)
    os.kill(first, signal.SIGKILL)

    assert coord.take_step(2, 2) == 2  # answered by the new coordinator
    second = _pid(coord)
    assert second != first and coord.restarts == 1 and aborts == [True]
    new = [c[1:] for c in _calls(log) if c[0] == second]
    # set up, given the snapshot taken after step 1 (steps 0 and 1 left: never handed out again), the
    # version, and started, in that order
    assert new == [["setup"], ["restore", {"taken": [0, 1]}, 2], ["set_version", 2], ["start"]]
    # the registry as it was: versions and the out-of-service mark
    assert coord.registry.state() == {
        URLS[0]: {"version": 2, "down": None},
        URLS[1]: {"version": -1, "down": "lost in the sync of version 2"},
    }
    assert [s.url for s in coord.registry.statuses()] == [URLS[0]]


def test_threads_that_meet_one_death_share_one_restart(restarting):
    build, _, aborts = restarting
    coord = build()
    coord.setup()
    coord.take_step(0, 1)
    os.kill(_pid(coord), signal.SIGKILL)
    barrier, errors = threading.Barrier(4), []

    def call():
        try:
            barrier.wait(30)
            coord.registry.metrics()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and coord.restarts == 1 and aborts == [True]


def test_past_the_budget_the_run_stops_naming_what_died_and_where_to_resume(restarting):
    build, _, _ = restarting
    coord = build(max_restarts=1)
    coord.setup()
    os.kill(_pid(coord), signal.SIGKILL)
    coord.take_step(0, 1)  # the one restart
    dead = _pid(coord)
    os.kill(dead, signal.SIGKILL)
    with pytest.raises(CoordinatorLost) as e:
        coord.take_step(1, 1)
    message = str(e.value)
    assert f"the rollout coordinator (process {dead}) died" in message
    assert "trainer.max_coordinator_restarts=1" in message and "resume from checkpoints/step_000001" in message
    assert isinstance(e.value.__cause__, CoordinatorGone)
