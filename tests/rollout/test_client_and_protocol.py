"""Fast tests of the rollout side: SGLang protocol conformance, sampling semantics, the embedded engine
(in-process, tiny models), the HF weight loader, buckets, and the launcher's command lines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout import payloads, protocol
from megatron_dapo.rollout.types import SamplingParams

SNAPSHOT = protocol.load_snapshot()


@pytest.mark.slow  # pip-installs SGLang 0.5.23 into the peer's cache on first use, as the peer tests do
def test_snapshot_matches_sglang_source():
    from tests.sglang_peer import ensure_installed

    fresh = protocol.extract_sglang_fields(ensure_installed())  # fails, never skips, without PyPI
    assert fresh["classes"] == SNAPSHOT["classes"]
    assert fresh["SamplingParams"] == SNAPSHOT["SamplingParams"]
    assert fresh["server_args"] == SNAPSHOT["server_args"]


def test_snapshot_has_the_fields_the_issue_names():
    # Independent of the extractor's own logic: the field names SGLang 0.5.23 documents for these routes.
    c = SNAPSHOT["classes"]
    assert {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"} <= set(
        c["InitWeightsUpdateGroupReqInput"]["fields"]
    )
    assert {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
    } <= set(c["UpdateWeightsFromDistributedReqInput"]["fields"])
    assert set(c["UpdateWeightsFromDistributedReqInput"]["required"]) == {"names", "dtypes", "shapes"}
    assert {"input_ids", "sampling_params", "return_logprob", "rid"} <= set(c["GenerateReqInput"]["fields"])
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "n"} <= set(
        SNAPSHOT["SamplingParams"]["fields"]
    )


def _all_client_bodies() -> dict[str, list[dict]]:
    sp = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        max_new_tokens=8,
        stop=["x"],
        stop_token_ids=[3],
        n=4,
        sampling_seed=2**63 - 1,
    )
    return {
        "/generate": [
            payloads.generate_body([1, 2], sp, rid="r"),
            payloads.generate_body([1, 2], SamplingParams(max_new_tokens=0), rid="p", logprob_start_len=0),
            payloads.generate_body([1, 2], [sp, sp], rid="b", routed_experts_start_len=1),
        ],
        "/abort_request": [payloads.abort_body("r"), payloads.abort_body(abort_all=True)],
        "/pause_generation": [payloads.pause_body(m) for m in ("abort", "retract", "in_place")],
        "/continue_generation": [payloads.continue_body()],
        "/release_memory_occupation": [payloads.memory_body(), payloads.memory_body(["weights"])],
        "/resume_memory_occupation": [payloads.memory_body(["kv_cache"])],
        "/init_weights_update_group": [payloads.init_group_body("127.0.0.1", 1234, 1, 3, "g", "gloo")],
        "/destroy_weights_update_group": [payloads.destroy_group_body("g")],
        "/begin_weight_update": [payloads.begin_update_body(), payloads.begin_update_body("target")],
        "/end_weight_update": [payloads.end_update_body()],
        "/update_weights_from_distributed": [
            payloads.update_distributed_body(["a"], ["float32"], [[2, 3]], "g", True, False, "7", "flattened_bucket"),
            payloads.update_distributed_body(["a"], ["bfloat16"], [[2]]),
        ],
        "/update_weights_from_tensor": [payloads.update_tensor_body([b"abc"], weight_version="3")],
        "/update_weight_version": [payloads.update_version_body("9")],
    }


def test_every_client_body_has_exactly_sglang_fields():
    bodies = _all_client_bodies()
    assert set(bodies) == set(protocol.ROUTE_CLASSES)
    for route, items in bodies.items():
        for body in items:
            assert protocol.check_request(SNAPSHOT, route, body) == [], (route, body)


def test_conformance_checker_catches_wrong_bodies():
    assert protocol.check_request(SNAPSHOT, "/init_weights_update_group", {"master_address": "h"})  # missing
    assert protocol.check_request(SNAPSHOT, "/generate", {"input_ids": [1], "prompt_ids": [1]})  # unknown field
    bad_sp = {"input_ids": [1], "sampling_params": {"temperature": 1.0, "max_tokens": 3}}
    assert any("max_tokens" in p for p in protocol.check_request(SNAPSHOT, "/generate", bad_sp))


def test_embedded_server_accepts_only_sglang_field_names():
    from megatron_dapo.embedded_server import schemas as S

    pairs = {
        S.GenerateIn: "GenerateReqInput",
        S.AbortIn: "AbortReq",
        S.PauseIn: "PauseGenerationReqInput",
        S.ContinueIn: "ContinueGenerationReqInput",
        S.MemoryIn: "ReleaseMemoryOccupationReqInput",
        S.InitGroupIn: "InitWeightsUpdateGroupReqInput",
        S.DestroyGroupIn: "DestroyWeightsUpdateGroupReqInput",
        S.UpdateDistributedIn: "UpdateWeightsFromDistributedReqInput",
        S.UpdateTensorIn: "UpdateWeightsFromTensorReqInput",
        S.UpdateVersionIn: "UpdateWeightVersionReqInput",
        S.BeginUpdateIn: "BeginWeightUpdateReqInput",
        S.EndUpdateIn: "EndWeightUpdateReqInput",
    }
    for model, cls in pairs.items():
        assert set(model.model_fields) <= set(SNAPSHOT["classes"][cls]["fields"]), cls
    assert set(S.SamplingParamsIn.model_fields) <= set(SNAPSHOT["SamplingParams"]["fields"])


def test_parse_generate_answer_shapes():
    item = {
        "text": "",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "stop", "matched": 6},
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]],
            "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}],
        },
    }
    (s,) = payloads.parse_generate(item, [1])
    assert (s.output_ids, s.logprobs, s.finish_reason, s.matched_stop) == ([5, 6], [-0.5, -1.5], "stop", 6)
    assert s.versions == ["2", "3"] and s.num_retractions == 0  # not sent: none
    retracted = json.loads(json.dumps(item))
    retracted["meta_info"]["num_retractions"] = 2
    assert payloads.parse_generate(retracted, [1])[0].num_retractions == 2
    two = payloads.parse_generate([item, item], [1])
    assert [x.index for x in two] == [0, 1]
    bad = json.loads(json.dumps(item))
    bad["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(ValueError, match="logprob token"):
        payloads.parse_generate(bad, [1])
    bad["meta_info"]["finish_reason"] = {"type": "eos"}
    with pytest.raises(ValueError, match="finish_reason"):
        payloads.parse_generate(bad, [1])


# ---- sampling -----------------------------------------------------------------------------------


def test_sampled_logprob_is_temperature_scaled_before_filtering():
    from megatron_dapo.embedded_server.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(6, 50, dtype=torch.float32) * 3
    temp = torch.tensor([0.0, 0.5, 1.0, 1.3, 0.7, 2.0])
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.5, 1.0, 0.9])
    top_k = torch.tensor([-1, -1, 5, -1, 1, 10])
    g = torch.Generator().manual_seed(1)
    tokens, lps = sample(logits, temp, top_p, top_k, g)
    ref_t = torch.where(temp < 1e-6, torch.ones_like(temp), temp).double().unsqueeze(-1)
    ref = torch.log_softmax(logits.double() / ref_t, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lps.double(), ref, atol=1e-5, rtol=0)
    assert tokens[0] == logits[0].argmax() and tokens[4] == logits[4].argmax()  # greedy and top_k=1


def test_top_k_top_p_keep_exactly_the_nucleus():
    from megatron_dapo.embedded_server.sampling import filter_top_k_top_p

    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    keep = lambda k, p: (filter_top_k_top_p(probs, torch.tensor([k]), torch.tensor([p])) > 0)[0].tolist()
    assert keep(-1, 1.0) == [True] * 5
    assert keep(2, 1.0) == [True, True, False, False, False]
    assert keep(-1, 0.7) == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert keep(-1, 0.71) == [True, True, True, False, False]
    assert keep(-1, 0.01) == [True, False, False, False, False]
    g = torch.Generator().manual_seed(0)
    from megatron_dapo.embedded_server.sampling import sample

    logits = probs.log().repeat(400, 1)
    tok, _ = sample(logits, torch.ones(400), torch.full((400,), 0.7), torch.full((400,), -1), g)
    assert set(tok.tolist()) == {0, 1}


def test_seeded_rows_draw_from_their_own_stream_with_the_filtered_distribution():
    from megatron_dapo.embedded_server.sampling import sample, seeded_uniform

    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) and 0.0 <= seeded_uniform(7, 3) < 1.0
    assert len({seeded_uniform(s, p) for s in range(50) for p in range(50)}) == 2500
    torch.manual_seed(0)
    logits = torch.randn(5, 30) * 2
    ones, full = torch.ones(5), torch.full((5,), -1)
    seeds, pos = [11, None, 12, 13, None], [4, 9, 4, 4, 2]
    tok, _ = sample(logits, ones, ones, full, torch.Generator().manual_seed(0), seeds=seeds, positions=pos)
    # the same seeded rows alone, reversed and with other engine-stream draws: the same tokens
    rev = [3, 2, 0]
    tok_rev, _ = sample(
        logits[rev],
        ones[:3],
        ones[:3],
        full[:3],
        torch.Generator().manual_seed(5),
        seeds=[seeds[i] for i in rev],
        positions=[pos[i] for i in rev],
    )
    assert tok_rev.tolist() == [tok[i].item() for i in rev]
    # over many seeds a seeded draw follows the top-p-filtered, renormalised distribution
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    N = 4000
    t, _ = sample(
        probs.log().repeat(N, 1),
        torch.ones(N),
        torch.full((N,), 0.85),
        torch.full((N,), -1),
        seeds=list(range(N)),
        positions=[0] * N,
    )
    freq = torch.bincount(t, minlength=4).double() / N
    assert freq[3] == 0  # outside the nucleus: never drawn
    torch.testing.assert_close(freq[:3], (probs[:3] / probs[:3].sum()).double(), atol=0.03, rtol=0)


# ---- engine (in-process) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("q3"))
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), d


def _teacher_forced(model, prompt, output, temperature):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    t = 1.0 if temperature < 1e-6 else temperature
    lp = torch.log_softmax(logits / t, -1)
    return [float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


def test_engine_batched_samples_have_reference_logprobs(tiny_qwen3):
    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    model, _ = tiny_qwen3
    eng = Engine(model, seed=3)
    try:
        reqs = [
            GenRequest(rid=f"r{i}", prompt=p, max_new_tokens=m, temperature=t, top_p=tp, top_k=k, return_logprob=True)
            for i, (p, m, t, tp, k) in enumerate(
                [
                    ([1, 2, 3], 12, 1.0, 1.0, -1),
                    ([4, 5, 6, 7, 8, 9], 7, 0.6, 0.9, -1),
                    ([1, 2, 3], 12, 1.0, 1.0, -1),
                    ([10], 9, 0.0, 1.0, -1),
                    ([11, 12], 5, 1.2, 1.0, 8),
                ]
            )
        ]
        futs = [eng.submit(r) for r in reqs]
        answers = [f.result(60) for f in futs]
    finally:
        eng.close()
    for r, a in zip(reqs, answers):
        out = a["output_ids"]
        assert len(out) == r.max_new_tokens and a["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": r.max_new_tokens,
        }
        got = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        ref = _teacher_forced(model, r.prompt, out, r.temperature)
        assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-4, r.rid
    greedy = answers[3]["output_ids"]
    hf = model.generate(torch.tensor([[10]]), max_new_tokens=9, do_sample=False)[0, 1:].tolist()
    assert greedy == hf
    assert answers[0]["output_ids"] != answers[2]["output_ids"]  # same prompt, independent samples


def test_engine_stop_tokens_input_logprobs_and_abort(tiny_qwen3):
    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    model, _ = tiny_qwen3
    eng = Engine(model, seed=0)
    try:
        greedy = eng.submit(GenRequest(rid="g", prompt=[3, 4], max_new_tokens=6, temperature=0.0)).result(30)
        stop_tok = greedy["output_ids"][2]
        stopped = eng.submit(
            GenRequest(rid="s", prompt=[3, 4], max_new_tokens=6, temperature=0.0, stop_token_ids=frozenset([stop_tok]))
        ).result(30)
        first = greedy["output_ids"].index(stop_tok)
        assert stopped["output_ids"] == greedy["output_ids"][: first + 1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}

        probe = [5, 9, 2, 7, 7, 1]
        a = eng.submit(
            GenRequest(rid="p", prompt=probe, max_new_tokens=0, return_logprob=True, logprob_start_len=0)
        ).result(30)
        got = a["meta_info"]["input_token_logprobs"]
        assert got[0][0] is None and [t[1] for t in got] == probe
        ref = _teacher_forced(model, probe[:1], probe[1:], 1.0)
        assert max(abs(x[0] - y) for x, y in zip(got[1:], ref)) < 1e-5
        assert a["output_ids"] == [] and a["meta_info"]["finish_reason"]["type"] == "length"

        eng.pause("in_place")
        fut = eng.submit(GenRequest(rid="long", prompt=[1], max_new_tokens=400, ignore_eos=True))
        assert eng.abort("long") == 1
        ab = fut.result(30)
        assert ab["meta_info"]["finish_reason"]["type"] == "abort"
        eng.resume()
    finally:
        eng.close()


def test_engine_retract_resumes_with_new_weights_and_spans(tiny_qwen3):
    import time

    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    model, _ = tiny_qwen3
    eng = Engine(model, seed=0, weight_version="1")
    try:
        fut = eng.submit(GenRequest(rid="x", prompt=[1, 2], max_new_tokens=300, ignore_eos=True, temperature=0.0))
        deadline = time.time() + 20
        while not eng._batch and time.time() < deadline:
            time.sleep(0.001)
        eng.pause("retract")
        with eng.step_lock:
            n_before = len(eng._active["x"].output)
            eng.set_weight_version("2")
        assert not fut.done() and n_before < 300
        eng.resume()
        a = fut.result(60)
    finally:
        eng.close()
    m = a["meta_info"]
    assert len(a["output_ids"]) == 300 and m["num_retractions"] == 1 and m["weight_version"] == "2"
    assert m["weight_versions"] == [
        {"version": "1", "start": 0, "end": n_before},
        {"version": "2", "start": n_before, "end": 300},
    ]


@pytest.mark.parametrize("batching", ["continuous", "static"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_engine_continuous_batching_joins_arrivals_to_the_running_batch(tiny_qwen3, batching, batch_invariant):
    """Requests arriving while others decode: with continuous batching they join the running batch
    (and short ones finish first), with static batching they wait for it to end; either way every
    sample is the one HF computes (greedy tokens, logprobs), and a seeded one is what it is alone."""
    import threading

    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    model, _ = tiny_qwen3
    prompts = {"a": [1, 2, 3], "b": [7, 8, 9, 10, 11], "c": [4, 5], "d": [6], "e": [2, 2]}
    lengths = {"a": 60, "b": 8, "c": 90, "d": 6, "e": 5}

    def req(rid):
        seed = 5 if rid == "c" else None  # c samples (temperature 1), the others are greedy
        return GenRequest(
            rid=rid,
            prompt=prompts[rid],
            max_new_tokens=lengths[rid],
            temperature=float(rid == "c"),
            ignore_eos=True,
            return_logprob=True,
            sampling_seed=seed,
        )

    eng = Engine(model, seed=0, batch_invariant=batch_invariant, batching=batching, max_batch=3)
    decode_batches, timed, a_at_10 = [], eng._timed, threading.Event()

    def counting(step, reqs, prefill):  # in the worker, which holds the step lock (reentrant)
        if not prefill:
            decode_batches.append(len(reqs))
        out = timed(step, reqs, prefill)
        if not a_at_10.is_set() and len(reqs[0].output) >= 10 and reqs[0].rid == "a":
            eng.pause("in_place")  # b, c and d arrive at a's 10th token
            a_at_10.set()
        return out

    eng._timed = counting
    order = []  # the order the answers were sent in (the callbacks run in the engine's thread)

    def submit(rid):
        futs[rid] = eng.submit(req(rid))
        futs[rid].add_done_callback(lambda _: order.append(rid))

    futs = {}
    try:
        eng.pause("in_place")  # a starts alone
        submit("a")
        futs["a"].add_done_callback(lambda _: eng.pause("in_place"))  # at the step that ends a
        eng.resume()
        assert a_at_10.wait(60)
        for rid in "bcd":  # together: two fit beside a
            submit(rid)
        eng.resume()
        futs["a"].result(120)  # paused by then: e arrives while c runs (continuous) or waits (static)
        submit("e")
        eng.resume()
        answers = {rid: f.result(120) for rid, f in futs.items()}
    finally:
        eng.close()
    alone = Engine(model, seed=1)
    try:
        c_alone = alone.submit(req("c")).result(120)
    finally:
        alone.close()

    assert max(decode_batches) == 3
    if batching == "continuous":  # b and c join a; d takes b's place; e joins c once a is done
        assert order == ["b", "d", "a", "e", "c"]
    else:  # a alone; then b, c and d; e waits for c
        assert order == ["a", "d", "b", "c", "e"]
    for rid in "abde":
        out = answers[rid]["output_ids"]
        hf = model.generate(
            torch.tensor([prompts[rid]]), max_new_tokens=len(out), do_sample=False, min_new_tokens=len(out)
        )
        assert out == hf[0, len(prompts[rid]) :].tolist(), rid
    for rid in "abcde":
        got = [x[0] for x in answers[rid]["meta_info"]["output_token_logprobs"]]
        ref = _teacher_forced(model, prompts[rid], answers[rid]["output_ids"], float(rid == "c"))
        assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-4, rid
    assert answers["c"]["output_ids"] == c_alone["output_ids"]
    assert {rid: len(a["output_ids"]) for rid, a in answers.items()} == lengths


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_engine_kv_pool_bounds_admission_and_retracts_as_sglang(tiny_qwen3, batch_invariant):
    """--max-total-tokens 40, continuous batching: b joins a while both fit; when the next decode step
    would overflow the pool, b (fewer output tokens) is retracted, waits until a has left, and is
    prefilled again; no decode step ever holds more than the pool. A request that cannot fit at all is
    aborted; the last request left is aborted when even it outgrows the pool. Tokens and logprobs are
    HF's throughout."""
    import threading

    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    model, _ = tiny_qwen3
    prompts = {"a": [1, 2, 3], "b": [7, 8, 9, 10, 11]}

    def greedy(rid, prompt, m):
        return GenRequest(
            rid=rid, prompt=prompt, max_new_tokens=m, temperature=0.0, ignore_eos=True, return_logprob=True
        )

    eng = Engine(model, seed=0, batching="continuous", batch_invariant=batch_invariant, max_total_tokens=40)
    held, timed, a_at_10 = [], eng._timed, threading.Event()

    def counting(step, reqs, prefill):  # in the worker, which holds the step lock (reentrant)
        if not prefill:
            held.append(sum(len(r.prompt) + len(r.output) + 1 for r in reqs))  # KV after the step
        out = timed(step, reqs, prefill)
        if not a_at_10.is_set() and reqs[0].rid == "a" and len(reqs[0].output) >= 10:
            eng.pause("in_place")
            a_at_10.set()
        return out

    eng._timed = counting
    try:
        from megatron_dapo.embedded_server import load_report
        from megatron_dapo.rollout import payloads

        assert payloads.parse_loads({"loads": [load_report.load_row(eng)]}).kv_capacity == 40  # /v1/loads
        eng.pause("in_place")
        fut_a = eng.submit(greedy("a", prompts["a"], 30))
        eng.resume()
        assert a_at_10.wait(60)
        fut_b = eng.submit(greedy("b", prompts["b"], 20))  # 13 + 5 tokens: fits beside a
        eng.resume()
        answers = {"a": fut_a.result(120), "b": fut_b.result(120)}
        too_long = eng.submit(greedy("long", list(range(1, 41)), 4)).result(60)
        outgrown = eng.submit(greedy("grow", list(range(1, 31)), 20)).result(60)
    finally:
        eng.close()

    assert max(held) <= 40 and max(held) >= 38  # the pool was used up to its end, never over
    assert answers["a"]["meta_info"]["num_retractions"] == 0
    assert answers["b"]["meta_info"]["num_retractions"] == 1
    for rid, a in answers.items():
        out = a["output_ids"]
        assert len(out) == {"a": 30, "b": 20}[rid]
        hf = model.generate(
            torch.tensor([prompts[rid]]), max_new_tokens=len(out), do_sample=False, min_new_tokens=len(out)
        )
        assert out == hf[0, len(prompts[rid]) :].tolist(), rid
        got = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        ref = _teacher_forced(model, prompts[rid], out, 0.0)
        assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-4, rid
    assert too_long["meta_info"]["finish_reason"]["type"] == "abort" and too_long["output_ids"] == []
    assert "--max-total-tokens" in too_long["meta_info"]["finish_reason"]["message"]
    assert outgrown["meta_info"]["finish_reason"]["type"] == "abort"
    assert "Out of memory" in outgrown["meta_info"]["finish_reason"]["message"]
    assert len(outgrown["output_ids"]) == 10  # 30 + 10 tokens fill the pool


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_engine_fails_only_the_requests_of_a_failed_step(tiny_qwen3, batching):
    """A prefill that raises fails the requests it was prefilling (they used to wait forever); the
    batch they were to join goes on. A decode that raises fails its batch. The engine serves on."""
    import threading

    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    model, _ = tiny_qwen3
    eng = Engine(model, seed=0, batching=batching)
    prefill, decode, running = eng._prefill, eng._decode, threading.Event()
    failing = {"prefill": False, "decode": False}

    def flaky(step, name):
        def run(*a):
            if failing[name]:
                failing[name] = False
                raise RuntimeError(f"injected {name} failure")
            running.set()
            return step(*a)

        return run

    eng._prefill, eng._decode = flaky(prefill, "prefill"), flaky(decode, "decode")
    greedy = lambda rid, m: GenRequest(
        rid=rid,
        prompt=[1, 2],
        max_new_tokens=m,
        temperature=0.0,  # noqa: E731
        ignore_eos=True,
    )
    try:
        long = eng.submit(greedy("long", 40))
        assert running.wait(60)
        failing["prefill"] = True
        joining = eng.submit(greedy("joining", 5))
        with pytest.raises(RuntimeError, match="injected prefill failure"):
            joining.result(60)
        assert long.result(60)["output_ids"] == eng.submit(greedy("again", 40)).result(60)["output_ids"]
        failing["decode"] = True
        with pytest.raises(RuntimeError, match="injected decode failure"):
            eng.submit(greedy("decoded", 5)).result(60)
        assert len(eng.submit(greedy("after", 3)).result(60)["output_ids"]) == 3
        assert eng.in_flight() == 0
    finally:
        eng.close()


