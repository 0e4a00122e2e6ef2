"""The weight transports' parts on their own: membership transitions, the session's flush rule, the
topologies (turn order and the agreed outcome over real gloo ranks), the per-server store as a transport.
The transports against real servers: test_sync_degrade, test_relaunch, test_sglang_peer, test_sync_sources."""

import json

import pytest
import torch

from megatron_dapo.rollout.client import SGLangConnectionError
from megatron_dapo.sync.errors import ServersLost, WeightSyncError, raise_failed_answers
from megatron_dapo.sync.membership import Membership
from megatron_dapo.sync.per_server import PerServerStoreTransport, WeightStore
from megatron_dapo.sync.session import flushes_cache
from megatron_dapo.sync.topology import SingleSource, TurnTaking
from megatron_dapo.sync.update_group import StreamCounts

URLS = ["http://a", "http://b", "http://c"]


def test_a_lost_server_leaves_the_group_shape_and_comes_back_in_its_place():
    told = []
    m = Membership([u + "/" for u in URLS], tp_sizes=[1, 2, 4], min_live=1, on_lost=lambda u, w: told.append((u, w)))
    assert m.live == URLS and m.world_size == 8 and m.rank_offsets() == [1, 2, 4]
    m.group_formed()
    m.synced("3")
    assert not m.needs_new_group and m.with_loaded_version() == URLS

    m.leave_out(ServersLost("gone", {"http://b": "update: connection refused"}))
    assert m.live == ["http://a", "http://c"] and m.world_size == 6 and m.rank_offsets() == [1, 2]
    assert told == [("http://b", "update: connection refused")] and m.needs_new_group
    assert m.with_loaded_version() == ["http://a", "http://c"]  # a lost server's loaded version is forgotten

    assert m.readmit(["http://a", "http://b"]) == ["http://b"]  # only a lost one is re-admitted
    assert m.live == URLS and not m.lost and m.rank_offsets() == [1, 2, 4]
    assert not m.needs_new_group  # formed with these very servers: a restarted one is told apart below


def test_below_min_live_the_loss_names_every_lost_server():
    m = Membership(URLS, min_live=2)
    m.leave_out(ServersLost("gone", {"http://a": "stalled"}))
    with pytest.raises(WeightSyncError) as e:
        m.leave_out(ServersLost("gone", {"http://c": "refused"}))
    assert "fewer than rollout.min_healthy_servers=2" in str(e.value)
    assert "http://a: stalled" in str(e.value) and "http://c: refused" in str(e.value)
    assert isinstance(e.value.__cause__, ServersLost)


def test_a_restart_is_told_by_the_weight_version_and_a_refused_connection():
    m = Membership(URLS)
    m.synced("3")
    refused = SGLangConnectionError("/model_info", "connection refused")
    found = m.restarted(
        {"http://a": {"weight_version": "3"}, "http://b": {"weight_version": "default"}, "http://c": refused}
    )
    assert found["http://b"] == ("restarted: holds weight version default, not 3", None)
    assert found["http://c"][0].startswith("unreachable: ") and found["http://c"][1] is refused
    assert "http://a" not in found
    assert m.restarted({"http://a": TimeoutError("slow"), "http://b": {}}) == {}  # cannot tell: left to the sync


def test_rank0_decision_is_adopted():
    m = Membership(URLS)
    m.adopt(["http://a"], {"http://b": "x", "http://c": "y"})
    assert m.live == ["http://a"] and m.lost == {"http://b": "x", "http://c": "y"}


def test_failed_answers_are_named_and_a_gone_server_is_lost():
    refused = SGLangConnectionError("/begin_weight_update", "connection refused")
    with pytest.raises(ServersLost) as e:
        raise_failed_answers("begin_weight_update", URLS, [{}, refused, ValueError("bad")])
    assert e.value.urls == ["http://b"] and "http://c: ValueError('bad')" in str(e.value)
    with pytest.raises(WeightSyncError) as e:
        raise_failed_answers("end_weight_update", URLS, [{}, {}, ValueError("bad")])
    assert not isinstance(e.value, ServersLost)
    raise_failed_answers("end_weight_update", URLS, [{}, {}, {}])


