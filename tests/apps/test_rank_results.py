"""How the Ray driver reports a failed trainer rank (apps/launch.py `_rank_results`), with real Ray actors: a rank
whose peer was killed often raises first (its collective's connection is reset) while Ray is still noticing the
death; the lost rank is what gets reported (seen in a Slurm lost-node run at load ~100: the reset came first)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from megatron_dapo.apps.launch import TrainerRankLost, _rank_results
from tests.local_ray import init_local_ray

pytestmark = pytest.mark.slow
LAYOUT = SimpleNamespace(where=lambda rank: f"test node {rank}")


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")
    init_local_ray(ray, num_cpus=3)
    yield ray
    ray.shutdown()


def _rank(ray):
    @ray.remote(num_cpus=1, max_restarts=0)
    class Rank:
        def run(self, what: str, after_s: float):
            time.sleep(after_s)
            if what == "raise":
                raise RuntimeError("Read error: Connection reset by peer")  # what gloo says when a peer vanishes
            if what == "die":
                os._exit(1)
            return what

    return Rank


def test_a_rank_that_raises_because_its_peer_died_reports_the_lost_peer(ray):
    ranks = [_rank(ray).remote() for _ in range(2)]
    futures = [ranks[0].run.remote("raise", 0.2), ranks[1].run.remote("die", 2.0)]
    with pytest.raises(TrainerRankLost) as e:
        _rank_results(futures, LAYOUT, grace_s=60)
    msg = str(e.value)
    assert msg.startswith("trainer rank 1 lost (test node 1): Actor") and "rank 0 failed first" in msg, msg
    assert "Connection reset by peer" in msg, msg


def test_a_rank_that_raises_with_every_peer_alive_is_reported_as_itself_after_the_grace(ray):
    ranks = [_rank(ray).remote() for _ in range(2)]
    futures = [ranks[0].run.remote("raise", 0.2), ranks[1].run.remote("hang", 60.0)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection reset by peer") as e:
        _rank_results(futures, LAYOUT, grace_s=1.0)
    assert not isinstance(e.value, TrainerRankLost) and time.monotonic() - t0 < 50
    for r in ranks:
        ray.kill(r)


def test_a_rank_that_dies_is_reported_at_once(ray):
    ranks = [_rank(ray).remote() for _ in range(2)]
    futures = [ranks[0].run.remote("hang", 60.0), ranks[1].run.remote("die", 0.2)]
    with pytest.raises(TrainerRankLost, match=r"^trainer rank 1 lost \(test node 1\): Actor"):
        _rank_results(futures, LAYOUT, grace_s=60)
    ray.kill(ranks[0])
