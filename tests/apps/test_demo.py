"""The demo's pieces: tokenizer + tiny model + task + a warm start that learns the answer format."""

import json

from megatron_dapo.apps.demo import prepare


def test_prepare_builds_a_consistent_model_tokenizer_and_task(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    paths = prepare(tmp_path, warm_steps=5, max_operand=5, num_test=8)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    cfg = AutoConfig.from_pretrained(paths["model"])
    assert cfg.vocab_size == len(tok) == 256 and cfg.eos_token_id == tok.eos_token_id
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    test = [json.loads(line) for line in paths["test"].read_text().splitlines()]
    assert len(train) + len(test) == 2 * 36 and len(test) == 8
    gen = json.loads((paths["model"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id  # servers stop at the end of the turn


def test_warm_start_lowers_the_loss(tmp_path):
    from transformers import AutoTokenizer

    from megatron_dapo.apps.warm_start import sft_examples, supervised_warm_start
    from megatron_dapo.data.arithmetic import response_of
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = build_char_tokenizer(tmp_path / "m")
    save_tiny_hf_model("qwen3", d)
    tok = AutoTokenizer.from_pretrained(d)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+1=?"}], "a": a} for a in range(10)]
    ex = sft_examples(tok, rows, lambda r: response_of(r["a"], "+", 1))
    prompt_len = ex[3][1]
    assert tok.decode(ex[3][0][prompt_len:]) == "Answer: 4<|im_end|>"
    losses = supervised_warm_start(d, ex, steps=30, batch_size=8, progress=False)
    assert losses[-1] < 0.3 * losses[0]
    assert (d / "model.safetensors").exists() and (d / "tokenizer.json").exists() and not (tmp_path / "m.tmp").exists()


def test_runs_share_a_prepared_dir(tmp_path, monkeypatch):
    """`--prepared-dir`: the model, data and warm start are made there once; each run trains on them and logs
    to its own run dir (the DAPO loop itself is replaced by a recorder of the config it would get)."""
    from types import SimpleNamespace

    import torch

    from megatron_dapo.apps import demo

    configs = []
    monkeypatch.setattr(demo, "run_with_ray", lambda cfg: configs.append(cfg) or SimpleNamespace(val={"all": []}))
    monkeypatch.setattr(demo, "plot_run", lambda run_dir: [run_dir / "plots" / "curves.png"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # demo.main sets 1 for its own process
    shared = tmp_path / "prepared"
    weights = shared / "model" / "model.safetensors"
    stamps = []
    for name in ("a", "b"):
        args = ["--run-dir", str(tmp_path / name), "--prepared-dir", str(shared), "--steps", "2", "--warm-steps", "2"]
        assert demo.main(args) == 0
        stamps.append(weights.stat().st_mtime_ns)
    assert stamps[0] == stamps[1]  # the second run reused the warm start
    for name, cfg in zip(("a", "b"), configs):
        assert cfg.model.hf_path == str(shared / "model")
        assert cfg.data.train_files == [str(shared / "data" / "train.jsonl")]
        assert cfg.logging.run_dir == str(tmp_path / name)
        assert not (tmp_path / name / "model").exists()
