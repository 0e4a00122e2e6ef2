"""FP8 block quantization (bridge.fp8): the round trip in float64, partial blocks, the export-stream stage and
its inverse; SGLang 0.5.23's own quantizer and FP8 linear method judge the layout (tests/sglang_peer.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_dapo.bridge import fp8

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _weight(shape, seed=0, scale=0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    w[0, 0] = 7 * scale  # an outlier: its block's scale is set by it
    return w.to(torch.bfloat16)


def _blocks(t: torch.Tensor):
    """(row slice, col slice) of every 128 x 128 block, partial at the edges."""
    for i in range(0, t.shape[0], fp8.BLOCK):
        for j in range(0, t.shape[1], fp8.BLOCK):
            yield slice(i, i + fp8.BLOCK), slice(j, j + fp8.BLOCK)


@pytest.mark.parametrize("shape", [(256, 384), (200, 72), (64, 64), (130, 257)])
def test_round_trip_within_e4m3_rounding_per_block(shape):
    """Per block in float64: the scale is amax / 448 (as a float32), the largest entry lands on 448, and every
    dequantized entry is within half an e4m3 step of the original (3 mantissa bits: 2^-4 relative for
    normals, 2^-10 absolute below the smallest normal 2^-6, in units of the block's scale)."""
    w = _weight(shape)
    q, s = fp8.quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert list(s.shape) == fp8.scale_shape(shape) == [-(-shape[0] // 128), -(-shape[1] // 128)]
    deq = fp8.dequantize_block(q, s, torch.float64)
    w64, q64 = w.double(), q.double()
    for bi, (r, c) in enumerate(_blocks(w)):
        block, scale = w64[r, c], float(s.view(-1)[bi])
        amax = float(block.abs().max())
        assert scale == pytest.approx(amax / 448.0, rel=2**-23)
        assert float(q64[r, c].abs().max()) == 448.0
        bound = torch.clamp(block.abs() / scale * 2**-4, min=2**-10) * scale
        err = (deq[r, c] - block).abs()
        assert bool((err <= bound * (1 + 1e-12)).all()), f"block {bi}: max excess {float((err - bound).max())}"
    assert float((deq - w64).abs().max()) > 0  # it is a quantization: something was rounded


def test_all_zero_block_and_dequantized_dtype():
    w = torch.zeros(130, 10, dtype=torch.bfloat16)
    w[129, 9] = 1.0  # the second row block's amax; the first is all zero (scale from the 1e-4 clamp)
    q, s = fp8.quantize_block(w)
    assert float(s[0, 0]) == pytest.approx(1e-4 / 448, rel=1e-6)
    assert torch.equal(fp8.dequantize_block(q, s, torch.bfloat16), w)


def test_quantize_stream_layout_and_none_on_other_ranks():
    named = [
        ("model.embed_tokens.weight", _weight((300, 64))),
        ("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", _weight((128, 64))),
        ("model.layers.0.self_attn.q_norm.weight", torch.ones(16, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.gate.weight", _weight((8, 64))),  # a router: kept
        ("model.layers.0.mlp.experts.3.down_proj.weight", _weight((64, 32))),
        ("lm_head.weight", _weight((300, 64))),
    ]
    out = list(fp8.quantize_stream(named))
    names = [n for n, _ in out]
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv",
        "lm_head.weight",
    ]
    kept = dict(named)
    for n, t in out:
        if n in kept and not fp8.is_quantized(n):
            assert t is kept[n]  # untouched, not even copied
    # a rank holding nothing sees the same names
    assert [n for n, _ in fp8.quantize_stream((n, None) for n, _ in named)] == names
    assert all(t is None for _, t in fp8.quantize_stream((n, None) for n, _ in named))
    assert fp8.not_converted_modules(kept) == ["lm_head", "model.layers.0.mlp.gate"]


def test_dequantizing_stream_pairs_across_buckets_in_either_order():
    w1, w2 = _weight((128, 256), 1), _weight((40, 70), 2)
    (n1, q1), (s1n, s1), (n2, q2), (s2n, s2) = fp8.quantize_stream(
        [("a.self_attn.o_proj.weight", w1), ("a.mlp.up_proj.weight", w2)]
    )
    d = fp8.DequantizingStream(torch.float32)
    norm = torch.ones(3)
    got = list(d.feed([(n1, q1), ("a.norm.weight", norm)]))  # first bucket ends before the scale
    assert [n for n, _ in got] == ["a.norm.weight"] and d.pending() == [n1]
    got += list(d.feed([(s1n, s1), (s2n, s2)]))  # second: a scale before its weight
    got += list(d.feed([(n2, q2)]))
    d.finish()
    out = dict(got)
    assert torch.equal(out[n1], fp8.dequantize_block(q1, s1, torch.float32))
    assert torch.equal(out[n2], fp8.dequantize_block(q2, s2, torch.float32))
    assert set(out) == {n1, n2, "a.norm.weight"}


def test_dequantizing_stream_copies_a_half_that_waits_past_its_bucket():
    """A bucket's memory is reused by the next one (the IPC transport's shared-memory staging buffer): a weight
    or scale whose other half comes in a later bucket is copied when its bucket ends, not read from there later."""
    (n1, q1), (s1n, s1), (n2, q2), (s2n, s2) = fp8.quantize_stream(
        [("a.mlp.down_proj.weight", _weight((130, 200))), ("a.mlp.up_proj.weight", _weight((200, 130)))]
    )
    want = {n1: fp8.dequantize_block(q1, s1, torch.float32), n2: fp8.dequantize_block(q2, s2, torch.float32)}
    staging = torch.empty(q1.numel(), dtype=torch.uint8)  # one buffer, each bucket written over the last
    d = fp8.DequantizingStream(torch.float32)
    staging.copy_(q1.view(torch.uint8).reshape(-1))
    assert list(d.feed([(n1, staging.view(fp8.FP8).view(q1.shape))])) == []
    staging.fill_(0x7F)  # the next bucket's bytes (0x7F is NaN in e4m3)
    got = dict(d.feed([(s1n, s1)]))
    staging_f32 = torch.empty(s2.numel(), dtype=torch.float32)
    staging_f32.copy_(s2.reshape(-1))
    got |= dict(d.feed([(s2n, staging_f32.view(s2.shape))]))  # a scale before its weight, likewise
    staging_f32.fill_(float("nan"))
    got |= dict(d.feed([(n2, q2)]))
    d.finish()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_dequantizing_stream_errors_name_the_tensor():
    q, s = fp8.quantize_block(_weight((128, 128)))
    d = fp8.DequantizingStream()
    list(d.feed([("x.k_proj.weight", q)]))
    with pytest.raises(fp8.Fp8FormatError, match="x.k_proj.weight"):
        d.finish()
    assert d.pending() == []
    with pytest.raises(fp8.Fp8FormatError, match="x.k_proj.weight.*not a 128 x 128 block pair"):
        list(d.feed([("x.k_proj.weight", q), ("x.k_proj.weight_scale_inv", s[:, :0])]))
    with pytest.raises(fp8.Fp8FormatError, match="model.norm.weight: float8"):
        list(fp8.DequantizingStream().feed([("model.norm.weight", q[0])]))


def test_quantization_config_is_what_the_released_checkpoints_carry():
    qc = fp8.quantization_config(["lm_head"])
    assert qc == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }
    assert fp8.is_fp8_block_config(qc) and not fp8.is_fp8_block_config(None)
    with pytest.raises(fp8.Fp8FormatError, match="weight_block_size"):
        fp8.is_fp8_block_config({**qc, "weight_block_size": [1, 32]})


# ---- SGLang 0.5.23's own code as the judge ----------------------------------------------------------
def _sglang_fp8(case: dict, tmp_path, cmd: str = "fp8-block") -> dict:
    from tests import sglang_peer

    sglang_peer.ensure_installed()
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(case, src)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang_peer", cmd, str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(dst)


@pytest.mark.slow
def test_sglang_quantizer_and_fp8_linear_method_agree(tmp_path):
    """Byte for byte equal to SGLang's block quantizer (float32 scales; also for partial edge blocks), and
    SGLang's Fp8LinearMethod, built from the checkpoint's quantization_config, loads what the bridge sends
    for a merged QKV, a merged gate/up and a row-parallel down projection: its layer holds exactly our bytes
    and scales after an online update (restore, loaders, post-loading step) over other start weights, and
    SGLang's block_quant_dequant of it equals our dequantization of each HF tensor."""
    hidden, head_dim, heads, kv_heads, inter = 256, 128, 2, 1, 384
    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "odd": (200, 72),
        "odd2": (130, 257),
    }
    bf16 = {n: _weight(s, seed=i) for i, (n, s) in enumerate(shapes.items())}
    ours = {n: fp8.quantize_block(w) for n, w in bf16.items()}
    start = {n: fp8.quantize_block(_weight(s, seed=100 + i)) for i, (n, s) in enumerate(shapes.items())}
    linears = {
        "model.layers.0.self_attn.qkv_proj": {
            "kind": "qkv",
            "shapes": [hidden, head_dim, heads, kv_heads],
            "shards": {"q": ours["q_proj"], "k": ours["k_proj"], "v": ours["v_proj"]},
        },
        "model.layers.0.mlp.gate_up_proj": {
            "kind": "merged",
            "shapes": [hidden, [inter, inter]],
            "shards": {0: ours["gate_proj"], 1: ours["up_proj"]},
        },
        "model.layers.0.mlp.down_proj": {"kind": "row", "shapes": [inter, hidden], "shards": {None: ours["down_proj"]}},
    }
    for spec in linears.values():  # the server started from other weights; the update brings ours
        names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj", None: "down_proj"}
        spec["first"] = {k: start[names[k]] for k in spec["shards"]}
    theirs = _sglang_fp8({"bf16": bf16, "quantization_config": fp8.quantization_config(), "linears": linears}, tmp_path)
    for n, (q, s) in ours.items():
        tq, ts = theirs["quantized"][n]
        assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8)), n
        assert torch.equal(s, ts), n
        # DeepGEMM's variant (per_block_cast_to_fp8) rounds the same scale up to a power of two
        uq, us = theirs["ue8m0"][n]
        assert torch.equal(us, torch.exp2(torch.ceil(torch.log2(s)))), n
    for prefix, spec in linears.items():
        layer = theirs["layers"][prefix]
        parts = list(spec["shards"].values())
        assert torch.equal(layer["weight"].view(torch.uint8), torch.cat([q for q, _ in parts]).view(torch.uint8))
        assert torch.equal(layer["scale"], torch.cat([s for _, s in parts]))
        mine = torch.cat([fp8.dequantize_block(q, s, torch.float32) for q, s in parts])
        assert torch.equal(layer["dequantized"], mine), prefix


