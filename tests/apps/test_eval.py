"""Held-out evaluation: mean@n / best@n / maj@n / greedy per data source, trainer.val settings, and
`megatron-dapo eval` on a real TP=2 training checkpoint served by an embedded server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, DapoConfig, load_config
from megatron_dapo.coordinator.val_metrics import PromptOutcome, best_at_n, maj_at_n, mean_at_n, validation_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


# ------------------------------------------------------------------------------------------ metrics


def test_metrics_per_data_source_match_hand_computed_values():
    T, F = True, False
    outcomes = [
        # source a: answers 5,3,3,5 -> tie between 5 and 3, the first drawn (5, correct) wins
        PromptOutcome("a", (T, F, F, T), ("5", "3", "3", "5")),
        # a response without an extracted answer (None) votes too; "2" has the majority and is wrong
        PromptOutcome("a", (F, F, F, F), ("1", "2", "2", None)),
        PromptOutcome("b", (F, T, T, T), ("4", "8", "8", "8"), greedy_acc=True),
        PromptOutcome("b", (T, F, F, F), ("6", "2", "2", None), greedy_acc=False),
    ]
    m = validation_metrics(outcomes)
    assert m == {
        "val/a/acc/mean@4": (2 / 4 + 0) / 2,
        "val/a/acc/best@4": (1 + 0) / 2,
        "val/a/acc/maj@4": (1 + 0) / 2,
        "val/b/acc/mean@4": (3 / 4 + 1 / 4) / 2,
        "val/b/acc/best@4": 1.0,
        "val/b/acc/maj@4": (1 + 0) / 2,
        "val/b/acc/greedy": 0.5,
    }


def test_metric_functions_edge_cases():
    assert mean_at_n([True]) == best_at_n([True]) == maj_at_n(["7"], [True]) == 1.0
    assert maj_at_n(["3", "5", "5", "3"], [False, True, True, False]) == 0.0  # tie: first drawn ("3") wins
    assert maj_at_n([None, None, "9"], [False, False, True]) == 0.0  # "no answer" is the majority
    assert best_at_n([False] * 32) == 0.0 and mean_at_n([True] * 8 + [False] * 24) == 0.25
    with pytest.raises(ValueError, match="one answer per judgement"):
        maj_at_n(["1"], [True, False])


def test_maj_needs_extracted_answers_and_sources_need_one_sample_count():
    # a reward function that returns no "pred": mean / best only
    m = validation_metrics([PromptOutcome("s", (True, False), (None, None))])
    assert m == {"val/s/acc/mean@2": 0.5, "val/s/acc/best@2": 1.0}
    # greedy only (n = 0)
    assert validation_metrics([PromptOutcome("s", (), (), greedy_acc=True)]) == {"val/s/acc/greedy": 1.0}
    with pytest.raises(ValueError, match="different sample counts"):
        validation_metrics([PromptOutcome("s", (True,), ("1",)), PromptOutcome("s", (True, True), ("1", "1"))])


def test_reward_runner_keeps_the_extracted_answer():
    from megatron_dapo.rewards import RewardRunner

    runner = RewardRunner("dapo_math")
    ok, bad, none = runner.score_many(
        [
            ("so\nAnswer: 1,000", "1000", "math_dapo", {}),
            ("Answer: 12", "13", "math_dapo", {}),
            ("no idea", "3", "math_dapo", {}),
        ]
    )
    assert (ok.acc, ok.pred) == (True, "1000") and (bad.acc, bad.pred) == (False, "12")
    assert (none.acc, none.pred) == (False, "[INVALID]")


# ------------------------------------------------------------------------------------------ config


def test_val_defaults_are_the_dapo_papers_and_settings_follow_the_config():
    from megatron_dapo.coordinator.evaluate import ValSettings, val_seed

    v = DapoConfig().trainer.val
    assert (v.n, v.temperature, v.top_p, v.max_new_tokens, v.greedy) == (32, 1.0, 0.7, None, False)
    for name in ("qwen3_8b.yaml", "qwen3_30b_a3b.yaml"):
        v = load_config(ROOT / "configs" / "qwen3" / name).trainer.val
        assert (v.n, v.temperature, v.top_p) == (32, 1.0, 0.7)
    cfg = load_config(TINY, ["trainer.val.n=3", "trainer.val.top_p=0.9", "rollout.sampling.stop_token_ids=[7]"])
    s = ValSettings.from_config(cfg)
    assert (s.n, s.greedy, s.seed) == (3, cfg.trainer.val.greedy, cfg.trainer.seed)
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.stop_token_ids) == (1.0, 0.9, [7])
    assert s.sampling.max_new_tokens == cfg.data.max_response_length  # max_new_tokens null
    assert ValSettings.from_config(load_config(TINY, ["rollout.sampling.seeded=false"])).seed is None
    # validation streams never coincide with a training draw's (draws are numbered from 0)
    from megatron_dapo.coordinator.producer import sample_seed

    assert val_seed(42, 0, 1) != sample_seed(42, 0, 1) and val_seed(42, 0, 1) == val_seed(42, 0, 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.val.n=-1", "trainer.val.n=-1 must be >= 0"),
        ("trainer.val.temperature=0", "trainer.val.temperature=0.0 must be > 0"),
        ("trainer.val.top_p=1.5", "trainer.val.top_p=1.5 must be in (0, 1]"),
        ("trainer.val.max_new_tokens=0", "trainer.val.max_new_tokens=0 must be >= 1"),
        ("trainer.val.nn=3", "trainer.val.nn"),
    ],
)
def test_bad_val_settings_fail_with_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_val_needs_samples_or_greedy():
    with pytest.raises(ConfigError, match="evaluates nothing"):
        load_config(TINY, ["trainer.val.n=0", "trainer.val.greedy=false"])
    assert load_config(TINY, ["trainer.val.n=0", "trainer.val.greedy=true"]).trainer.val.n == 0


# ------------------------------------------------------------------------------------------ checkpoints


def test_resolve_checkpoint_kinds(tmp_path):
    from megatron_dapo.apps.eval import EvalError, resolve_checkpoint
    from megatron_dapo.trainer import checkpoint as ckpt

    save_dir = tmp_path / "checkpoints"
    for step in (5, 10):
        tmp = ckpt.begin_save(save_dir, step)
        ckpt.write_trainer_state(tmp, {"step": step, "version": step + 1, "world_size": 2})
        ckpt.commit_save(save_dir, step)
    latest = resolve_checkpoint(save_dir)
    assert (latest.kind, latest.step, latest.path, latest.label) == (
        "training",
        10,
        save_dir / "step_000010" / "model",
        "step_000010",
    )
    assert resolve_checkpoint(save_dir / "step_000005").step == 5
    mcore = tmp_path / "mcore"
    mcore.mkdir()
    (mcore / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert resolve_checkpoint(mcore).kind == "megatron"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert (resolve_checkpoint(hf).kind, resolve_checkpoint(hf).path) == ("hf", hf)
    with pytest.raises(EvalError, match="neither a training checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(EvalError, match="is not a directory"):
        resolve_checkpoint(tmp_path / "missing")


def test_eval_cli_refuses_what_it_cannot_evaluate_in_one_line(tmp_path, capsys):
    from megatron_dapo.apps.eval import main

    assert main([str(TINY), "--checkpoint", str(tmp_path), f"logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-dapo eval: error: --checkpoint") and "neither a training checkpoint" in err
    assert main([str(TINY), "--checkpoint", str(tmp_path), "data.val_files=[]"]) == 2
    assert capsys.readouterr().err.strip() == "megatron-dapo eval: error: data.val_files is empty: nothing to evaluate"
    assert main([str(TINY), "--checkpoint", str(tmp_path), "trainer.val.top_p=0"]) == 2
    assert "trainer.val.top_p=0.0 must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ end to end


def _tiny_model(path: Path, seed: int) -> Path:
    from transformers import AutoTokenizer

    from megatron_dapo.data.char_tokenizer import build_char_tokenizer, vocab_size
    from megatron_dapo.models.tiny import save_tiny_hf_model

    build_char_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    save_tiny_hf_model(
        "qwen3",
        path,
        seed=seed,
        vocab_size=vocab_size(),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return path


def _hf_greedy(model_dir: Path, prompts: list[list[dict]], max_new_tokens: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.data.dataset import encode_chat

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for messages in prompts:
        ids = torch.tensor([encode_chat(tok, messages)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1] :].tolist(), skip_special_tokens=True))
    return out


@pytest.mark.slow
def test_eval_cli_on_a_tp2_training_checkpoint(tmp_path, capsys):
    """A TP=2 training checkpoint of model B, evaluated with model.hf_path = model A (other weights):
    greedy answers must be B's (HF generate as reference), source s1's ground truths are B's greedy
    answer classes (greedy = 1 exactly), s2's can never match (all 0), and mean@4 / best@4 / maj@4 equal
    those computed here from the judged answers the command saved."""
    from megatron_dapo.apps.eval import main
    from tests.dist_utils import run_torchrun
    from tests.eval_reward import first_char_class

    model_a, model_b = _tiny_model(tmp_path / "A", seed=1), _tiny_model(tmp_path / "B", seed=2)
    run_torchrun("eval_checkpoint.py", 2, model_b, tmp_path / "ckpts", 7, timeout=300)

    prompts = [[{"role": "user", "content": f"{i}+{3 * i}=?"}] for i in range(6)]
    greedy_b = _hf_greedy(model_b, prompts, max_new_tokens=4)
    rows = [
        {"prompt": p, "reward_model": {"ground_truth": first_char_class(g, "")["pred"]}, "data_source": "s1"}
        for p, g in zip(prompts, greedy_b)
    ]
    rows += [
        {
            "prompt": [{"role": "user", "content": f"{i}-{i}=?"}],
            "reward_model": {"ground_truth": "never"},
            "data_source": "s2",
        }
        for i in range(3)
    ]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))

    run_dir, samples = tmp_path / "run", tmp_path / "samples.jsonl"
    rc = main(
        [
            str(TINY),
            "--checkpoint",
            str(tmp_path / "ckpts"),
            "--samples",
            str(samples),
            f"model.hf_path={model_a}",
            f"data.val_files=[{val}]",
            f"logging.run_dir={run_dir}",
            "reward.name=tests.eval_reward:first_char_class",
            "rollout.num_servers=1",
            "trainer.val.n=4",
            "trainer.val.greedy=true",
            "trainer.val.max_new_tokens=4",
            "rollout.embedded_batching=continuous",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((run_dir / "eval" / "step_000007.json").read_text())
    assert (result["kind"], result["step"], result["prompts"]) == ("training", 7, {"s1": 6, "s2": 3})
    assert (result["settings"]["n"], result["settings"]["top_p"], result["settings"]["max_new_tokens"]) == (4, 0.7, 4)
    m = result["metrics"]
    assert m["val/s1/acc/greedy"] == 1.0
    assert all(m[f"val/s2/acc/{k}"] == 0.0 for k in ("mean@4", "best@4", "maj@4", "greedy"))
    assert "maj@4" in out and "s1" in out
    assert not list((run_dir / "eval").glob(".work-*"))  # the converted weights are gone
    assert "(continuous batching)" in (run_dir / "eval" / "logs" / "server_0.log").read_text()

    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == 9 * 5
    per_prompt: dict[int, list[dict]] = {}
    for r in records:
        judged = first_char_class(r["response"], r["ground_truth"])
        assert (r["pred"], r["acc"]) == (judged["pred"], judged["acc"])
        assert len(r["response"]) <= 4
        per_prompt.setdefault(r["prompt_index"], []).append(r)
    for i, g in enumerate(greedy_b):
        assert [r["response"] for r in per_prompt[i] if r["kind"] == "greedy"] == [g]

    mean, best, maj = [], [], []
    for i in range(6):
        sampled = [r for r in per_prompt[i] if r["kind"] == "sampled"]
        assert len(sampled) == 4
        accs, preds = [r["acc"] for r in sampled], [r["pred"] for r in sampled]
        mean.append(sum(accs) / 4)
        best.append(float(any(accs)))
        counts = {p: preds.count(p) for p in preds}
        top = max(counts.values())
        maj.append(float(accs[next(j for j, p in enumerate(preds) if counts[p] == top)]))
    assert m["val/s1/acc/mean@4"] == pytest.approx(sum(mean) / 6, abs=1e-12)
    assert m["val/s1/acc/best@4"] == pytest.approx(sum(best) / 6, abs=1e-12)
    assert m["val/s1/acc/maj@4"] == pytest.approx(sum(maj) / 6, abs=1e-12)


def test_demo_prints_each_validation_step_per_data_source():
    from megatron_dapo.apps.demo import held_out_table

    val = load_config(TINY).trainer.val
    points = [
        (0, {"val/math_dapo/acc/mean@4": 0.1, "val/math_dapo/acc/maj@4": 0.05, "val/math_dapo/acc/greedy": 0.0}),
        (10, {"val/math_dapo/acc/mean@4": 0.25, "val/math_dapo/acc/maj@4": 0.5, "val/math_dapo/acc/greedy": 0.3}),
    ]
    lines = held_out_table(points, val).splitlines()
    assert lines[0] == "held-out accuracy: 4 samples per problem at temperature 1.0, top_p 0.7"
    assert lines[1].split() == ["[math_dapo]", "step", "mean@4", "maj@4", "greedy"]
    assert lines[2].split() == ["0", "0.100", "0.050", "0.000"]
    assert lines[3].split() == ["10", "0.250", "0.500", "0.300"]
