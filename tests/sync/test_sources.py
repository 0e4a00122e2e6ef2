"""Weight sync from every export source (rollout.sync.sources: per_stage) against the rank-0 path.

A PP=2 dense, an EP=2 MoE and a TP=2 x EP=2 (expert TP 1) MoE megatron-core trainer (torchrun, gloo;
in the last, rank 1 takes part in source 0's TP gathers before its own turn) sync into embedded servers twice,
once with everything through rank 0 and once with each source broadcasting its own tensors over its own
update group. Both must leave the servers with the same weights (identical logprobs, equal to HF's own
model within 1e-4), and per_stage must move each tensor once: no export hop, each source broadcasting
exactly the bytes of the HF tensors the export yielded on it (sizes read here from the checkpoint files),
every tensor from exactly one source, no source more than model bytes / sources + one bucket (under EP the
dense tensors are spread over the expert-parallel sources, the experts stay with the rank holding them).
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from safetensors import safe_open

from megatron_dapo.rollout.launcher import embedded_server, start_servers
from megatron_dapo.runtime.net import LOOPBACK
from megatron_dapo.sync.addresses import NODE_ADDRESS_ENV
from tests.dist_utils import run_torchrun
from tests.runtime.test_bind_host import _external_ipv4
from tests.sync.test_broadcast import KEY, ckpts, servers  # noqa: F401  (tiny checkpoints; 2 dense servers + 1 MoE)
from tests.trainer.test_loop import _run as _loop_run
from tests.trainer.test_loop import env  # noqa: F401  (the loop tests' model, data and servers)

pytestmark = pytest.mark.slow


def _hf_bytes(ckpt) -> dict[str, int]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                out[name] = t.numel() * t.element_size()
    return out


def _pp_owner(name: str, num_layers: int) -> int:
    """Global rank of the first rank of the pipeline stage holding `name` (PP=2, TP=1)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return int(int(m.group(1)) >= num_layers // 2)
    return 0 if name.startswith("model.embed_tokens") else 1  # final norm and lm_head: last stage


def _ep_owner(name: str, num_experts: int) -> int:
    """Global rank rebuilding `name` (EP=2 over 2 ranks, expert TP 1): the expert-parallel rank of its
    expert; dense ones rank 0 (the first rank of their TP group, or their only DP replica's)."""
    m = re.search(r"\.experts\.(\d+)\.", name)
    return int(int(m.group(1)) >= num_experts // 2) if m else 0


def _run(ckpt, urls, layout, sources, out):
    run_torchrun("sync_megatron_trainer.py", 2, out, ckpt, KEY, *urls, *layout, "--sources", sources, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["pp2_dense", "ep2_moe", "tp2_ep2_etp1_moe"])
def test_per_stage_sources_deliver_the_rank0_weights_each_source_its_share(servers, ckpts, tmp_path, kind):
    import transformers

    if kind == "pp2_dense":
        ckpt, urls, layout = ckpts["q3_b"], [s.url for s in servers["q3"]], ["--tp", "1", "--pp", "2"]
        n_layers = transformers.AutoConfig.from_pretrained(ckpt).num_hidden_layers
        owner = lambda name: _pp_owner(name, n_layers)
    else:
        # tp2_ep2_etp1: rank 1 is a TP peer of source 0 (dense gathers) and the source of its own experts
        layout = ["--tp", "1", "--ep", "2"] if kind == "ep2_moe" else ["--tp", "2", "--ep", "2", "--etp", "1"]
        ckpt, urls = ckpts["moe_b"], [servers["moe"][0].url]
        e = transformers.AutoConfig.from_pretrained(ckpt).num_experts
        owner = lambda name: _ep_owner(name, e)
    sizes = _hf_bytes(ckpt)
    model_bytes = sum(sizes.values())
    share = {r: sum(b for name, b in sizes.items() if owner(name) == r) for r in (0, 1)}
    assert share[0] > 0 and share[1] > 0

    via_rank0 = _run(ckpt, urls, layout, "rank0", tmp_path / "rank0.json")
    per_stage = _run(ckpt, urls, layout, "per_stage", tmp_path / "per_stage.json")

    assert via_rank0["sources"] == [0] and per_stage["sources"] == [0, 1]
    for a, b in zip(via_rank0["rounds"], per_stage["rounds"], strict=True):
        for r in (a, b):
            assert r["server_versions"] == [r["version"]] * len(urls)
            assert r["tensors"] == len(sizes) and r["model_bytes"] == model_bytes
            assert r["max_diff_hf"] < 1e-4
        # the same weights on every server, bit for bit: identical logprobs
        assert b["server_logprobs"] == a["server_logprobs"]
        # through rank 0: rank 1's share hops to rank 0, which then broadcasts the whole model
        assert a["export_traffic"] == [[0, share[1]], [share[1], 0]]
        assert a["source_bytes"] == {"0": model_bytes}
        # per stage: no hop; each source broadcasts exactly the tensors the export yielded on it, each once
        assert b["export_traffic"] == [[0, 0], [0, 0]]
        sent = {r: names for r, names in enumerate(b["yielded"])}
        assert sorted(n for names in sent.values() for n in names) == sorted(sizes)
        assert b["source_bytes"] == {str(r): sum(sizes[n] for n in names) for r, names in sent.items()}
        busiest = max(b["source_bytes"].values())
        assert busiest <= model_bytes / 2 + per_stage["bucket_bytes"]  # the bound: model / sources + one bucket
        assert busiest < model_bytes + share[1]  # what rank 0 moves on the rank-0 path
        if kind == "pp2_dense":  # one source per stage: each broadcasts its own stage's tensors
            assert b["source_bytes"] == {"0": share[0], "1": share[1]}
            assert all(_pp_owner(n, n_layers) == r for r, names in sent.items() for n in names)
        else:  # experts by the expert-parallel rank holding them; the dense part spread over both sources
            assert all(owner(n) == r for r, names in sent.items() for n in names if ".experts." in n)
            dense = [n for n in sizes if ".experts." not in n]
            assert all(any(n in sent[r] for n in dense) for r in (0, 1)), sent


def test_a_failing_source_ends_every_session_and_is_named_on_every_rank(ckpts, tmp_path):
    """A server with only the first stage's layers: source rank 1's first update fails. Every rank raises
    the same error naming source rank 1, the server and the tensors; the session is ended and the version
    was not set."""
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.client import SGLangClient

    half = save_tiny_hf_model("qwen3", tmp_path / "half", seed=0, num_hidden_layers=2)
    server = embedded_server(str(half), tmp_path / "half.log", api_key=KEY)
    try:
        start_servers([server], timeout_s=180)

        async def version():
            async with SGLangClient(server.url, api_key=KEY) as c:
                return (await c.get_model_info())["weight_version"]

        before = asyncio.run(version())
        out = tmp_path / "fail.json"
        args = ["--tp", "1", "--pp", "2", "--sources", "per_stage", "--expect-failure"]
        run_torchrun("sync_megatron_trainer.py", 2, out, ckpts["q3_b"], KEY, server.url, *args, timeout=300)
        errors = json.loads(out.read_text())["errors"]
        assert errors[0] is not None and errors == [errors[0]] * 2, errors
        assert "source rank 1:" in errors[0] and "source rank 0" not in errors[0]
        assert server.url in errors[0] and "model.layers.2." in errors[0]

        async def session_closed():
            async with SGLangClient(server.url, api_key=KEY) as c:
                await c.begin_weight_update()  # refused if the failed sync had left its session open
                await c.end_weight_update()
                return (await c.get_model_info())["weight_version"]

        assert asyncio.run(session_closed()) == before
    finally:
        server.stop()


def test_training_loop_at_pp2_syncs_from_each_stage(env):
    """The DAPO loop at TP=1 x PP=2 (rollout.sync.sources auto -> per_stage): after every step the servers'
    probe logprobs equal the trainer's (rollout.sync.verify), and they change with every sync."""
    _, rows = _loop_run(env, "pp2", "parallel.tp=1", "parallel.pp=2", "trainer.total_steps=2")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sync/verify_max_abs_diff"] < 1e-4
        assert r["sync/sources"] == 2  # both stages broadcast
    assert abs(rows[0]["sync/probe_logprob_mean"] - rows[1]["sync/probe_logprob_mean"]) > 1e-5


def test_a_server_lost_mid_broadcast_is_left_out_by_every_source_and_the_rest_go_on(ckpts, tmp_path):
    """test_sync_degrade's kill, at PP=2 from both stages: the last source SIGKILLs a server halfway through
    its tensors. Every rank raises the same ServersLost naming that server (and the source that lost it),
    every source leaves it out, the other server's session was ended at its old version, and the next sync
    (a fresh export, as the trainer retries) reaches it with exactly the new weights. Source rank 1 hosts its
    group at its own node address (MEGATRON_DAPO_NODE_ADDRESS), rank 0 at its bind host, before and after the
    group is re-formed."""
    two = [embedded_server(str(ckpts["q3_a"]), tmp_path / f"s{i}.log", api_key=KEY, seed=i) for i in range(2)]
    try:
        start_servers(two, timeout_s=180)
        urls = [s.url for s in two]
        args = ["--tp", "1", "--pp", "2", "--sources", "per_stage", "--kill-pgid", str(two[1].proc.pid)]
        out = tmp_path / "degrade.json"
        # source rank 1 hosts its group at its own node address (this machine's external one if it has one)
        node = (_external_ipv4() or [LOOPBACK])[0]
        env = {NODE_ADDRESS_ENV: node}
        run_torchrun("sync_megatron_trainer.py", 2, out, ckpts["q3_b"], KEY, *urls, *args, timeout=300, env=env)
        report = json.loads(out.read_text())
        assert report["stores"] == [LOOPBACK, node]  # rank 0 at its bind host, rank 1 at its own setting
        first, second = report["rounds"]
        assert first["server_versions"] == ["1", "1"]
        lost = second["lost"]
        assert lost[0] is not None and lost == [lost[0]] * 2, lost  # the same on every rank
        assert lost[0]["urls"] == [urls[1]] and lost[0]["live"] == [urls[0]]
        assert "source rank 1: update_weights_from_distributed of " in lost[0]["message"]
        assert urls[1] in lost[0]["message"] and "continue_generation" not in lost[0]["message"]
        # the server that goes on: out of its session (a new one opens), still at version 1
        assert second["versions_after_loss"] == ["1"]
        assert second["sessions_after_loss"] == ["opened"]
        # the retried sync: only the live server, holding the new weights (HF's own model with them)
        assert second["server_versions"] == ["2"] and second["max_diff_hf"] < 1e-4
        assert second["source_bytes"].keys() == {"0", "1"}
        assert not two[1].alive()
    finally:
        for s in two:
            s.stop()