def _experts(prefix: str, num_experts: int, hidden: int, inter: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Per-expert bf16 projections under the HF names the bridge exports (Qwen3-MoE)."""
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return [
        (f"{prefix}.{e}.{proj}.weight", _weight(shape, seed=seed + 3 * e + i))
        for e in range(num_experts)
        for i, (proj, shape) in enumerate(shapes.items())
    ]


@pytest.mark.slow
def test_sglang_fp8_moe_method_loads_our_experts(tmp_path):
    """SGLang's FusedMoE with the Fp8MoEMethod its Fp8Config picks from our quantization_config, loaded through
    Qwen3MoeForCausalLM.load_weights from what quantize_stream sends (per-expert gate/up/down weights and
    weight_scale_inv under the HF names), a server start then an online update with its post-loading step:
    its stacked w13 (gate then up) and w2 weights and block scales are our bytes, for every local expert, also
    on an expert-parallel rank (EP 2, rank 1: experts 2 and 3) and with partial blocks along hidden (200);
    SGLang's block_quant_dequant of them equals our dequantization. SGLang refuses the tiny MoE config's expert
    width (moe_intermediate_size 32: gate/up rows must fill 128-row blocks), which only the embedded server serves."""
    num_experts, hidden, inter = 4, 200, 256
    full, ep_rank, tiny = "model.layers.1.mlp.experts", "model.layers.3.mlp.experts", "model.layers.2.mlp.experts"
    moe, sent = {}, {}
    for prefix, ep in ((full, (1, 0)), (ep_rank, (2, 1))):
        first = list(fp8.quantize_stream(_experts(prefix, num_experts, hidden, inter, seed=100)))
        sent[prefix] = dict(fp8.quantize_stream(_experts(prefix, num_experts, hidden, inter, seed=0)))
        update = list(sent[prefix].items())
        moe[prefix] = {"shapes": [num_experts, hidden, inter, 2], "ep": list(ep), "first": first, "update": update}
    moe[tiny] = {"shapes": [4, 64, 32, 2], "first": [], "update": []}  # configs/qwen3/tiny_qwen3_moe_cpu.yaml
    theirs = _sglang_fp8({"quantization_config": fp8.quantization_config(), "moe": moe}, tmp_path, "fp8-moe")["moe"]

    assert (
        "output_size of gate's and up's weight = 32 is not divisible by weight quantization block_n = 128"
        in (theirs[tiny]["error"])
    )
    for prefix, experts in ((full, range(4)), (ep_rank, (2, 3))):
        layer, ours = theirs[prefix], sent[prefix]
        assert layer["num_local_experts"] == len(experts)

        def pair(e, proj, ours=ours, prefix=prefix):
            name = f"{prefix}.{e}.{proj}.weight"
            return ours[name], ours[fp8.scale_name(name)]

        for local, e in enumerate(experts):
            for w, projs in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
                parts = [pair(e, p) for p in projs]
                q, s = layer[f"{w}_weight"][local], layer[f"{w}_weight_scale_inv"][local]
                assert torch.equal(q.view(torch.uint8), torch.cat([q for q, _ in parts]).view(torch.uint8)), (e, w)
                assert torch.equal(s, torch.cat([s for _, s in parts])), (e, w)
                mine = torch.cat([fp8.dequantize_block(q, s, torch.float32) for q, s in parts])
                assert torch.equal(layer[f"{w}_dequantized"][local], mine), (e, w)
