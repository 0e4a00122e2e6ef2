"""Checkpoint conversion: `megatron-dapo convert` end to end (slow) and its input errors (fast)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.bridge.cli import main as convert_main
from megatron_dapo.bridge.layer_layout import saved_layer_layout
from megatron_dapo.models.tiny import save_tiny_hf_model
from tests.dist_utils import run_torchrun

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _no_partial(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name]


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory) -> Path:
    d = save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe", seed=3)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))  # a side file to carry over
    return d


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory, moe_hf) -> Path:
    """The MoE model converted at TP2 by the CLI (2 ranks)."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "tp2"
    r = _cli(
        "-m", "megatron_dapo.cli", "convert", "hf-to-megatron", "--hf", str(moe_hf), "--out", str(ckpt), "--tp", "2"
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert _no_partial(ckpt.parent) == []
    return ckpt


@pytest.mark.slow
def test_convert_tp2_load_elsewhere_and_back_to_hf(tmp_path, moe_hf, moe_ckpt):
    ckpt, back = moe_ckpt, tmp_path / "hf_back"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert (ckpt / "release" / "metadata.json").is_file() and (ckpt / "hf_config" / "config.json").is_file()
    # mlp_only_layers=[0] mixes dense and MoE layers: megatron-core stores them per layer
    assert saved_layer_layout(ckpt / "release") == "per-layer"

    # saved at TP2, loaded at TP1 (DP2), PP2 and EP2: logits equal HF's
    out = run_torchrun("bridge_ckpt_load.py", 2, str(moe_hf), str(ckpt), "tp1", "pp2", "ep2", timeout=240)
    errs = [float(x) for x in re.findall(r"RESULT ckpt \S+ rel=(\S+)", out)]
    assert len(errs) == 3 and max(errs) < 1e-5, out[-3000:]

    # back to HF through the tools/ wrapper, read at one rank, in small shards (exercises the index)
    r = _cli(
        "tools/checkpoint_convert/megatron_to_hf.py",
        "--ckpt",
        str(ckpt),
        "--out",
        str(back),
        "--max-shard-size-gb",
        str(200_000 / 1024**3),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((back / f).is_file() for f in files)
    assert (back / "tokenizer_config.json").is_file()
    original = load_file(str(moe_hf / "model.safetensors"))
    converted = {}
    for f in files:
        converted.update(load_file(str(back / f)))
    assert sorted(converted) == sorted(original)
    for name, t in original.items():
        assert converted[name].dtype == t.dtype and torch.equal(converted[name], t), name

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert _no_partial(tmp_path) == []


@pytest.mark.slow
def test_failed_conversion_leaves_no_output(tmp_path, moe_ckpt):
    """A failure inside the ranks (the checkpoint does not fit the given HF config) removes the temp dir."""
    # Without the checkpoint's own hf_config/ copy the mismatch is only found by the ranks' load.
    ckpt = tmp_path / "ckpt_no_config"
    # (and without the manifest that lists hf_config/: a checkpoint from elsewhere, converted unchecked)
    shutil.copytree(moe_ckpt, ckpt, ignore=shutil.ignore_patterns("hf_config", "manifest.json"))
    dense = save_tiny_hf_model("qwen3", tmp_path / "dense")
    out = tmp_path / "never"
    r = _cli(
        "-m",
        "megatron_dapo.cli",
        "convert",
        "megatron-to-hf",
        "--ckpt",
        str(ckpt),
        "--hf-config",
        str(dense),
        "--out",
        str(out),
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "megatron-dapo convert: error:" in r.stderr and "it is a checkpoint of another model" in r.stderr
    assert "has no manifest.json: its files cannot be checked for corruption" in r.stderr
    assert not out.exists() and _no_partial(tmp_path) == []


@pytest.mark.slow
def test_mismatched_hf_config_is_refused_before_any_rank(tmp_path, capsys, moe_ckpt):
    dense = save_tiny_hf_model("qwen3", tmp_path / "dense")
    err = _convert_error(
        capsys, "megatron-to-hf", "--ckpt", str(moe_ckpt), "--hf-config", str(dense), "--out", str(tmp_path / "o")
    )
    assert "describes another model" in err and "family: 'qwen3_moe' vs 'qwen3'" in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- input errors, caught before any rank starts


@pytest.fixture()
def dense_hf(tmp_path) -> Path:
    return save_tiny_hf_model("qwen3", tmp_path / "qwen3")


def _convert_error(capsys, *argv) -> str:
    assert convert_main(list(argv)) == 1
    return capsys.readouterr().err


def test_unsupported_architecture(tmp_path, capsys, dense_hf):
    cfg = json.loads((dense_hf / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (dense_hf / "config.json").write_text(json.dumps(cfg))
    err = _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", str(tmp_path / "o"))
    assert "MistralForCausalLM" in err and not (tmp_path / "o").exists()


def _rewrite(hf: Path, edit) -> None:
    sd = load_file(str(hf / "model.safetensors"))
    edit(sd)
    save_file(sd, str(hf / "model.safetensors"), metadata={"format": "pt"})


def test_missing_extra_and_misshaped_tensors(tmp_path, capsys, dense_hf):
    out = str(tmp_path / "o")
    _rewrite(dense_hf, lambda sd: sd.pop("model.layers.2.mlp.up_proj.weight"))
    assert "missing tensor 'model.layers.2.mlp.up_proj.weight'" in _convert_error(
        capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out
    )
    _rewrite(
        dense_hf,
        lambda sd: sd.update(
            {
                "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64),
                "model.layers.9.mlp.up_proj.weight": torch.zeros(1),
            }
        ),
    )
    assert "unexpected tensor 'model.layers.9.mlp.up_proj.weight'" in _convert_error(
        capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out
    )
    _rewrite(
        dense_hf,
        lambda sd: (
            sd.pop("model.layers.9.mlp.up_proj.weight"),
            sd.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(48, 64)}),
        ),
    )
    err = _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out)
    assert "tensor 'model.layers.1.self_attn.k_proj.weight': expected shape (32, 64), got (48, 64)" in err
    assert not Path(out).exists() and _no_partial(tmp_path) == []


def test_parallel_sizes_that_do_not_divide(tmp_path, capsys, dense_hf):
    out = str(tmp_path / "o")
    assert "tp=3 does not divide num_attention_heads=4" in _convert_error(
        capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out, "--tp", "3"
    )
    assert "pp*vpp=3 does not divide num_hidden_layers=4" in _convert_error(
        capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out, "--pp", "3"
    )
    assert "ep=2 needs a MoE model" in _convert_error(
        capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out, "--ep", "2"
    )


def test_existing_output_is_not_overwritten(tmp_path, capsys, dense_hf):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    assert "already exists" in _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", str(out))
    assert (out / "keep").read_text() == "x"


def test_truncated_safetensors_and_index_are_named(tmp_path, capsys, dense_hf):
    out = str(tmp_path / "o")
    shard = dense_hf / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    err = _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out)
    assert f"error: {shard}: not a readable safetensors file" in err.splitlines()[-1]
    shard.write_bytes(data)
    (dense_hf / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model.safe')
    err = _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", out)
    assert "model.safetensors.index.json is not a valid index" in err
    assert not Path(out).exists() and _no_partial(tmp_path) == []


def test_unwritable_output_paths_are_named(tmp_path, capsys, dense_hf):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", str(blocker / "o"))
    assert f"cannot create the output directory {blocker / 'o'}: {blocker} is a file, not a directory" in err
    assert blocker.read_text() == "x"
    if os.geteuid() == 0:  # root writes into any mode-0555 directory: use a read-only file system
        target = Path("/sys/megatron_dapo_convert_test/o")
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        target = ro / "o"
    err = _convert_error(capsys, "hf-to-megatron", "--hf", str(dense_hf), "--out", str(target))
    assert f"error: cannot create the output directory {target}:" in err.splitlines()[-1]
    assert not target.exists()


@pytest.mark.parametrize("size", ["-1", "0", "nan", "inf", "abc"])
def test_bad_shard_size_is_refused(tmp_path, capsys, size):
    with pytest.raises(SystemExit) as e:
        convert_main(
            ["megatron-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-size-gb", size]
        )
    assert e.value.code == 2
    assert f"--max-shard-size-gb: expected a positive size in GB, got '{size}'" in capsys.readouterr().err


@pytest.mark.slow
def test_corrupt_checkpoint_is_refused_by_megatron_to_hf(tmp_path, capsys, moe_ckpt):
    files = json.loads((moe_ckpt / "manifest.json").read_text())["files"]
    assert {"latest_checkpointed_iteration.txt", "release/metadata.json", "hf_config/config.json"} <= set(files)
    bad = tmp_path / "bad"
    shutil.copytree(moe_ckpt, bad)
    shard = max((bad / "release").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])  # 4 KB of flipped bytes, same size
    shard.write_bytes(bytes(data))
    err = _convert_error(capsys, "megatron-to-hf", "--ckpt", str(bad), "--out", str(tmp_path / "o"))
    assert f"error: {shard}: SHA-256 differs from the manifest" in err.splitlines()[-1]
    shard.write_bytes(bytes(data[:4096]))
    err = _convert_error(capsys, "megatron-to-hf", "--ckpt", str(bad), "--out", str(tmp_path / "o"))
    assert f"{shard}: 4096 bytes, the manifest says" in err
    (bad / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\x00garbage")
    err = _convert_error(capsys, "megatron-to-hf", "--ckpt", str(bad), "--out", str(tmp_path / "o"))
    assert "latest_checkpointed_iteration.txt holds" in err and "not 'release' or an iteration number" in err
    assert not (tmp_path / "o").exists() and _no_partial(tmp_path) == []


@pytest.mark.slow
def test_megatron_to_fp8_hf_equals_hf_to_fp8_and_serves(tmp_path, moe_hf, moe_ckpt):
    """A Megatron checkpoint written as an FP8 block HF checkpoint (`--weight-format fp8_block`) holds the same
    bytes as `hf-to-fp8` of the HF original (every linear weight, experts included, quantized; router gates,
    norms, embeddings kept), and the embedded server's model loaded from it holds the dequantized weights."""
    from megatron_dapo.bridge import fp8
    from megatron_dapo.bridge.convert import hf_to_fp8
    from megatron_dapo.embedded_server.server import load_model

    out = tmp_path / "fp8_from_megatron"
    r = _cli("-m", "megatron_dapo.cli", "convert", "megatron-to-hf", "--ckpt", str(moe_ckpt), "--out", str(out),
             "--weight-format", "fp8_block")  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    ref = hf_to_fp8(moe_hf, tmp_path / "fp8_from_hf")
    from megatron_dapo.bridge.hf_io import HFCheckpointReader

    ra, rb = HFCheckpointReader(out), HFCheckpointReader(ref)
    a, b = ({n: r.read(n) for n in r.names()} for r in (ra, rb))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
    experts = [n for n in a if ".mlp.experts." in n and n.endswith(".weight")]
    assert experts and all(a[n].dtype == torch.float8_e4m3fn for n in experts)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    gates = sorted(n.removesuffix(".weight") for n in a if n.endswith(".mlp.gate.weight"))
    assert gates and qc == fp8.quantization_config(["lm_head", *gates])
    assert json.loads((ref / "config.json").read_text())["quantization_config"] == qc

    model, _ = load_model(str(out), "cpu", "float32")
    from megatron_dapo.bridge.hf_loader import HFWeightLoader

    loader = HFWeightLoader(model)
    original = load_file(str(moe_hf / "model.safetensors"))
    for name, w in original.items():
        want = fp8.dequantize_block(*fp8.quantize_block(w), torch.float32) if fp8.is_quantized(name) else w
        assert torch.equal(loader.target(name)[0], want), name
