"""DAPO fidelity of the config and the loss call: no key accepted and ignored, the KL refusal, the
recipe's dual clip, constant seq-mean-token-sum-norm divisor, clip_ratio shorthand,
loss_scale_factor, prompt truncation, and the step metrics users of the recipe expect."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import ConfigError, DapoConfig, config_from_dict, dump_yaml, load_config
from megatron_dapo.config.schema import OverlongBufferConfig
from megatron_dapo.config.validate import validate_config
from tests.http_stub import serve_app
from tests.workers.algo_reference import ref_policy_loss

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_dapo"
TINY = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"

# Modules that touch every field generically or only range-check them: a read there is not a use.
NOT_A_USE = {"config/schema.py", "config/validate.py"}
# Fields whose only accepted value is what the code does (staleness_buffer_groups: train_batch_size);
# validation must refuse any other value.
REFUSED_UNLESS_DEFAULT = {"algo.kl_coef": 0.1, "algo.staleness_buffer_groups": 3}


def _leaf_fields(cls, prefix="", section=""):
    """(dotted path, annotation, (name, class name) of the section holding it) of every leaf field; the
    class is the one declaring the field (a section may extend the coordinator's own class, e.g. SyncConfig)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaf_fields(tp, f"{prefix}{f.name}.", f.name)
        else:
            owner = next(c for c in cls.__mro__ if f.name in vars(c).get("__annotations__", {}))
            yield f"{prefix}{f.name}", tp, (section, owner.__name__)


def _module_names() -> dict[str, tuple[set[str], set[str]]]:
    """Per module: names it reads (`x.name` loads, string constants as in getattr(x, "name")) and
    every name it mentions (attributes, identifiers, annotations, strings)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in NOT_A_USE:
            continue
        reads, mentions = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                mentions.add(node.attr)
                if isinstance(node.ctx, ast.Load):
                    reads.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                reads.add(node.value)
                mentions.add(node.value)
            elif isinstance(node, ast.Name):
                mentions.add(node.id)
        out[rel] = (reads, mentions)
    return out


def test_every_config_field_is_read_somewhere():
    """Walks the whole schema: a key nothing in megatron_dapo/ reads would be accepted and ignored.
    A field counts as read where a module reads its name and also names its section (the section
    attribute, e.g. `overlong_buffer`, or its class, e.g. `OverlongBufferConfig`), so a common leaf
    name (`enable`, `n`, `seed`) read for one section does not vouch for another."""
    modules = _module_names()
    unread = []
    for path, tp, (section, section_cls) in _leaf_fields(DapoConfig):
        single_choice = typing.get_origin(tp) is typing.Literal and len(typing.get_args(tp)) == 1
        if path in REFUSED_UNLESS_DEFAULT or single_choice:
            continue
        leaf = path.rpartition(".")[2]
        if not any(
            leaf in reads and (section in mentions or section_cls in mentions) for reads, mentions in modules.values()
        ):
            unread.append(path)
    assert not unread, (
        f"config fields nothing in megatron_dapo/ reads (accepted and ignored): {unread}; "
        f"use them, refuse non-default values in validate.py, or remove them"
    )


@pytest.mark.parametrize("path,value", sorted(REFUSED_UNLESS_DEFAULT.items()))
def test_refused_fields_fail_validation(path, value):
    with pytest.raises(ConfigError, match=f"{path}={value}"):
        load_config(TINY, [f"{path}={value}"])


def test_kl_coef_refusal_says_dapo_removes_kl():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["algo.kl_coef=0.001"])
    msg = str(e.value)
    assert "\n" not in msg and "DAPO removes the KL" in msg and "2503.14476" in msg


def test_dual_clip_default_is_the_dapo_recipe():
    assert DapoConfig().algo.clip_ratio_c == 10.0
    assert load_config(TINY, ["algo.clip_ratio_c=null"]).algo.clip_ratio_c is None  # still switchable off


def test_clip_ratio_shorthand_sets_both_and_conflicts_fail():
    cfg = load_config(TINY, ["algo.clip_ratio=0.25"])
    assert (cfg.algo.clip_ratio_low, cfg.algo.clip_ratio_high) == (0.25, 0.25)
    # the same value given explicitly is no conflict, and the written config loads back unchanged
    cfg = config_from_dict({"algo": {"clip_ratio": 0.25, "clip_ratio_high": 0.25}})
    assert (cfg.algo.clip_ratio_low, cfg.algo.clip_ratio_high) == (0.25, 0.25)
    again = config_from_dict(__import__("yaml").safe_load(dump_yaml(load_config(TINY, ["algo.clip_ratio=0.25"]))))
    validate_config(again)
    assert (again.algo.clip_ratio_low, again.algo.clip_ratio_high) == (0.25, 0.25)
    for overrides in (
        ["algo.clip_ratio=0.25", "algo.clip_ratio_high=0.28"],
        ["algo.clip_ratio_low=0.1", "algo.clip_ratio=0.25"],
    ):
        with pytest.raises(ConfigError, match=r"algo.clip_ratio=0.25 conflicts with algo.clip_ratio_low"):
            load_config(TINY, overrides)
    with pytest.raises(ConfigError, match=r"algo.clip_ratio_low=1.5 must be in \[0, 1\)"):
        load_config(TINY, ["algo.clip_ratio=1.5"])


def test_loss_scale_factor_only_with_sum_norm_and_positive():
    with pytest.raises(
        ConfigError, match="algo.loss_scale_factor=64.0 only applies to algo.loss_agg_mode=seq-mean-token-sum-norm"
    ):
        load_config(TINY, ["algo.loss_scale_factor=64"])
    with pytest.raises(ConfigError, match="algo.loss_scale_factor=0.0 must be > 0"):
        load_config(TINY, ["algo.loss_agg_mode=seq-mean-token-sum-norm", "algo.loss_scale_factor=0"])


# ---------------------------------------------------------------- the actor's loss call
def _padded(rows: list[torch.Tensor], width: int, fill: float) -> torch.Tensor:
    out = torch.full((len(rows), width), fill)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@pytest.mark.parametrize("factor", [None, 50.0])
def test_sum_norm_loss_does_not_depend_on_padding_width(factor):
    """The actor's loss options make seq-mean-token-sum-norm divide by a constant (max_response_length,
    or loss_scale_factor), so the same rows padded to 40 or 64 give the same loss and gradient."""
    from megatron_dapo.kernels.backend import dapo_policy_loss
    from megatron_dapo.trainer.dapo_step import dapo_loss_options

    overrides = ["algo.loss_agg_mode=seq-mean-token-sum-norm"]
    if factor is not None:
        overrides.append(f"algo.loss_scale_factor={factor}")
    cfg = load_config(TINY, overrides)
    options = dapo_loss_options(cfg)
    assert options["token_sum_norm"] == (factor or cfg.data.max_response_length)
    g = torch.Generator().manual_seed(0)
    lengths = [7, 31, 18]
    lp = [-torch.rand(n, generator=g) * 2 for n in lengths]
    old = [x + torch.randn(x.shape, generator=g) * 0.3 for x in lp]
    adv = torch.tensor([0.7, -1.1, 0.4])
    results = []
    for width in (40, 64):
        x = _padded(lp, width, 0.0).requires_grad_()
        mask = _padded([torch.ones(n) for n in lengths], width, 0.0)
        loss, _ = dapo_policy_loss(
            x,
            _padded(old, width, 0.0),
            adv,
            mask,
            backend="torch",
            **{k: v for k, v in options.items() if k != "rollout_is_cap"},
        )
        loss.backward()
        results.append((loss.detach(), x.grad[:, :40]))
        expected = ref_policy_loss(
            x.detach(),
            _padded(old, width, 0.0),
            adv,
            mask,
            c=options["clip_ratio_c"],
            mode="seq-mean-token-sum-norm",
            norm=options["token_sum_norm"],
        )
        torch.testing.assert_close(loss.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(results[0][0], results[1][0], atol=0.0, rtol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], atol=0.0, rtol=1e-6)
    # what the actor did before: the padded width as divisor, 40 vs 64 -> 1.6x apart
    unnormed = [
        dapo_policy_loss(
            _padded(lp, w, 0.0),
            _padded(old, w, 0.0),
            adv,
            _padded([torch.ones(n) for n in lengths], w, 0.0),
            loss_agg_mode="seq-mean-token-sum-norm",
            backend="torch",
        )[0]
        for w in (40, 64)
    ]
    assert abs(float(unnormed[0] / unnormed[1]) - 1.6) < 1e-5


# ---------------------------------------------------------------- data.truncation
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_dapo.data.char_tokenizer import build_char_tokenizer

    return AutoTokenizer.from_pretrained(build_char_tokenizer(tmp_path_factory.mktemp("tok")))


def test_truncation_modes(tmp_path, tokenizer):
    from megatron_dapo.data.dataset import DatasetError, PromptDataset, encode_chat, write_rows

    def row(q, key="prompt"):
        return {key: [{"role": "user", "content": q}], "reward_model": {"ground_truth": "1"}}

    long_q = "0123456789" * 5
    path = write_rows(tmp_path / "d.jsonl", [row("1+1=?"), row(long_q)])
    full = encode_chat(tokenizer, [{"role": "user", "content": long_q}])
    limit = 40
    assert len(full) > limit
    kept = {}
    for mode in ("drop", "left", "right", "middle"):
        ds = PromptDataset(path, tokenizer, limit, truncation=mode)
        kept[mode] = ds
        assert ds.num_rows == 2 and all(len(r.prompt_ids) <= limit for r in ds.records)
    assert len(kept["drop"]) == 1 and kept["drop"].num_dropped_too_long == 1 and kept["drop"].num_truncated == 0
    for mode in ("left", "right", "middle"):
        assert len(kept[mode]) == 2 and kept[mode].num_truncated == 1 and kept[mode].num_dropped_too_long == 0
    assert list(kept["left"][1].prompt_ids) == full[-limit:]  # keeps the end (the assistant turn)
    assert list(kept["right"][1].prompt_ids) == full[:limit]
    assert list(kept["middle"][1].prompt_ids) == full[:20] + full[-20:]
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 1: prompt has \d+ tokens, more than max_prompt_length=40"):
        PromptDataset(path, tokenizer, limit, truncation="error")
    # data.prompt_key names the column; the config reaches the dataset through the loop's builder
    from megatron_dapo.coordinator.build import prompt_dataset

    other = write_rows(tmp_path / "q.jsonl", [row("2+2=?", key="question"), row(long_q, key="question")])
    cfg = load_config(TINY, ["data.prompt_key=question", "data.truncation=right", f"data.max_prompt_length={limit}"])
    ds = prompt_dataset(cfg, [str(other)], tokenizer)
    assert len(ds) == 2 and list(ds[1].prompt_ids) == full[:limit]
    with pytest.raises(DatasetError, match="field 'prompt' is missing"):
        PromptDataset(other, tokenizer)
    with pytest.raises(ConfigError, match="data.truncation: expected one of 'drop' | 'error'"):
        load_config(TINY, ["data.truncation=cut"])


# ---------------------------------------------------------------- step metrics
def test_step_metrics_overlong_advantages_prompt_lengths():
    from megatron_dapo.coordinator.batch import build_batch
    from megatron_dapo.coordinator.groups import judge_group
    from megatron_dapo.coordinator.metrics import batch_metrics, response_metrics
    from megatron_dapo.rewards import RewardResult
    from megatron_dapo.rollout.types import Sample

    max_len, buf = 10, 4  # penalty 0 up to 6 tokens, then -1/4 per token, -1 at 10
    groups = []
    for prompt_len, lengths, accs in ((3, [4, 8, 10], [1, 0, 0]), (5, [7, 2], [0, 1])):
        samples = [
            Sample(
                rid=f"r{n}",
                prompt_ids=list(range(prompt_len)),
                output_ids=[7] * n,
                logprobs=[-0.5] * n,
                finish_reason="length" if n == max_len else "stop",
                weight_version="0",
            )
            for n in lengths
        ]
        rewards = [RewardResult(score=1.0 if a else -1.0, acc=bool(a)) for a in accs]
        groups.append(judge_group(len(groups), samples, rewards, max_len, OverlongBufferConfig(True, buf, 1.0)))
    m = response_metrics(groups)
    penalties = [0.0, -0.5, -1.0, -0.25, 0.0]
    assert m["reward/overlong_frac"] == pytest.approx(3 / 5)
    assert m["reward/overlong_penalty_mean"] == pytest.approx(sum(penalties) / 5)

    batch = build_batch(groups, step=0, temperature=1.0)
    b = batch_metrics(batch)
    adv = batch.advantages.double()
    tokens = torch.tensor([4, 8, 10, 7, 2], dtype=torch.float64)
    mean = float((adv * tokens).sum() / tokens.sum())
    assert b["advantages/mean"] == pytest.approx(mean)
    assert b["advantages/std"] == pytest.approx(float(((adv - mean) ** 2 * tokens).sum() / tokens.sum()) ** 0.5)
    assert (b["advantages/max"], b["advantages/min"]) == pytest.approx((float(adv.max()), float(adv.min())))
    assert (b["prompt/length_mean"], b["prompt/length_max"], b["prompt/length_min"]) == (19 / 5, 5.0, 3.0)


# ---------------------------------------------------------------- rollout.concurrency
def test_router_caps_in_flight_requests_per_server():
    """rollout.concurrency reaches the router: a real HTTP server sees at most that many /generate at once."""
    from aiohttp import web

    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.rollout.types import SamplingParams

    async def run(cap):
        state = {"now": 0, "peak": 0}

        async def generate(request):
            body = await request.json()
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            await asyncio.sleep(0.05)
            state["now"] -= 1
            return web.json_response(
                {
                    "text": "",
                    "output_ids": [5],
                    "meta_info": {
                        "id": body.get("rid") or "r",
                        "finish_reason": {"type": "length", "length": 1},
                        "weight_version": "0",
                        "output_token_logprobs": [[-0.5, 5, None]],
                    },
                }
            )

        app = web.Application()
        app.router.add_post("/generate", generate)

        async def health(request):
            return web.Response(text="ok")

        app.router.add_get("/health", health)
        runner, url = await serve_app(app)
        try:
            async with Router([url], max_in_flight_per_server=cap) as router:
                sp = SamplingParams(n=1, max_new_tokens=1)
                await asyncio.wait_for(asyncio.gather(*(router.generate([1, 2], sp) for _ in range(8))), 30)
        finally:
            await runner.cleanup()
        return state["peak"]

    assert asyncio.run(run(3)) == 3
    assert asyncio.run(run(None)) == 8
