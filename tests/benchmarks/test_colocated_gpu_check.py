"""benchmarks/colocated_gpu_check.py (gpu_check.sh step 5) on CPU: its run configuration is one `train` accepts
(colocated, ipc, one rank and one server), and its checks fail on each thing they are there to catch. The run
itself needs a GPU for its memory check (its `--device cpu` dry run takes minutes: docs/placement.md)."""

import argparse
import json

import pytest

from benchmarks import colocated_gpu_check as gc

ARGS = argparse.Namespace(dtype="fp32", steps=3, response_length=32, verify_tolerance=1e-3)


@pytest.mark.slow  # writes a 20 M-parameter model (a few seconds)
def test_its_configuration_is_a_valid_one_gpu_colocated_ipc_run(tmp_path):
    from transformers import AutoTokenizer

    from megatron_dapo.config import load_config

    model, train = gc.prepare(tmp_path, "tiny", "fp32")
    cfg = load_config(str(gc.BASE_CONFIG), gc.overrides(tmp_path, model, train, ARGS))
    assert (cfg.trainer.placement, cfg.rollout.sync.transport, cfg.algo.staleness) == ("colocated", "ipc", 0)
    assert (cfg.parallel.tp, cfg.trainer.gpus_per_node, cfg.rollout.num_servers) == (1, 1, 1)
    assert json.loads((model / "config.json").read_text())["vocab_size"] == 151936
    # every row of the vocabulary decodes to text (a random model's responses are not empty); prompts still
    # encode character by character
    tok = AutoTokenizer.from_pretrained(model)
    assert len(tok) == 151936 and tok.decode([21, 300, 151935]) == "1<300><151935>"
    assert tok.encode("1+2=3") == [21, 15, 22, 33, 23]


@pytest.mark.slow
def test_the_gpu_shape_is_a_half_billion_qwen3_the_config_accepts(tmp_path):
    """The 0.5b shape's layout, checked from its config alone (its weights are 2 GB: written on the GPU machine)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.models.tiny import tiny_hf_config

    model, train = gc.prepare(tmp_path, "tiny", "fp32")
    c = tiny_hf_config("qwen3", **gc.SHAPES["0.5b"])
    c.save_pretrained(model)  # the shape, over the tiny one's config
    cfg = load_config(str(gc.BASE_CONFIG), gc.overrides(tmp_path, model, train, ARGS))
    assert cfg.trainer.placement == "colocated"
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = h * q * 2 + h * kv * 2 + 3 * h * i
    assert 0.45e9 < c.num_hidden_layers * layer + 2 * v * h < 0.6e9


def _write(tmp_path, rows, memory):
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "memory.jsonl").write_text("".join(json.dumps(m) + "\n" for m in memory))


def _memory(rollout_allocated=100, rollout_params=0):
    out = []
    for step in range(3):
        out.append({"step": step, "phase": "rollout", "params": rollout_params, "grads": 0, "optimizer": 0,
                    "allocated": rollout_allocated})  # fmt: skip
        out.append({"step": step, "phase": "trained", "params": 4, "grads": 4, "optimizer": 8, "allocated": 1000})
    return out


ROWS = [{"step": s, "sync/verify_max_abs_diff": 2e-6, "actor/grad_norm": 0.5} for s in range(3)]


def test_a_run_that_freed_its_memory_and_synced_exactly_passes(tmp_path):
    _write(tmp_path, ROWS, _memory())
    failures, summary = gc.check(tmp_path, "cuda", 3, 1e-3)
    assert failures == []
    assert summary["freed"] == {1: pytest.approx(0.9), 2: pytest.approx(0.9)}


@pytest.mark.parametrize(
    ("rows", "memory", "device", "caught"),
    [
        (ROWS, _memory(rollout_allocated=101), "cuda", "offload freed 89.9%"),
        (ROWS, _memory(rollout_allocated=101), "cpu", None),  # no allocator on CPU: the storages decide
        (ROWS, _memory(rollout_params=4), "cpu", "step 0 rollout: the engine's storages hold bytes"),
        ([*ROWS[:2], dict(ROWS[2], **{"sync/verify_max_abs_diff": 0.01})], _memory(), "cuda", "logprob check"),
        ([*ROWS[:2], {"step": 2, "actor/grad_norm": 0.5}], _memory(), "cuda", "logprob check"),  # no check ran
        ([dict(r, **{"actor/grad_norm": 0.0}) for r in ROWS], _memory(), "cuda", "no step moved the weights"),
        (ROWS[:2], _memory(), "cuda", "steps logged [0, 1]"),
        (ROWS, [dict(m, grads=0) if m["phase"] == "trained" else m for m in _memory()], "cpu", "holds no bytes"),
    ],
)
def test_each_check_fails_on_what_it_is_for(tmp_path, rows, memory, device, caught):
    _write(tmp_path, rows, memory)
    failures, _ = gc.check(tmp_path, device, 3, 1e-3)
    if caught is None:
        assert failures == []
    else:
        assert any(caught in f for f in failures), failures