def test_engine_seeded_requests_reproduce_alone_or_batched(tiny_qwen3):
    from megatron_dapo.embedded_server import schemas as S
    from megatron_dapo.embedded_server.engine import Engine, GenRequest
    from megatron_dapo.embedded_server.server import EmbeddedServer

    model, _ = tiny_qwen3
    prompt = [3, 1, 4, 1, 5]

    def req(rid, seed, p=prompt, m=10):
        return GenRequest(
            rid=rid,
            prompt=list(p),
            max_new_tokens=m,
            temperature=1.0,
            ignore_eos=True,
            return_logprob=True,
            sampling_seed=seed,
        )

    eng = Engine(model, seed=0)
    try:
        alone = eng.submit(req("alone", 7)).result(60)
        # batched with unseeded and other-seeded rows, in another order, on a fresh engine stream
        batch = [
            req("u0", None, [9, 9], 14),
            req("s8", 8),
            req("again", 7),
            req("u1", None, [2], 6),
            req("s9", 9, [5, 6, 7, 8, 9, 10], 12),
        ]
        eng.pause("in_place")  # queue them all, so that they are prefilled and decoded as one batch
        futs = [(r, eng.submit(r)) for r in batch]
        eng.resume()
        answers = {r.rid: f.result(60) for r, f in futs}
    finally:
        eng.close()
    eng2 = Engine(model, seed=123)  # another server: different engine stream, same seeded samples
    try:
        fresh = eng2.submit(req("fresh", 7)).result(60)
    finally:
        eng2.close()
    assert alone["output_ids"] == answers["again"]["output_ids"] == fresh["output_ids"]
    lp = lambda a: [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(lp(alone), lp(answers["again"]))) < 1e-5
    assert answers["s8"]["output_ids"] != alone["output_ids"]  # another seed, another sample
    ref = _teacher_forced(model, prompt, alone["output_ids"], 1.0)  # logprob semantics unchanged
    assert max(abs(x - y) for x, y in zip(lp(alone), ref)) < 1e-4

    # batch-invariant mode (--enable-deterministic-inference): the same bits alone or batched, and the
    # same seeded tokens as the batched engine (the draws do not depend on the mode)
    def run(batched):
        e = Engine(model, seed=0, batch_invariant=True)
        try:
            e.pause("in_place")
            futs = [
                e.submit(r)
                for r in ([req(f"b{i}", None, [9] * (i + 2), 9 + i) for i in range(3)] if batched else [])
                + [req("x", 7)]
                + ([req("y", 8, [4, 4])] if batched else [])
            ]
            e.resume()
            return {a["meta_info"]["id"]: a for a in (f.result(60) for f in futs)}
        finally:
            e.close()

    solo, mixed = run(False)["x"], run(True)
    assert solo["output_ids"] == mixed["x"]["output_ids"] == alone["output_ids"]
    assert lp(solo) == lp(mixed["x"])  # bitwise
    assert max(abs(x - y) for x, y in zip(lp(solo), ref)) < 1e-4
    assert all(
        a["meta_info"]["completion_tokens"] == m
        for a, m in [(mixed["b0"], 9), (mixed["b1"], 10), (mixed["b2"], 11), (mixed["y"], 10)]
    )

    # n > 1 with one seed: SGLang copies the sampling params, seed included, to each of the n
    # requests, so the n samples are identical; distinct samples take one request per seed.
    srv = EmbeddedServer(model)
    try:
        seeded = dict(max_new_tokens=10, ignore_eos=True, sampling_seed=7)
        body = S.GenerateIn(input_ids=prompt, rid="g", return_logprob=True, sampling_params={**seeded, "n": 3})
        copies = [srv.engine.submit(r).result(60)["output_ids"] for r in srv._make_requests(body)]
        # the batch form gives each prompt its own seed: distinct samples in one request
        batch = S.GenerateIn(
            input_ids=[prompt] * 3,
            rid=["b0", "b1", "b2"],
            return_logprob=True,
            sampling_params=[{**seeded, "sampling_seed": sd} for sd in (7, 8, 9)],
        )
        reqs = srv._make_requests(batch)
        assert [r.rid for r in reqs] == ["b0", "b1", "b2"]
        distinct = [srv.engine.submit(r).result(60)["output_ids"] for r in reqs]
        for bad, field in [
            ({"input_ids": [prompt, prompt], "sampling_params": [seeded]}, "2 prompts"),
            ({"input_ids": [prompt], "sampling_params": [{**seeded, "n": 2}]}, "sampling_params[0].n"),
            ({"input_ids": [prompt, [1, 10**6]]}, "input_ids[1][1]"),
            ({"input_ids": [prompt], "sampling_params": [{"top_p": 2.0}]}, "sampling_params[0].top_p"),
            ({"input_ids": prompt, "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
            ({"input_ids": prompt, "rid": ["a", "b"]}, "a list needs a batch"),
        ]:
            assert field in srv._make_requests(S.GenerateIn(**bad)), bad
    finally:
        srv.engine.close()
    assert copies == [alone["output_ids"]] * 3
    assert distinct[0] == alone["output_ids"] and len({tuple(d) for d in distinct}) == 3
    with pytest.raises(Exception, match="sampling_seed"):
        S.SamplingParamsIn(sampling_seed=2**63)


# ---- weights -----------------------------------------------------------------------------------


def test_loader_maps_per_expert_checkpoint_names_onto_fused_moe(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_dapo.bridge.hf_loader import HFWeightLoader, WeightLoadError
    from megatron_dapo.models.tiny import save_tiny_hf_model, tiny_hf_config

    d = save_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=5)
    on_disk = load_file(str(d / "model.safetensors"))
    assert any(".mlp.experts.3.up_proj.weight" in k for k in on_disk)  # per-expert on disk
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # transformers' own conversion
    torch.manual_seed(99)
    fresh = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe"), dtype=torch.float32)
    loader = HFWeightLoader(fresh)
    assert set(loader.checkpoint_shapes()) == set(on_disk)
    loader.load(on_disk.items())
    ref_sd = reference.state_dict()
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, ref_sd[k], atol=0, rtol=0, msg=k)
    with pytest.raises(WeightLoadError, match="model.layers.1.mlp.experts.9.gate_proj.weight"):
        loader.load([("model.layers.1.mlp.experts.9.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(WeightLoadError, match="model.norm.weight: shape"):
        loader.load([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(WeightLoadError, match="no such tensor"):
        loader.load([("model.layers.0.mlp.bogus.weight", torch.zeros(3))])


def test_flattened_updates_are_received_straight_into_rehomed_parameters(tmp_path):
    """The receive side of a flattened bucket, without the wire: write a bucket's bytes into the buffer the
    server would receive into. The second update of a layout must land in the parameters by itself."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_dapo.bridge.hf_loader import HFWeightLoader
    from megatron_dapo.embedded_server.weight_receiver import FlatBucketHomes
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.weight_buckets import Bucket, bucket_layout

    dirs = [save_tiny_hf_model("qwen3_moe", tmp_path / f"m{i}", seed=i) for i in range(3)]
    weights = [sorted(load_file(str(d / "model.safetensors")).items()) for d in dirs]
    model = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    loader, homes = HFWeightLoader(model), FlatBucketHomes(HFWeightLoader(model))
    layout = bucket_layout(
        [n for n, _ in weights[1]], [t.dtype for _, t in weights[1]], [list(t.shape) for _, t in weights[1]]
    )

    def receive(named):
        flat = homes.buffer(layout, "cpu")
        Bucket(named).flatten(flat)  # what the broadcast writes
        return flat, layout.unflatten(flat)

    flat1, views = receive(weights[1])
    homes.adopt(layout, flat1, views)
    loader.load(views)
    flat2, views = receive(weights[2])
    assert flat2 is flat1
    norm = dict(model.named_parameters())["model.norm.weight"]
    assert flat1.data_ptr() <= norm.data_ptr() < flat1.data_ptr() + flat1.numel()
    torch.testing.assert_close(norm, dict(weights[2])["model.norm.weight"], atol=0, rtol=0)  # before any load
    loader.load(views)  # copies only what could not be re-homed: the experts' slices of the fused tensors
    reference = AutoModelForCausalLM.from_pretrained(dirs[2], dtype=torch.float32).state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, reference[k], atol=0, rtol=0, msg=k)
    experts = [k for k, v in model.named_parameters() if "experts" in k]
    assert experts and all(
        not (flat1.data_ptr() <= dict(model.named_parameters())[k].data_ptr() < flat1.data_ptr() + flat1.numel())
        for k in experts
    )


# ---- buckets ------------------------------------------------------------------------------------


def test_buckets_bound_size_and_flat_layout_round_trips():
    from megatron_dapo.rollout.weight_buckets import bucket_layout, iter_buckets

    g = torch.Generator().manual_seed(0)
    named = [
        (f"t{i}", torch.randn(s, generator=g).to(dt))
        for i, (s, dt) in enumerate(
            [
                ((10, 10), torch.float32),
                ((7,), torch.bfloat16),
                ((3, 5), torch.float32),
                ((300,), torch.float32),
                ((1,), torch.bfloat16),
                ((2, 2), torch.float32),
            ]
        )
    ]
    buckets = list(iter_buckets(iter(named), bucket_bytes=500, aligned=True))
    assert [n for b in buckets for n in b.names] == [n for n, _ in named]  # order kept, nothing lost
    for b in buckets:
        assert b.nbytes <= 500 or len(b.tensors) == 1
        layout = bucket_layout(b.names, [t.dtype for _, t in b.tensors], b.shapes)
        assert layout.nbytes == b.nbytes
        for (n, t), (n2, u) in zip(b.tensors, layout.unflatten(b.flatten())):
            assert n == n2 and u.dtype == t.dtype and torch.equal(u, t)
    with pytest.raises(ValueError, match="not aligned"):
        bucket_layout(["a", "b"], [torch.bfloat16, torch.float32], [[1], [1]])


# ---- launcher -----------------------------------------------------------------------------------


def test_sglang_command_uses_sglang_flag_names():
    from megatron_dapo.rollout.launcher import SGLangServerArgs, sglang_command

    args = SGLangServerArgs(
        model_path="/m",
        port=31000,
        tp_size=4,
        mem_fraction_static=0.7,
        api_key="k",
        dtype="bfloat16",
        weight_version="0",
        random_seed=1,
        context_length=4096,
        base_gpu_id=2,
        enable_memory_saver=True,
        skip_tokenizer_init=True,
        trust_remote_code=True,
        served_model_name="q",
        log_level="info",
        enable_deterministic_inference=True,
    )
    cmd = sglang_command(args, python="py")
    assert "--enable-deterministic-inference" in cmd
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    flags = [c for c in cmd if c.startswith("--")]
    known = set(SNAPSHOT["server_args"])
    assert [f for f in flags if f[2:].replace("-", "_") not in known] == []
    as_dict = dict(zip(cmd[3::1], cmd[4::1]))
    assert as_dict["--tp-size"] == "4" and as_dict["--model-path"] == "/m" and as_dict["--port"] == "31000"
    assert as_dict["--mem-fraction-static"] == "0.7" and as_dict["--api-key"] == "k"
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_sglang_args_from_config():
    from megatron_dapo.config.schema import DapoConfig
    from megatron_dapo.rollout.launcher import SGLangServerArgs, sglang_command

    cfg = DapoConfig()
    cfg.rollout.server_tp, cfg.rollout.mem_fraction_static, cfg.rollout.extra_args = 2, 0.6, ["--foo"]
    a = SGLangServerArgs.from_config(cfg, "/m", 1234)
    assert (a.tp_size, a.mem_fraction_static, a.port, a.extra_args) == (2, 0.6, 1234, ["--foo"])
    assert not a.enable_deterministic_inference
    cfg.rollout.deterministic_inference = True
    assert SGLangServerArgs.from_config(cfg, "/m", 1234).enable_deterministic_inference
    # colocated servers release and resume their memory every step: SGLang's memory saver
    assert not a.enable_memory_saver
    cfg.trainer.placement = "colocated"
    assert "--enable-memory-saver" in sglang_command(SGLangServerArgs.from_config(cfg, "/m", 1234))


def test_embedded_command_flags_parse_in_the_server():
    from megatron_dapo.embedded_server.server import build_parser
    from megatron_dapo.rollout.launcher import embedded_command

    cmd = embedded_command("/m", 1234, seed=3, deterministic_inference=True, python="py")
    assert cmd[:4] == ["py", "-m", "megatron_dapo.cli", "serve"]
    args = build_parser().parse_args(cmd[4:])
    assert (args.model, args.port, args.seed, args.enable_deterministic_inference) == ("/m", 1234, 3, True)
    assert not build_parser().parse_args(embedded_command("/m", 1, python="py")[4:]).enable_deterministic_inference
    assert build_parser().parse_args(embedded_command("/m", 1, python="py")[4:]).batching == "static"
    assert (
        build_parser().parse_args(embedded_command("/m", 1, batching="continuous", python="py")[4:]).batching
        == "continuous"
    )
    assert build_parser().parse_args(["--model", "/m", "--max-total-tokens", "40"]).max_total_tokens == 40


def test_a_runs_embedded_servers_get_its_rollout_options_extra_args_included():
    """rollout.extra_args reach `megatron-dapo serve` too (not SGLang's command only): a bf16 rollout engine
    beside an fp32 trainer is `rollout.extra_args=[--dtype,bfloat16]`."""
    from megatron_dapo.config import load_config
    from megatron_dapo.embedded_server.server import build_parser
    from megatron_dapo.rollout.launcher import embedded_command, embedded_options

    cfg = load_config(
        str(Path(__file__).resolve().parents[2] / "configs/qwen3/tiny_qwen3_cpu.yaml"),
        ["rollout.extra_args=[--dtype,bfloat16]", "rollout.deterministic_inference=true"],
    )
    options = embedded_options(cfg, "cpu")
    args = build_parser().parse_args(embedded_command("/m", 1, python="py", **options)[4:])
    assert (args.dtype, args.device, args.enable_deterministic_inference) == ("bfloat16", "cpu", True)


def test_embedded_server_refuses_an_empty_kv_pool(capsys):
    from megatron_dapo.embedded_server.server import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--max-total-tokens", "0"])
    assert e.value.code == 2 and "--max-total-tokens 0: must be >= 1" in capsys.readouterr().err


def test_launch_sglang_says_what_is_missing(tmp_path):
    from megatron_dapo.rollout.launcher import SGLangServerArgs, launch_sglang

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed")
    with pytest.raises(ImportError, match="sglang"):
        launch_sglang(SGLangServerArgs(model_path="/m"), tmp_path / "log")
