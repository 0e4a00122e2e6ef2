"""The embedded server serves FP8 block weights: started from a checkpoint `convert hf-to-fp8` wrote, and updated
with the FP8 block stream (weights and scales in separate tensors, across buckets) over a real gloo group or as
shared-memory handles (the IPC transport)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_dapo.bridge import fp8
from megatron_dapo.bridge.convert import ConversionError, hf_to_fp8
from megatron_dapo.bridge.hf_io import HFCheckpointReader

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "sync_hf_trainer.py"
KEY = "fp8-secret"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = tmp_path_factory.mktemp("fp8")
    a, b = save_tiny_hf_model("qwen3", d / "a", seed=0), save_tiny_hf_model("qwen3", d / "b", seed=1)
    return {"a": a, "b": b, "a_fp8": hf_to_fp8(a, d / "a_fp8")}


def test_hf_to_fp8_writes_the_block_layout(ckpts, tmp_path):
    src, out = HFCheckpointReader(ckpts["a"]), HFCheckpointReader(ckpts["a_fp8"])
    cfg = json.loads((ckpts["a_fp8"] / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", False)
    assert cfg["quantization_config"] == fp8.quantization_config([] if tied else ["lm_head"])
    quantized = sorted(n for n in src.names() if fp8.is_quantized(n))
    assert len(quantized) == 7 * 4  # q k v o gate up down, 4 layers of the tiny model
    assert out.names() == src.names() | {fp8.scale_name(n) for n in quantized}
    for n in src.names():
        t = out.read(n)
        if n in quantized:
            s = out.read(fp8.scale_name(n))
            assert t.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            q_ref, s_ref = fp8.quantize_block(src.read(n))
            assert torch.equal(t.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        else:
            assert torch.equal(t, src.read(n)), n
    for f in ("tokenizer.json", "generation_config.json"):
        if (ckpts["a"] / f).exists():
            assert (ckpts["a_fp8"] / f).read_bytes() == (ckpts["a"] / f).read_bytes()
    with pytest.raises(ConversionError, match="quantization_config already"):
        hf_to_fp8(ckpts["a_fp8"], tmp_path / "twice")
    with pytest.raises(ConversionError, match="already exists"):
        hf_to_fp8(ckpts["a"], ckpts["a_fp8"])


def test_server_model_from_an_fp8_checkpoint_holds_the_dequantized_weights(ckpts):
    from megatron_dapo.embedded_server.server import fp8_block_checkpoint, load_model

    assert fp8_block_checkpoint(str(ckpts["a_fp8"])) and not fp8_block_checkpoint(str(ckpts["a"]))
    model, _ = load_model(str(ckpts["a_fp8"]), "cpu", "float32")
    params = dict(model.named_parameters())
    rounded = 0
    with safe_open(ckpts["a"] / "model.safetensors", "pt") as src:
        for n in src.keys():
            w = src.get_tensor(n)
            if fp8.is_quantized(n):
                want = fp8.dequantize_block(*fp8.quantize_block(w), torch.float32)
                rounded += not torch.equal(want, w)
            else:
                want = w
            assert torch.equal(params[n].detach(), want), n
    assert rounded == 28  # every linear weight differs from the bf16 original: the server runs FP8's rounding


def test_a_bad_quantization_config_is_refused_naming_the_file(ckpts, tmp_path):
    from megatron_dapo.embedded_server.server import fp8_block_checkpoint

    d = tmp_path / "bad"
    d.mkdir()
    cfg = json.loads((ckpts["a_fp8"] / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [1, 32]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fp8.Fp8FormatError, match=r"bad/config.json.*weight_block_size"):
        fp8_block_checkpoint(str(d))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_tensor", "flattened"])
def test_fp8_sync_into_a_server_started_from_fp8(ckpts, tmp_path, mode):
    """A server started from model a's FP8 checkpoint gets model b in the FP8 block stream: its logprobs
    equal a float32 model holding b's weights as the quantization rounds them, not b's own."""
    from megatron_dapo.rollout.launcher import launch_embedded

    server = launch_embedded(str(ckpts["a_fp8"]), tmp_path / "server.log", api_key=KEY, timeout_s=180)
    try:
        extra = ["--flatten"] if mode == "flattened" else []
        res = _sync_worker(tmp_path, "out", server, ckpts["b"], *extra)
    finally:
        server.stop()
    assert res["max_diff"] < 1e-4
    (st,) = res["stats"]
    assert st["tensors"] == 47 + 28 and st["buckets"] > 1  # each linear weight and its scales
    # the check is not vacuous: model b unquantized gives visibly different logprobs
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32).eval()
    probe = res["probe"]
    with torch.no_grad():
        logits = plain(torch.tensor([probe])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)
    assert max(abs(x - y) for x, y in zip(lp.tolist(), res["servers"][0])) > 1e-3


def _sync_worker(tmp_path, name: str, server, ckpt, *extra) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(WORKER), str(out), str(ckpt), server.url, "--api-key", KEY, "--fp8", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fp8_over_ipc_serves_what_fp8_over_broadcast_serves(ckpts, tmp_path):
    """rollout.weight_format=fp8_block over rollout.sync.transport=ipc: a server started from model a's FP8
    checkpoint gets model b's FP8 block stream as shared-memory handles (/update_weights_from_tensor, per
    tensor and flattened; buckets small enough that weights and their scales fall in different buckets, so the
    server holds one half while the sender reuses its staging buffer for the next bucket). It then serves b's
    weights as the quantization rounds them (a float32 model holding those), bit for bit what the same server
    serves after the same stream over the broadcast transport."""
    from megatron_dapo.rollout.launcher import launch_embedded

    server = launch_embedded(str(ckpts["a_fp8"]), tmp_path / "server.log", api_key=KEY, timeout_s=180)
    try:
        small = ["--bucket-mb", "0.004"]  # 4 KiB: an MLP weight (8 KiB of float8) has a bucket alone
        ipc = _sync_worker(tmp_path, "ipc", server, ckpts["b"], "--transport", "ipc", *small)
        # model a again, then b: each sync must replace what the server held
        ipc_flat, bcast = (
            _sync_worker(tmp_path, name, server, ckpts["b"], "--first-ckpt", str(ckpts["a"]), *small, *extra)
            for name, extra in (("ipc_flat", ["--transport", "ipc", "--flatten"]), ("broadcast", []))
        )
    finally:
        server.stop()
    for res in (ipc, ipc_flat, bcast):
        assert res["max_diff"] < 1e-4
        (st,) = res["stats"]
        assert st["tensors"] == 47 + 28 and st["buckets"] > 10
    for res in (ipc_flat, bcast):  # model a's FP8 weights were loaded in between: not vacuous
        assert max(abs(x - y) for x, y in zip(res["after_first"][0], res["servers"][0])) > 1e-3
    assert ipc["servers"] == ipc_flat["servers"] == bcast["servers"]


def test_servers_start_from_an_fp8_copy_written_once(ckpts, tmp_path):
    from megatron_dapo.config import DapoConfig
    from megatron_dapo.rollout.launcher import rollout_model_path

    cfg = DapoConfig()
    cfg.model.hf_path, cfg.logging.run_dir = str(ckpts["a"]), str(tmp_path / "run")
    assert rollout_model_path(cfg) == str(ckpts["a"])  # bf16: the trainer's checkpoint
    cfg.rollout.weight_format = "fp8_block"
    path = rollout_model_path(cfg)
    assert path == str(tmp_path / "run" / "rollout_fp8")
    assert json.loads((Path(path) / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    stamp = (Path(path) / "config.json").stat().st_mtime_ns
    assert rollout_model_path(cfg) == path and (Path(path) / "config.json").stat().st_mtime_ns == stamp  # reused
    cfg.model.hf_path = str(ckpts["a_fp8"])  # FP8 already: used as it is
    assert rollout_model_path(cfg) == str(ckpts["a_fp8"])


def _worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_hf_trainer", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hf_logprobs(ckpt, probe: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([probe])).logits[0].double()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.slow
def test_fp8_sync_of_a_moe_rounds_every_expert_on_the_server(tmp_path):
    """The tiny Qwen3-MoE: a server started from model a's FP8 checkpoint gets model b in the FP8 block stream
    (per-expert gate/up/down weights and scales, which the server pairs and fuses into its experts): its logprobs
    equal a float32 model holding b's weights as the quantization rounds them, experts included; with b's experts
    left unrounded (everything else rounded) the reference visibly differs, so the experts the server runs are
    the rounded ones."""
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded

    a, b = save_tiny_hf_model("qwen3_moe", tmp_path / "a", seed=0), save_tiny_hf_model("qwen3_moe", tmp_path / "b", 1)
    a_fp8 = hf_to_fp8(a, tmp_path / "a_fp8")
    names = HFCheckpointReader(b).names()
    experts = {n for n in names if ".mlp.experts." in n}
    assert experts and all(fp8.is_quantized(n) for n in experts)
    server = launch_embedded(str(a_fp8), tmp_path / "server.log", api_key=KEY, timeout_s=180)
    try:
        res = _sync_worker(tmp_path, "out", server, b)
    finally:
        server.stop()
    assert res["max_diff"] < 1e-4
    (st,) = res["stats"]
    assert st["tensors"] == len(names) + sum(fp8.is_quantized(n) for n in names)
    (tmp_path / "experts_unrounded").mkdir()
    unrounded = _worker_module().rounded_copy(str(b), str(tmp_path / "experts_unrounded"), keep=experts.__contains__)
    lp = _hf_logprobs(unrounded, res["probe"])
    assert max(abs(x - y) for x, y in zip(lp, res["servers"][0])) > 1e-3  # 0.026 when measured
