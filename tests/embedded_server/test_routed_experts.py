"""Routed experts (R3) from the embedded server: SGLang 0.5.23's field, encoding and rows, the ids an
independent HF forward's router logits give, under continuous batching, retraction and continuation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from megatron_dapo.embedded_server.engine import Engine, GenRequest
from megatron_dapo.rollout.payloads import decode_routed_experts

LAYERS, TOP_K, EXPERTS = 3, 2, 8
PROMPTS = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 1], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model(
        "qwen3_moe",
        tmp_path_factory.mktemp("moe"),
        num_hidden_layers=LAYERS,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )


@pytest.fixture(scope="module")
def model(moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def reference_topk(model, seq: list[int]) -> torch.Tensor:
    """[len(seq), layers, top_k]: an unbatched HF forward's router logits -> top-k, per token and MoE
    layer (the config's, in order); zeros at the dense layers (`mlp_only_layers`), as in SGLang's buffer."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), output_router_logits=True)
    moe_layers = [i for i in range(LAYERS) if i not in model.config.mlp_only_layers]
    assert len(moe_layers) == len(out.router_logits) and moe_layers != list(range(LAYERS))
    ref = torch.zeros(len(seq), LAYERS, TOP_K, dtype=torch.int32)
    for layer, logits in zip(moe_layers, out.router_logits):
        ref[:, layer] = logits.topk(TOP_K, dim=-1).indices.int()
    return ref


def _rows(answer: dict) -> torch.Tensor:
    return decode_routed_experts(answer["meta_info"]["routed_experts"], LAYERS, TOP_K)


def _check_against_reference(model, req: GenRequest, answer: dict, start: int = 0) -> None:
    seq = req.prompt + answer["output_ids"]
    ref = reference_topk(model, seq)[start : len(seq) - 1]
    got = _rows(answer)
    assert got.shape == ref.shape == (len(seq) - 1 - start, LAYERS, TOP_K)
    assert torch.equal(got, ref), f"{req.rid}: routed experts differ at {(got != ref).nonzero().tolist()[:5]}"


def _requests(tag: str, **kw) -> list[GenRequest]:
    return [
        GenRequest(rid=f"{tag}{i}", prompt=p, max_new_tokens=6 + i, temperature=1.0, return_routed_experts=True, **kw)
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_continuous_batching_and_kv_retraction_route_as_hf(model, batch_invariant):
    # a KV pool of 40 tokens for 4 sequences of up to 17: decode retracts some, their prefill recomputes
    eng = Engine(
        model,
        max_batch=4,
        seed=1,
        batching="continuous",
        max_total_tokens=40,
        batch_invariant=batch_invariant,
        return_routed_experts=True,
    )
    try:
        first = _requests("a")
        futures = [eng.submit(r) for r in first[:2]]
        futures += [eng.submit(r) for r in first[2:]]  # may join the running batch between decode steps
        answers = [f.result(timeout=300) for f in futures]
    finally:
        eng.close()
    assert sum(a["meta_info"]["num_retractions"] for a in answers) > 0, "the pool must force a retraction"
    for req, answer in zip(first, answers):
        _check_against_reference(model, req, answer)


def test_pause_retract_and_partial_rollout_continuation(model):
    eng = Engine(model, max_batch=4, seed=2, return_routed_experts=True)
    try:
        eng.pause("in_place")
        reqs = _requests("b")
        futures = eng.submit_many(reqs)
        eng.resume()
        eng.pause("retract")  # whatever ran is dissolved, then prefilled again (prompt + tokens so far)
        eng.resume()
        answers = [f.result(timeout=300) for f in futures]
        for req, answer in zip(reqs, answers):
            _check_against_reference(model, req, answer)

        # partial rollout: a sample stopped after m tokens goes on from prompt + those tokens; asked from
        # the last position its first piece did not cover, the pieces join in token order
        req, answer = reqs[1], answers[1]
        m = 3
        head = req.prompt + answer["output_ids"][:m]
        more = GenRequest(
            rid="b-more",
            prompt=head,
            max_new_tokens=4,
            return_routed_experts=True,
            routed_experts_start_len=len(head) - 1,
        )
        tail = eng.submit(more).result(timeout=300)
        _check_against_reference(model, more, tail, start=len(head) - 1)
        joined = torch.cat([reference_topk(model, head)[: len(head) - 1], _rows(tail)])
        assert torch.equal(joined, reference_topk(model, head + tail["output_ids"])[:-1])
    finally:
        eng.close()


def test_sglang_encodes_and_decodes_the_same(model):
    """SGLang's own capturer output path encodes the HF reference to the server's exact string, and
    SGLang's own decoder reads the server's answer as the reference ids."""
    eng = Engine(model, seed=3, return_routed_experts=True)
    try:
        cases, expected = [], []
        for start in (0, 2):
            req = GenRequest(rid=f"c{start}", prompt=PROMPTS[1], max_new_tokens=5, return_routed_experts=True)
            req.routed_experts_start_len = start
            answer = eng.submit(req).result(timeout=300)
            seq = req.prompt + answer["output_ids"]
            ref = reference_topk(model, seq)
            cases.append({"topk": ref.tolist(), "start_len": start, "meta_info": answer["meta_info"]})
            expected.append((answer["meta_info"]["routed_experts"], ref[start:-1].flatten().tolist()))
    finally:
        eng.close()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang_peer", "routed-experts"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for (ours, ref_ids), sglang in zip(expected, theirs):
        assert sglang["encoded"] == ours
        assert sglang["decoded"] == ref_ids


def test_dense_model_refuses_capture():
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.tiny import tiny_hf_config

    dense = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3"), dtype=torch.float32)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        Engine(dense, return_routed_experts=True)


@pytest.mark.slow
def test_server_answers_routed_experts_over_http(moe_dir, model, tmp_path):
    from megatron_dapo.rollout.launcher import embedded_server, start_servers

    srv = embedded_server(str(moe_dir), tmp_path / "server.log", return_routed_experts=True)
    start_servers([srv], timeout_s=120)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=120) as http:
            body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 5}, "return_routed_experts": True}
            answer = http.post("/generate", json=body).json()
            _check_against_reference(model, GenRequest(rid="h", prompt=PROMPTS[0]), answer)
            r = http.post("/generate", json={**body, "routed_experts_start_len": len(PROMPTS[0]) + 1})
            assert r.status_code == 400 and "routed_experts_start_len" in r.text
            info = http.get("/server_info").json()
            assert info["enable_return_routed_experts"] is True
    finally:
        srv.stop()


