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
