"""The embedded server's SGLang 0.5.23 request fields: every field accepted (or refused by name), and the
cheap sampling features checked numerically against an independent float64 computation from HF logits."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.rollout import protocol

SNAPSHOT = protocol.load_snapshot()
SENTINEL = 12345  # not a neutral value of any field


def test_every_sglang_field_is_implemented_ignored_or_neutral_only():
    gen = set(SNAPSHOT["classes"]["GenerateReqInput"]["fields"])
    assert set(S.GenerateIn.model_fields) | set(S.GENERATE_NEUTRAL) == gen
    assert not set(S.GenerateIn.model_fields) & set(S.GENERATE_NEUTRAL)
    sp = set(SNAPSHOT["SamplingParams"]["fields"])
    assert set(S.SamplingParamsIn.model_fields) | set(S.SAMPLING_NEUTRAL) == sp
    assert not set(S.SamplingParamsIn.model_fields) & set(S.SAMPLING_NEUTRAL)


@pytest.mark.parametrize("model, table", [(S.GenerateIn, S.GENERATE_NEUTRAL), (S.SamplingParamsIn, S.SAMPLING_NEUTRAL)])
def test_neutral_only_fields_accept_neutral_values_and_refuse_others_by_name(model, table):
    base = {"input_ids": [1, 2]} if model is S.GenerateIn else {}
    for name, neutrals in table.items():
        for value in neutrals + ([neutrals[0], neutrals[-1]],):  # a batch may send one per prompt
            model.model_validate({**base, name: value})
        with pytest.raises(ValidationError, match=f"{name}: not implemented by this server"):
            model.model_validate({**base, name: SENTINEL})
        with pytest.raises(ValidationError, match=name):
            model.model_validate({**base, name: [None, "x"]})


def test_sglang_ranges_and_routing_fields():
    for bad in (
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3},
        {"min_new_tokens": -1},
        {"min_new_tokens": 5, "max_new_tokens": 4},
        {"stop_regex": "("},
    ):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            S.SamplingParamsIn.model_validate(bad)
    S.SamplingParamsIn.model_validate({"custom_params": {"return_top_p_token_ids": True}, "stream_interval": 4})
    S.GenerateIn.model_validate({"input_ids": [1], "data_parallel_rank": 0, "routed_dp_rank": 0, "priority": -7})
    for field in ("data_parallel_rank", "routed_dp_rank"):
        with pytest.raises(ValidationError, match=field):
            S.GenerateIn.model_validate({"input_ids": [1], field: 1})


def test_weight_version_spans_as_sglang_computes_them():
    from megatron_dapo.embedded_server.engine import weight_version_spans

    assert weight_version_spans([], "3", 0) == [{"version": "3", "start": 0, "end": 0}]
    assert weight_version_spans([], "3", 4) == [{"version": "3", "start": 0, "end": 4}]
    assert weight_version_spans([("1", 2), ("2", 5)], "3", 7) == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": 5},
        {"version": "3", "start": 5, "end": 7},
    ]
    # an update that changed nothing between two others, and one at the very end, leave no empty span
    assert weight_version_spans([("1", 2), ("2", 2), ("2", 6)], "3", 6) == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": 6},
    ]


# ---- numerics against HF logits ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("q3"))
    build_char_tokenizer(d)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(d)


def _next_logits64(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def _penalised64(logits, out, freq, pres, rep, min_new, stop_ids):
    """SGLang's penalties written out token by token, in float64 (reference for the engine)."""
    logits = logits.clone()
    for tok in set(out):
        c = out.count(tok)
        logits[tok] -= freq * c + pres
    if len(out) < min_new:
        for t in stop_ids:
            logits[t] = float("-inf")
    for tok in set(out):
        logits[tok] = logits[tok] * rep if logits[tok] < 0 else logits[tok] / rep
    return logits


def _run(model, tokenizer=None, **kw):
    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    eng = Engine(model, tokenizer, seed=0)
    try:
        futs = [eng.submit(GenRequest(rid=f"r{i}", **one)) for i, one in enumerate(kw.pop("reqs", [kw]))]
        return [f.result(120) for f in futs]
    finally:
        eng.close()