def test_continuation_after_a_weight_change_joins_each_piece_from_its_weights(moe_dir):
    """Partial rollout across a weight update: the first piece's rows come from the old routers, the
    continuation's (asked from the first position the first piece did not cover) from the new ones."""
    import copy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    old = copy.deepcopy(model)
    eng = Engine(model, seed=4, return_routed_experts=True)
    try:
        head = GenRequest(rid="w0", prompt=PROMPTS[3], max_new_tokens=4, return_routed_experts=True)
        first = eng.submit(head).result(timeout=300)
        _check_against_reference(old, head, first)
        with eng.step_lock, torch.no_grad():  # a weight update: new routers, written in place
            torch.manual_seed(0)
            for i in range(1, LAYERS):
                gate = model.model.layers[i].mlp.gate.weight
                gate.copy_(torch.randn_like(gate))
        seq = head.prompt + first["output_ids"]
        more = GenRequest(
            rid="w1", prompt=seq, max_new_tokens=4, return_routed_experts=True, routed_experts_start_len=len(seq) - 1
        )
        tail = eng.submit(more).result(timeout=300)
    finally:
        eng.close()
    full = seq + tail["output_ids"]
    joined = torch.cat([_rows(first), _rows(tail)])
    want = torch.cat([reference_topk(old, seq)[:-1], reference_topk(model, full)[len(seq) - 1 : -1]])
    assert torch.equal(joined, want)
    # the new routers do route differently: the pieces' weights matter
    assert not torch.equal(reference_topk(old, full), reference_topk(model, full))