def test_no_flush_after_an_in_place_pause():
    assert not flushes_cache(True, "in_place")
    assert flushes_cache(True, "retract") and flushes_cache(True, "abort") and flushes_cache(False, "in_place")


def test_single_source_streams_rank0s_tensors_and_raises_its_own_error():
    t = torch.zeros(2)
    zero, other = SingleSource(0), SingleSource(1)
    assert zero.is_source and zero.is_last_source and not other.is_source
    assert list(zero.own_tensors(iter([("a", t), ("b", None), ("c", t)]))) == [("a", t), ("c", t)]
    lost = ServersLost("gone", {"http://b": "x"})
    outcome = zero.agree(lost, StreamCounts(1, 8, 1))
    assert outcome.failure is lost and outcome.lost is lost and outcome.counts == {0: StreamCounts(1, 8, 1)}
    refused = WeightSyncError("refused")
    assert zero.agree(refused, StreamCounts()).lost is None
    assert other.decide(lambda: ("decided",)) is None and zero.decide(lambda: ("decided",)) == ("decided",)
    assert zero.group_name("g") == "g" and zero.source_bytes(outcome) is None


def test_a_turn_taking_source_streams_only_its_own_run():
    t = torch.zeros(2)
    topology = TurnTaking([0, 1], 1)
    items = iter([("a", None), ("b", t), ("c", t), ("d", None), ("e", None), ("f", t)])
    run = topology.own_tensors(items)  # its first tensor is rebuilt now, before its turn
    assert list(run) == [("b", t), ("c", t)]  # then the rest of its run, up to the next source's tensors
    assert next(items) == ("e", None)
    with pytest.raises(ValueError):
        TurnTaking([0], 0)


@pytest.mark.slow
def test_turn_taking_over_three_ranks_orders_turns_and_agrees_on_every_rank(tmp_path):
    from tests.dist_utils import run_torchrun

    out, order = tmp_path / "seen.json", tmp_path / "order"
    run_torchrun("turn_taking.py", 3, str(out), str(order), timeout=180)
    seen = json.loads(out.read_text())
    assert order.read_text().split() == ["0", "1", "2"]  # rank order, though rank 2 was ready first
    assert [s["formed"] for s in seen] == [1, 1, 1] and [s["group_name"] for s in seen] == [
        "g_src0",
        "g_src1",
        "g_src2",
    ]
    assert all(s["source_bytes"] == {"0": 0, "1": 10, "2": 20} for s in seen)
    # source 1 failed: the later source's turn says so, and every rank raises the same error naming it
    assert [s["turn_after_failure"] for s in seen] == [True, True, False]
    assert all(
        s["failure"] == ["WeightSyncError", "weight sync failed; source rank 1: bucket refused", True] for s in seen
    )
    # every failure lost servers: one ServersLost on every rank, with each source's
    assert all(s["lost"] == ["ServersLost", {"http://s0": "gone at 0", "http://s2": "gone at 2"}] for s in seen)
    assert all(s["regroup_errors"] == ["source rank 1: RuntimeError('cannot form')"] for s in seen)
    assert all(s["decision"] == [["http://back"], 0] for s in seen)


def test_the_store_as_a_transport_keeps_the_weights_of_the_version():
    store = WeightStore()
    transport = PerServerStoreTransport(store, syncer=None)
    transport.connect()
    t = torch.arange(4.0)
    assert transport.sync(iter([("w", t), ("x", None)]), 7, probe_logprobs=[0.5]) is None  # no syncer: no stats
    snap = store.snapshot()
    assert snap.version == 7 and snap.probe_logprobs == (0.5,) and [n for n, _ in snap.tensors] == ["w"]
    assert torch.equal(snap.tensors[0][1], t) and snap.tensors[0][1].data_ptr() != t.data_ptr()
    transport.close()
