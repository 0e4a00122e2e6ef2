"""Rollout routing replay (R3), items 1-2 (and the actor's replay end to end): algo.routing_replay, and the
samples' routed experts from a real embedded MoE server through the router, partial rollout, the step
batch, DP shards and checkpoints."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.derived import routing_shape
from megatron_dapo.rollout import payloads
from megatron_dapo.types import RoutingShape, routing_dtype

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "qwen3"
MOE = RoutingShape(num_layers=3, moe_layers=(1, 2), top_k=2, num_experts=8)  # layer 0 dense, as the tiny MoE


def test_routing_replay_defaults_by_model_and_refuses_dense():
    cfg = load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml")
    assert cfg.algo.routing_replay is None
    shape = routing_shape(cfg)
    assert shape == RoutingShape(num_layers=4, moe_layers=(1, 2, 3), top_k=2, num_experts=4)
    assert routing_shape(load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml", ["algo.routing_replay=none"])) is None
    assert routing_shape(load_config(CONFIGS / "tiny_qwen3_cpu.yaml")) is None  # dense: off by default
    with pytest.raises(ConfigError, match="algo.routing_replay=rollout needs an MoE model"):
        load_config(CONFIGS / "tiny_qwen3_cpu.yaml", ["algo.routing_replay=rollout"])
    with pytest.raises(ConfigError, match="algo.routing_replay"):
        load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml", ["algo.routing_replay=always"])


def test_launchers_pass_sglangs_flag_when_replay_is_on():
    from megatron_dapo.rollout.launcher import SGLangServerArgs, sglang_command

    on = load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml")
    off = load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml", ["algo.routing_replay=none"])
    assert "--enable-return-routed-experts" in sglang_command(SGLangServerArgs.from_config(on, "m", 1))
    assert "--enable-return-routed-experts" not in sglang_command(SGLangServerArgs.from_config(off, "m", 1))


def test_compact_dtype_is_the_smallest_unsigned_that_holds_the_experts():
    assert [routing_dtype(n) for n in (4, 128, 256, 257, 65536, 65537)] == [
        torch.uint8,
        torch.uint8,
        torch.uint8,
        torch.uint16,
        torch.uint16,
        torch.int32,
    ]
    assert RoutingShape(48, tuple(range(48)), 8, 128).bytes_per_token == 48 * 8  # Qwen3-30B-A3B


def test_parse_keeps_the_moe_layers_compactly_and_names_a_missing_field():
    rows = torch.randint(0, 8, (5, 3, 2), dtype=torch.int32)
    rows[:, 0] = 0  # SGLang leaves the dense layer at zeros
    item = {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0"}}
    item["meta_info"]["routed_experts"] = payloads.encode_routed_experts(rows)
    (s,) = payloads.parse_generate(item, [7, 8, 9, 10], routing=MOE)
    assert s.routed_experts.dtype == torch.uint8 and torch.equal(s.routed_experts, rows[:, 1:].to(torch.uint8))
    del item["meta_info"]["routed_experts"]
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        payloads.parse_generate(item, [7, 8, 9, 10], routing=MOE)
    rows[0, 1, 0] = 8
    item["meta_info"]["routed_experts"] = payloads.encode_routed_experts(rows)
    with pytest.raises(ValueError, match="outside"):
        payloads.parse_generate(item, [7, 8, 9, 10], routing=MOE)


@pytest.mark.slow
def test_samples_carry_routing_from_a_server_through_partial_rollout_batch_shards_and_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_dapo.config.shapes import read_hf_config_file, shape_from_hf
    from megatron_dapo.coordinator.batch import build_batch
    from megatron_dapo.coordinator.groups import JudgedGroup
    from megatron_dapo.coordinator.metrics import batch_metrics
    from megatron_dapo.coordinator.partial import continuation_ids, finish_partial
    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import embedded_server, start_servers
    from megatron_dapo.rollout.types import SamplingParams
    from megatron_dapo.shards import shard_batch

    model_dir = save_tiny_hf_model("qwen3_moe", tmp_path / "moe", num_hidden_layers=3, num_experts=8)
    shape = shape_from_hf(read_hf_config_file(str(model_dir)))
    routing = RoutingShape(shape.num_layers, shape.moe_layers, shape.moe_topk, shape.num_experts)
    assert routing == MOE
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def reference(seq: list[int]) -> torch.Tensor:
        """An unbatched HF forward's router logits -> top-k, [len(seq) - 1, MoE layers, top_k]."""
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq]), output_router_logits=True)
        return torch.stack([lg.topk(2, dim=-1).indices for lg in out.router_logits], dim=1)[:-1].to(torch.uint8)

    srv = embedded_server(str(model_dir), tmp_path / "server.log", return_routed_experts=True)
    start_servers([srv], timeout_s=120)
    prompts = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9]]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True, sampling_seed=11)

    async def rollout():
        router = Router([srv.url], routed_experts=routing)
        samples = []
        for i, prompt in enumerate(prompts):
            # the first piece stops after 4 tokens, as an abort would leave it; partial rollout continues it
            (head,) = await router.generate(prompt, replace(sampling, max_new_tokens=4), rid=f"s{i}")
            head = replace(head, finish_reason="abort")

            async def more(so_far, sp):
                (piece,) = await router.generate(
                    continuation_ids(so_far), sp, rid=f"s{i}-more", generated=len(so_far.output_ids)
                )
                return piece

            samples.append(await finish_partial(more, head, sampling))
        await router.aclose()
        return samples

    try:
        samples = asyncio.run(rollout())
    finally:
        srv.stop()
    for s in samples:
        assert len(s.output_ids) == 9 and s.routed_experts.dtype == torch.uint8
        assert torch.equal(s.routed_experts, reference(s.prompt_ids + s.output_ids))

    groups = [
        JudgedGroup(prompt_index=i, samples=[s], scores=[1.0], accs=[True], overlong=[0.0], token_versions=[[0] * 9])
        for i, s in enumerate(samples)
    ]
    restored = [JudgedGroup.from_state(json.loads(json.dumps(g.to_state()))) for g in groups]
    assert all(torch.equal(a.samples[0].routed_experts, b.samples[0].routed_experts) for a, b in zip(groups, restored))
    batch = build_batch(restored, step=0, temperature=1.0)
    assert [r.shape[0] for r in batch.routed_experts] == [len(x) - 1 for x in batch.input_ids]
    shards = shard_batch(batch, dp_size=2, mini_batch_groups=2)
    for shard in shards:
        for row, seq in zip(shard.batch.routed_experts, shard.batch.input_ids):
            assert torch.equal(row, reference(seq))
    want = sum(len(x) - 1 for x in batch.input_ids) * 2 * 2  # positions x MoE layers x top-k x 1 byte
    assert batch_metrics(batch)["rollout/routing_bytes"] == want


