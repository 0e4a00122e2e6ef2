"""Prompt datasets: schema validation, chat template, length filter, resumable shuffling."""

import json

import pytest

from megatron_dapo.data.arithmetic import ArithmeticTask, answer_of, write_task
from megatron_dapo.data.char_tokenizer import build_char_tokenizer
from megatron_dapo.data.dataset import DatasetError, PromptDataset, PromptSampler, read_rows, write_rows


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_char_tokenizer(tmp_path_factory.mktemp("tok")))


def _row(q="1+1=?", gt="2", **kw):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": q}],
        "reward_model": {"ground_truth": gt},
        **kw,
    }


def test_char_tokenizer_round_trip_and_chat_template(tokenizer):
    text = "Answer: -12\nok"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) == len(text)  # one token per character
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2=?"}], add_generation_prompt=True, tokenize=False
    )
    assert ids == "<|im_start|>user\n2+2=?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"
    from megatron_dapo.models.tiny import tiny_hf_config

    assert len(tokenizer) == tiny_hf_config("qwen3").vocab_size == 256  # model rows == tokenizer size


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_dataset_reads_both_formats_and_renders_chat(tmp_path, tokenizer, suffix):
    # jsonl may carry a numeric ground truth; a parquet column has one type
    path = write_rows(tmp_path / f"d{suffix}", [_row("3+4=?", "7"), _row("9-2=?", 7 if suffix == ".jsonl" else "7")])
    ds = PromptDataset(path, tokenizer)
    assert len(ds) == 2 and ds.num_dropped_too_long == 0
    assert ds[1].ground_truth == "7" and ds[0].data_source == "math_dapo"
    assert tokenizer.decode(list(ds[0].prompt_ids)) == "<|im_start|>user\n3+4=?<|im_end|>\n<|im_start|>assistant\n"


def test_length_filter_counts_dropped(tmp_path, tokenizer):
    rows = [_row("1+1=?"), _row("1+1=? " + "x" * 50), _row("2+2=?", "4")]
    ds = PromptDataset(write_rows(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_length=40)
    assert len(ds) == 2 and ds.num_dropped_too_long == 1 and ds.num_rows == 3
    assert [r.ground_truth for r in ds.records] == ["2", "4"]
    with pytest.raises(DatasetError, match="all 3 rows were dropped"):
        PromptDataset(tmp_path / "d.jsonl", tokenizer, max_prompt_length=5)


def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer):
    path = write_rows(tmp_path / "bad.jsonl", [_row(), {"reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DatasetError, match=r"bad\.jsonl: row 1: field 'prompt'"):
        PromptDataset(path, tokenizer)
    path = write_rows(tmp_path / "bad2.jsonl", [_row(), _row(), {"prompt": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DatasetError, match=r"bad2\.jsonl: row 2: field 'reward_model.ground_truth'"):
        PromptDataset(path, tokenizer)
    (tmp_path / "broken.jsonl").write_text(json.dumps(_row()) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"broken\.jsonl: row 1 \(line 2\) is not valid JSON"):
        read_rows(tmp_path / "broken.jsonl")


def test_undecodable_files_are_named_errors(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(
        json.dumps(_row()).encode() + b"\n" + '{"x": "café"}'.encode("latin-1") + b"\n"
    )
    with pytest.raises(DatasetError, match=r"latin1\.jsonl: row 1 \(line 2\) is not UTF-8 text \(byte 10 of the line"):
        read_rows(tmp_path / "latin1.jsonl")
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DatasetError, match=r"deep\.jsonl: row 0 \(line 1\) is not valid JSON"):
        read_rows(tmp_path / "deep.jsonl")
    good = write_rows(tmp_path / "ok.parquet", [_row(), _row()])
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DatasetError, match=r"cut\.parquet: not a readable parquet file \(") as e:
        read_rows(tmp_path / "cut.parquet")
    assert "\n" not in str(e.value)


def test_empty_and_missing_dataset(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="empty"):
        PromptDataset(tmp_path / "empty.jsonl", tokenizer)
    with pytest.raises(DatasetError, match="does not exist"):
        PromptDataset(tmp_path / "nope.parquet", tokenizer)


def test_sampler_is_deterministic_covers_epochs_and_resumes():
    a = PromptSampler(7, seed=3)
    first = a.take(7)
    assert sorted(first) == list(range(7))  # an epoch is a permutation
    assert first != list(range(7))
    assert PromptSampler(7, seed=3).take(7) == first
    assert PromptSampler(7, seed=4).take(7) != first
    full = PromptSampler(7, seed=3).take(20)
    b = PromptSampler(7, seed=3)
    head = b.take(9)
    state = json.loads(json.dumps(b.state_dict()))  # survives a JSON round trip (checkpoints)
    c = PromptSampler(7, seed=3)
    c.load_state_dict(state)
    assert head + c.take(11) == full
    with pytest.raises(DatasetError, match="dataset of 7 prompts"):
        PromptSampler(8, seed=3).load_state_dict(state)


def test_arithmetic_task_split_is_disjoint_and_correct(tmp_path, tokenizer):
    task = ArithmeticTask(max_operand=9, ops="+-", seed=1)
    train, test = write_task(tmp_path, task, num_test=20)
    tr, te = read_rows(train), read_rows(test)
    assert len(tr) == 180 and len(te) == 20
    key = lambda r: r["prompt"][0]["content"]
    assert not {key(r) for r in tr} & {key(r) for r in te}
    for r in tr + te:
        e = r["extra_info"]
        assert int(r["reward_model"]["ground_truth"]) == answer_of(e["a"], e["op"], e["b"])
        assert eval(f"{e['a']}{e['op']}{e['b']}") == answer_of(e["a"], e["op"], e["b"])
    assert len(PromptDataset(test, tokenizer)) == 20
