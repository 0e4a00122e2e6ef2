"""Partial rollout against a real embedded server: requests aborted mid-generation (pause in abort
mode) continue from their tokens. With unchanged weights the result equals an uninterrupted seeded
request; with weights changing between interruptions, every token's recorded version is the one
whose weights (checked against HF models in float64) produced its logprob."""

import asyncio
import time

import pytest
import torch

from megatron_dapo.coordinator import continuation_ids, finish_partial
from megatron_dapo.coordinator.groups import token_versions
from megatron_dapo.rollout.client import SGLangClient
from megatron_dapo.rollout.types import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("partial")
    return [save_tiny_hf_model("qwen3", root / f"m{seed}", seed=seed) for seed in range(3)]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    from megatron_dapo.rollout.launcher import embedded_server, start_servers

    srv = embedded_server(str(models[0]), tmp_path_factory.mktemp("logs") / "server.log")
    start_servers([srv], timeout_s=180)
    yield srv
    srv.stop()


async def _interrupted(url, sampling, between_pauses, every_s=0.25):
    """Generate through partial rollout while another client pauses the server in abort mode every
    `every_s`, calling `between_pauses(client, k)` while it is paused; returns (sample, resumes)."""
    done = asyncio.Event()
    resumes = []

    async def interrupter():
        async with SGLangClient(url) as admin:
            k = 0
            while not done.is_set():
                await asyncio.sleep(every_s)
                if done.is_set():
                    break
                await admin.pause_generation("abort")
                try:
                    await between_pauses(admin, k)
                finally:  # a failing callback must not leave the server paused (the request would hang)
                    await admin.continue_generation()
                k += 1

    async with SGLangClient(url) as c:

        async def generate(so_far, sp):
            (s,) = await c.generate(continuation_ids(so_far), sp)
            return s

        pauser = asyncio.ensure_future(interrupter())
        try:
            (first,) = await c.generate(PROMPT, sampling)
            out = await finish_partial(generate, first, sampling, max_stalls=100, on_resume=lambda: resumes.append(1))
        finally:
            done.set()
            await pauser
    return out, len(resumes)


async def _interrupted_enough(url, sampling, between_pauses, enough, after_try=None):
    """`_interrupted` with pauses at a fraction of an uninterrupted request's time, so they fall inside the
    request on a fast machine as on a slow one; a burst of load may still let it finish between two pauses
    (`enough(sample, resumes)` false): then it runs again with pauses twice as often (four tries), calling
    `after_try()` after each. Returns (uninterrupted sample, sample, resumes)."""
    async with SGLangClient(url) as c:
        t0 = time.monotonic()
        (ref,) = await c.generate(PROMPT, sampling)
        every_s = (time.monotonic() - t0) / 8
    for _ in range(4):
        got, resumes = await _interrupted(url, sampling, between_pauses, every_s)
        if after_try is not None:
            await after_try()
        if enough(got, resumes):
            break
        every_s /= 2
    return ref, got, resumes


def test_interrupted_seeded_request_equals_the_uninterrupted_one(server):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=400, sampling_seed=1234)

    async def nothing(admin, k):
        pass

    ref, got, resumes = asyncio.run(
        _interrupted_enough(server.url, sampling, nothing, lambda got, resumes: resumes >= 2)
    )
    assert ref.finish_reason == "length" and len(ref.output_ids) == 400
    assert resumes >= 2, "the request was never interrupted twice: nothing was tested"
    assert got.output_ids == ref.output_ids and got.finish_reason == "length"
    assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert got.prompt_ids == PROMPT and set(token_versions(got)) == {0}


def _hf_logprobs(model_dir, prompt, output):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    lp = torch.log_softmax(logits, -1)
    return torch.tensor([float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)], dtype=torch.float64)


def test_weights_changing_mid_request_give_exact_token_versions(server, models):
    from safetensors.torch import load_file

    from megatron_dapo.embedded_server.tensor_payload import serialize_named_tensors

    new_weights = [sorted(load_file(str(m / "model.safetensors")).items()) for m in models]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=400, sampling_seed=99)

    async def update(admin, k):  # during the first two pauses: versions 1 and 2
        if k < 2:
            async with admin.weight_update_session():
                await admin.update_weights_from_tensor(
                    [serialize_named_tensors(new_weights[k + 1])], weight_version=str(k + 1)
                )

    async def back_to_the_first_model():
        async with SGLangClient(server.url) as admin, admin.weight_update_session():
            await admin.update_weights_from_tensor([serialize_named_tensors(new_weights[0])], weight_version="0")

    _, got, _ = asyncio.run(
        _interrupted_enough(
            server.url,
            sampling,
            update,
            lambda got, resumes: set(token_versions(got)) == {0, 1, 2},
            after_try=back_to_the_first_model,
        )
    )
    versions = torch.tensor(token_versions(got))
    assert len(got.output_ids) == 400 and set(versions.tolist()) == {0, 1, 2}, versions.unique_consecutive()
    assert versions.tolist() == sorted(versions.tolist())
    recorded = torch.tensor(got.logprobs, dtype=torch.float64)
    refs = [_hf_logprobs(m, PROMPT, got.output_ids) for m in models]
    for v, ref in enumerate(refs):
        mine = versions == v
        assert (recorded[mine] - ref[mine]).abs().max() < 1e-4, v  # its tokens came from version v ...
        assert (recorded[~mine] - ref[~mine]).abs().max() > 1e-2, v  # ... and the others did not
