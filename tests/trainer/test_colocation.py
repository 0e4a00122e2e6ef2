"""The colocated step cycle's transitions (trainer/colocation.py): their order against a recording engine and
servers, each side waiting at a barrier for the other, their times and bytes as step metrics, and a
server that does not answer counted, not raised (the end-to-end runs are in test_loop_colocated.py)."""

from __future__ import annotations

from megatron_dapo.runtime.net import LOOPBACK, free_port
from megatron_dapo.trainer.colocation import ColocationCycle, ServerMemory


class Recorder:
    """An engine and rank 0's servers writing one shared log; offload / reload return bytes per part."""

    def __init__(self, log: list):
        self.log = log

    def offload(self, what=None):
        self.log.append(("offload", tuple(what)))
        return {p: 100 for p in what}

    def reload(self, what=None):
        self.log.append(("reload", what))
        return {"params": 100, "grads": 100, "optimizer": 100}


class RecordingServers(ServerMemory):
    def __init__(self, log: list):
        super().__init__([], None, 1.0)
        self.log = log

    def release(self, tags):
        self.log.append(("servers release", tuple(tags)))

    def resume(self, tags, then_continue=False):
        self.log.append(("servers resume", tuple(tags), then_continue))


def _cycle(rank0: bool):
    log, ticks = [], iter(range(1000))
    cycle = ColocationCycle(
        RecordingServers(log) if rank0 else None, lambda: log.append(("barrier",)), clock=lambda: float(next(ticks))
    )
    cycle.engine = Recorder(log)
    return cycle, log


def _one_step(cycle):
    cycle.release_servers()
    cycle.reload_trainer()
    cycle.offload_train_state()
    cycle.offload_params()


def test_the_cycle_moves_in_order_with_a_barrier_between_the_two_sides():
    cycle, log = _cycle(rank0=True)
    _one_step(cycle)
    assert log == [
        ("servers release", ("weights", "kv_cache")),
        ("barrier",),  # no rank reloads before every server released
        ("reload", None),
        ("offload", ("grads", "optimizer")),
        ("barrier",),  # no server resumes before every rank offloaded
        ("servers resume", ("weights",), False),
        ("barrier",),
        ("offload", ("params",)),
        ("barrier",),
        ("servers resume", ("kv_cache",), True),  # then generation continues
        ("barrier",),
    ]


def test_other_ranks_meet_the_same_barriers_without_calling_servers():
    cycle, log = _cycle(rank0=False)
    _one_step(cycle)
    moves = ["barrier", "reload", "offload", "barrier", "barrier", "offload", "barrier", "barrier"]
    assert [e[0] for e in log] == moves
    assert "colocate/server_call_failures" not in cycle.metrics()


def test_each_transition_is_a_step_metric_with_its_time_and_bytes():
    cycle, _ = _cycle(rank0=True)
    _one_step(cycle)
    m = cycle.metrics()
    # the fake clock ticks once per reading: every transition takes 1 s
    assert m["time/colocate_release_s"] == 1.0 and m["time/reload_s"] == 1.0
    assert m["time/offload_s"] == 2.0 and m["time/colocate_resume_s"] == 2.0
    assert m["colocate/offloaded_bytes"] == 300.0 and m["colocate/reloaded_bytes"] == 300.0
    assert m["colocate/server_call_failures"] == 0.0
    assert cycle.metrics()["time/offload_s"] == 0.0  # taken: the next step starts from nothing


def test_a_server_that_does_not_answer_is_counted_and_skipped():
    dead = f"http://{LOOPBACK}:{free_port()}"
    servers = ServerMemory([dead], None, timeout_s=5.0)
    servers.release(["weights", "kv_cache"])
    servers.resume(["kv_cache"], then_continue=True)
    assert servers.failures == 2
