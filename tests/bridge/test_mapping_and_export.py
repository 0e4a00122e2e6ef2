"""HF <-> megatron bridge: layout transforms (fast) and logits / exports at real layouts (slow, torchrun)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open

from megatron_dapo.bridge.hf_io import CheckpointError, HFCheckpointReader, ShardedSafetensorsWriter
from megatron_dapo.bridge.mapping import (
    GATE_UP,
    QKV,
    RULES,
    VOCAB,
    Unit,
    hf_from_shards,
    hf_names,
    hf_shape,
    shard_from_hf,
)
from megatron_dapo.models import QwenArch, padded_vocab_size
from megatron_dapo.models.tiny import save_tiny_hf_model, tiny_hf_config


def _rule(layout: str, expert: bool = False):
    return next(r for r in RULES if r.layout == layout and r.expert == expert)


def _reader(tensors: dict[str, torch.Tensor]):
    def read(name, dim, start, stop):
        t = tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


@pytest.fixture(scope="module")
def arch():
    # 8 query heads in 4 groups of 2, head_dim 3: small enough to build the reference by hand
    return QwenArch(
        family="qwen2",
        vocab_size=250,
        hidden_size=5,
        intermediate_size=8,
        num_layers=1,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=3,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
        qk_norm=False,
        max_position_embeddings=16,
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_shards_follow_megatron_group_interleave(arch, tp):
    q = torch.randn(8 * 3, 5, dtype=torch.float64)
    k = torch.randn(4 * 3, 5, dtype=torch.float64)
    v = torch.randn(4 * 3, 5, dtype=torch.float64)
    names = ("q", "k", "v")
    unit = Unit("decoder.layers.0.self_attention.linear_qkv.weight", _rule(QKV), names, 0, None)
    shards = [shard_from_hf(unit, arch, _reader(dict(q=q, k=k, v=v)), r, tp, ()) for r in range(tp)]
    # Reference, head by head: group g holds its 2 query heads, then its key head, then its value head;
    # rank r holds groups [r * 4/tp, (r+1) * 4/tp).
    per = 4 // tp
    for r, shard in enumerate(shards):
        rows = []
        for g in range(r * per, (r + 1) * per):
            rows += [q[(2 * g + j) * 3 : (2 * g + j + 1) * 3] for j in range(2)]
            rows += [k[g * 3 : (g + 1) * 3], v[g * 3 : (g + 1) * 3]]
        assert torch.equal(shard, torch.cat(rows))
    back = hf_from_shards(unit, arch, shards)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    # 1-D (bias) tensors take the same path
    qb, kb, vb = torch.randn(24), torch.randn(12), torch.randn(12)
    shards_b = [shard_from_hf(unit, arch, _reader(dict(q=qb, k=kb, v=vb)), r, tp, ()) for r in range(tp)]
    assert all(torch.equal(a, b) for a, b in zip(hf_from_shards(unit, arch, shards_b), (qb, kb, vb)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_and_vocab_shards(arch, tp):
    gate, up = torch.randn(8, 5), torch.randn(8, 5)
    g, u = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    unit = Unit("decoder.layers.0.mlp.linear_fc1.weight", _rule(GATE_UP), (g, u), 0, None)
    shards = [shard_from_hf(unit, arch, _reader({g: gate, u: up}), r, tp, ()) for r in range(tp)]
    n = 8 // tp
    for r, s in enumerate(shards):
        assert torch.equal(s, torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]]))
    assert all(torch.equal(a, b) for a, b in zip(hf_from_shards(unit, arch, shards), (gate, up)))

    emb = torch.randn(250, 5)
    vunit = Unit("embedding.word_embeddings.weight", _rule(VOCAB), ("e",), None, None)
    local = (padded_vocab_size(250, tp) // tp, 5)
    vshards = [shard_from_hf(vunit, arch, _reader(dict(e=emb)), r, tp, local) for r in range(tp)]
    full = torch.cat(vshards)
    assert torch.equal(full[:250], emb) and (full[250:] == 0).all()
    assert torch.equal(hf_from_shards(vunit, arch, vshards)[0], emb)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2"])
def test_hf_names_and_shapes_match_transformers_checkpoint(tmp_path, family):
    d = save_tiny_hf_model(family, tmp_path / family)
    arch = QwenArch.from_hf(d)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert sorted(hf_names(arch)) == sorted(on_disk)
    assert {n: hf_shape(arch, n) for n in hf_names(arch)} == on_disk


def test_every_hf_name_has_exactly_one_rule_template():
    arch = QwenArch.from_hf(tiny_hf_config("qwen3_moe"))
    templates = []
    for rule in RULES:
        for t in rule.hf:
            templates.append(re.compile(re.escape(t).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+")))
    for name in hf_names(arch):
        assert sum(bool(t.fullmatch(name)) for t in templates) == 1, name


def test_reader_errors_name_the_tensor(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ck"
    d.mkdir()
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, str(d / "model.safetensors"))
    r = HFCheckpointReader(d)
    r.check({"a": (2, 3), "b": (4,)})
    with pytest.raises(CheckpointError, match="missing tensor 'c'"):
        r.check({"a": (2, 3), "b": (4,), "c": (1,)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'b'"):
        r.check({"a": (2, 3)})
    with pytest.raises(CheckpointError, match=r"tensor 'a': expected shape \(3, 2\), got \(2, 3\)"):
        r.check({"a": (3, 2), "b": (4,)})
    assert torch.equal(r.read("a", 1, 1, 3), torch.zeros(2, 2))


def test_sharded_writer_roundtrip_through_index(tmp_path):
    tensors = {f"t{i}": torch.randn(64, 16) for i in range(5)}  # 4 KiB each
    w = ShardedSafetensorsWriter(tmp_path / "out", max_shard_bytes=9000)
    for k, v in tensors.items():
        w.add(k, v)
    files = w.close()
    assert len(files) == 3 and files[0] == "model-00001-of-00003.safetensors"
    r = HFCheckpointReader(tmp_path / "out")
    assert r.names() == set(tensors)
    assert all(torch.equal(r.read(k), v) for k, v in tensors.items())


def _results(out: str) -> dict[str, float]:
    return {f"{m[1]} {m[2]}": float(m[3]) for m in re.finditer(r"RESULT (\S+) (\S+) rel=(\S+)", out)}


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, [f"bridge_layouts:{c}" for c in ("tp1", "tp2", "pp2", "pp2vpp2", "ep2")], timeout=300)
def test_logits_and_exports_at_tp1_tp2_pp2_vpp_ep2(torchrun_checks):
    """2 ranks: every family (plus padded tied vocab, and norm_topk_prob=False) at TP1 (DP2), TP2, PP2,
    PP2 x VPP2; MoE at EP2. Logits vs HF < 1e-5; export_hf_weights == the file, bit for bit, in the same
    order on all ranks."""
    out = torchrun_checks()
    res = _results(out)
    assert len(res) == 5 * 4 + 2, out[-3000:]
    assert max(res.values()) < 1e-5


@pytest.mark.slow
@pytest.mark.torchrun_checks(4, ["bridge_layouts:tp2pp2", "bridge_layouts:tp2ep2"], timeout=240)
def test_logits_and_exports_at_tp2xpp2_and_tp2xep2(torchrun_checks):
    """4 ranks: TP2 x PP2 for every family, TP2 x EP2 (sequence parallel) for MoE, incl. a broadcast export
    and an export from each source (the dense tensors spread over the EP sources, each gathered by the TP
    group of the source it goes to)."""
    out = torchrun_checks()
    res = _results(out)
    assert len(res) == 5 + 2, out[-3000:]
    assert max(res.values()) < 1e-5
    assert "qwen3_moe tp2ep2 broadcast-export ok" in out
    assert "qwen3_moe tp2ep2 each-source-export ok" in out  # dense tensors spread over the EP sources


def test_transformer_engine_parameter_names_resolve():
    """TE's spec fuses the norms into the linears and names grouped experts weight{i}; both map."""
    from types import SimpleNamespace

    from megatron_dapo.bridge.mapping import resolve

    arch = QwenArch.from_hf(tiny_hf_config("qwen3_moe"))
    # chunk-local layer 1 is global layer 3 (e.g. the second stage of PP2); EP rank 1 of 2 owns experts 2, 3
    model = SimpleNamespace(
        decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=3), SimpleNamespace(layer_number=4)])
    )
    cases = {
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": ("model.layers.3.input_layernorm.weight",),
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": ("model.layers.3.post_attention_layernorm.weight",),
        "decoder.layers.1.mlp.experts.linear_fc1.weight1": (
            "model.layers.3.mlp.experts.3.gate_proj.weight",
            "model.layers.3.mlp.experts.3.up_proj.weight",
        ),
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": (
            "model.layers.2.mlp.experts.2.down_proj.weight",
        ),
    }
    for name, hf in cases.items():
        assert resolve(name, model, arch, ep_rank=1, num_local_experts=2).hf_names == hf, name
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.shared_experts.gate_weight"):
        resolve("decoder.layers.0.mlp.shared_experts.gate_weight", model, arch, 1, 2)