@pytest.mark.slow
def test_tiny_moe_config_trains_carrying_the_routing(tmp_path):
    """The tiny MoE CPU config, routing_replay left at its MoE default: the driver's server returns routed
    experts, two steps train replaying them, a checkpoint holds them, and rollout/routing_bytes is every sample's
    (prompt + response - 1) x MoE layers x top-k bytes. Resumed from the checkpoint of step 0 (step 1's batch
    and the groups in flight; syncs abort requests, so a sample caught by one is saved or trained partially
    rolled out), step 1 replays the saved routing exactly as the uninterrupted run did."""
    import shutil
    import subprocess
    import sys

    from benchmarks.routing_replay import prepare, run_overrides

    model, train = prepare(tmp_path)
    run_dir = tmp_path / "run"
    kept = ("checkpoint.save_every=1", "checkpoint.keep_last=0", "rollout.sync.pause_mode=abort")
    overrides = run_overrides(model, train, run_dir, 2, *kept)
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(CONFIGS / "tiny_qwen3_moe_cpu.yaml")]

    def train_rows(args: list[str], where: Path) -> list[dict]:
        proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=1200, cwd=CONFIGS.parents[1])
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]

    rows = train_rows(overrides, run_dir)
    cfg = load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml", overrides)
    per_token = len(routing_shape(cfg).moe_layers) * 2  # top-2 of 4 experts, one byte each
    samples = cfg.algo.train_batch_size * cfg.rollout.n_resp_per_prompt
    assert len(rows) == 2
    for m in rows:
        positions = samples * (m["prompt/length_mean"] + m["response/length_mean"] - 1)
        assert m["rollout/routing_bytes"] == pytest.approx(positions * per_token, rel=1e-9)
        # the actor replays them (int64 ids to its routers, filler rows and both passes included)
        assert m["actor/routing_replay_bytes"] >= 8 * 2 * m["rollout/routing_bytes"]
        assert 0.0 < m["actor/routing_agreement"] <= 1.0
    # step 0 trains on samples of its own weights: replaying the servers' routing gives their logprobs
    assert rows[0]["actor/train_rollout_logprob_abs_diff"] < 1e-5
    saved = [json.loads(f.read_text()) for f in sorted(run_dir.glob("checkpoints/*/rollout.json"))]
    groups = [g for st in saved for g in (st["next_batch"] or {"groups": []})["groups"] + st["buffer"]]
    saved_samples = [s for g in groups for s in g["samples"]] + [
        s for st in saved for f in st["in_flight"] for s in f["samples"] or () if s is not None
    ]
    assert saved_samples and all(
        s["routed_experts"]["dtype"] == "uint8"
        and s["routed_experts"]["shape"] == [len(s["prompt_ids"]) + len(s["output_ids"]) - 1, 3, 2]
        for s in saved_samples
    )

    # resume from the checkpoint of step 0: step 1 trains on its saved batch, replaying the saved rows
    step1_batch = json.loads((run_dir / "checkpoints" / "step_000000" / "rollout.json").read_text())["next_batch"]
    save = tmp_path / "resume_ckpt"
    shutil.copytree(run_dir / "checkpoints" / "step_000000", save / "step_000000")
    (save / "latest").write_text("step_000000\n")
    resumed_dir = tmp_path / "resumed"
    resume = run_overrides(model, train, resumed_dir, 2, *kept, f"checkpoint.save_dir={save}", "checkpoint.resume=true")
    (resumed,) = train_rows(resume, resumed_dir)
    assert resumed["step"] == 1
    saved_bytes = sum(
        (len(s["prompt_ids"]) + len(s["output_ids"]) - 1) * per_token
        for g in step1_batch["groups"]
        for s in g["samples"]
    )
    assert resumed["rollout/routing_bytes"] == rows[1]["rollout/routing_bytes"] == saved_bytes
    # the same rows replayed: the trainer's logprobs, its own routers' agreement and the loss are the uninterrupted
    # run's (a row lost or reordered through the checkpoint moves them)
    for key in ("actor/train_rollout_logprob_abs_diff", "actor/routing_agreement", "actor/pg_loss"):
        assert resumed[key] == pytest.approx(rows[1][key], rel=1e-6, abs=1e-9), key