def test_penalties_min_new_tokens_and_top_logprobs_match_hf_float64(tiny):
    model, _ = tiny
    prompt, n = [5, 9, 11, 200, 7], 12
    (plain,) = _run(model, prompt=prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True)
    first = plain["output_ids"][0]
    cfg = dict(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.7, min_new_tokens=4)
    (a,) = _run(
        model,
        prompt=prompt,
        max_new_tokens=n,
        temperature=0.0,
        stop_token_ids=frozenset({first}),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        **cfg,
    )
    out, meta = a["output_ids"], a["meta_info"]
    assert out != plain["output_ids"][: len(out)], "penalties must change a greedy continuation"
    assert first not in out[:4] and len(out) >= 4
    eos = model.config.eos_token_id
    stop_ids = {first} | ({eos} if isinstance(eos, int) else set(eos or ()))
    for i, tok in enumerate(out):
        ref = _penalised64(_next_logits64(model, prompt + out[:i])[-1], out[:i], 0.6, 0.4, 1.7, 4, stop_ids)
        lp = torch.log_softmax(ref, -1)
        assert tok == int(ref.argmax()), i
        assert list(meta["output_token_logprobs"][i][:2]) == [pytest.approx(float(lp[tok]), abs=2e-4), tok]
        vals, ids = lp.topk(3)
        top = meta["output_top_logprobs"][i]
        assert [t[1] for t in top] == ids.tolist()
        assert [t[0] for t in top] == pytest.approx(vals.tolist(), abs=2e-4)
    # input side: position 0 has no prediction; the rest are the unpenalised prompt distributions
    in_lp = torch.log_softmax(_next_logits64(model, prompt), -1)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(prompt)
    for t in range(1, len(prompt)):
        vals, ids = in_lp[t - 1].topk(3)
        assert [x[1] for x in meta["input_top_logprobs"][t]] == ids.tolist()
        assert [x[0] for x in meta["input_top_logprobs"][t]] == pytest.approx(vals.tolist(), abs=2e-4)


def test_min_p_keeps_only_tokens_above_its_threshold(tiny):
    model, _ = tiny
    prompt, temp, min_p = [3, 1, 4, 1, 5], 0.8, 0.25

    def reqs(mp):
        return [
            dict(
                prompt=prompt,
                max_new_tokens=6,
                temperature=temp,
                ignore_eos=True,
                min_p=mp,
                sampling_seed=s,
                return_logprob=True,
            )
            for s in range(12)
        ]

    def violations(answers, check_logprobs):
        bad = 0
        for a in answers:
            out = a["output_ids"]
            logits = _next_logits64(model, prompt + out)[len(prompt) - 1 : -1]
            probs = torch.softmax(logits / temp, -1)
            for i, tok in enumerate(out):
                bad += bool(probs[i, tok] < min_p * probs[i].max())
                if check_logprobs:  # reported logprobs are before filtering, as SGLang's
                    assert a["meta_info"]["output_token_logprobs"][i][0] == pytest.approx(
                        float(probs[i, tok].log()), abs=2e-4
                    )
        return bad

    assert violations(_run(model, reqs=reqs(min_p)), True) == 0
    assert violations(_run(model, reqs=reqs(0.0)), False) > 0, "the same seeds without min_p must cross the line"


def test_stop_regex_and_logprob_texts(tiny):
    model, tok = tiny
    prompt = tok.encode("ab")
    (a,) = _run(
        model,
        tok,
        prompt=prompt,
        max_new_tokens=40,
        temperature=0.0,
        ignore_eos=True,
        stop_regex=(r"reserved_\d+\|>",),
        return_logprob=True,
        return_text_in_logprobs=True,
        top_logprobs_num=1,
        skip_special_tokens=False,
    )
    out = a["output_ids"]
    assert a["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"reserved_\d+\|>"}
    assert "reserved_" in tok.decode(out) and "reserved_" not in tok.decode(out[:-1])
    assert [t[2] for t in a["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in out]
    best = a["meta_info"]["output_top_logprobs"][0][0]
    assert best[2] == tok.decode([best[1]])
    assert a["text"] == tok.decode(out)
    (b,) = _run(model, tok, prompt=prompt, max_new_tokens=len(out), temperature=0.0, ignore_eos=True)
    assert b["output_ids"] == out and b["text"] == tok.decode(out, skip_special_tokens=True) != a["text"]


def test_text_batches_and_text_with_input_ids(tiny):
    from megatron_dapo.embedded_server.server import EmbeddedServer

    model, tok = tiny
    srv = EmbeddedServer(model, tok)
    try:
        reqs = srv._make_requests(S.GenerateIn(text=["ab", "c"], sampling_params={"repetition_penalty": 1.5}))
        assert [r.prompt for r in reqs] == [tok.encode("ab"), tok.encode("c")]
        assert [r.repetition_penalty for r in reqs] == [1.5, 1.5]
        assert "send one of them" in srv._make_requests(S.GenerateIn(text="ab", input_ids=[1]))
    finally:
        srv.engine.close()
