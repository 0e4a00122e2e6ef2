"""/release_memory_occupation really frees the embedded server's memory (--enable-memory-saver): its
resident set drops by its weights' bytes, requests arriving meanwhile wait (or get a named 503 past
--release-wait-timeout-s), and after resume + a weight update it generates what it generated before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.rollout.client import SGLangClient, SGLangHTTPError
from megatron_dapo.rollout.launcher import embedded_server, start_servers
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.sync.ipc import IpcTransport

KEY = "release-secret"
# large enough that its weights stand out of the process's resident set (~67 MB of float32)
SHAPE = dict(vocab_size=16384, hidden_size=512, intermediate_size=1024, num_hidden_layers=2)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("model"), **SHAPE)


def _weights(ckpt) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(ckpt / "model.safetensors")).items())


@pytest.mark.parametrize("saver,backup", [(False, False), (True, False), (True, True)])
def test_model_memory_frees_and_restores_parameters_as_sglang_memory_saver(saver, backup):
    """No memory saver: nothing freed (SGLang's no-op adapter). With it: every parameter's storage gone on
    release, its shape back on resume, its values back with the CPU backup; buffers kept."""
    from megatron_dapo.embedded_server.memory import ModelMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    model.register_buffer("table", torch.arange(5.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mem = ModelMemory(model, memory_saver=saver, weights_cpu_backup=backup)
    mem.release([])  # [] = every tag, as SGLang
    assert mem.released == {"weights", "kv_cache"}
    freed = all(p.numel() == 0 for p in model.parameters())
    assert freed == saver
    mem.resume(["kv_cache"])
    with pytest.raises(ValueError, match=r"tags \['kv_cache'\] are not released"):
        mem.resume(["kv_cache"])
    mem.resume(["weights"])
    assert not mem.released
    assert {n: p.shape for n, p in model.named_parameters()} == {n: t.shape for n, t in before.items()}
    if not saver or backup:  # without the backup the values are whatever fresh storage holds: not checked
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(model.table, torch.arange(5.0))


@pytest.mark.slow
def test_release_frees_the_weights_and_resume_plus_update_generates_the_same(model, tmp_path):
    weights = _weights(model)
    param_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    srv = embedded_server(
        str(model),
        tmp_path / "server.log",
        api_key=KEY,
        extra_args=["--enable-memory-saver", "--release-wait-timeout-s", "600"],
    )
    start_servers([srv], timeout_s=180)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, sampling_seed=1234)
    try:

        def update(version):
            transport = IpcTransport([srv.url], SyncConfig(flatten_bucket=True), api_key=KEY)
            transport.connect()
            try:
                transport.sync(iter(weights), version=version)
            finally:
                transport.close()

        async def go():
            async with SGLangClient(srv.url, api_key=KEY) as c:
                # every weight written once, so every page of it is resident (a checkpoint loaded lazily
                # leaves the embedding rows no prompt used out of the resident set)
                await asyncio.to_thread(update, "loaded")
                (before,) = await c.generate([5, 6, 7, 8], sp)
                rss_loaded = rss_bytes(srv.proc.pid)
                await c.release_memory_occupation(None)  # weights and kv_cache
                rss_released = rss_bytes(srv.proc.pid)
                # a request arriving during the release waits for the resume (its state: not answered)
                waiting = asyncio.ensure_future(c.generate([5, 6, 7, 8], sp))
                await c.resume_memory_occupation(["weights"])
                # the colocated cycle: the weights come from the next update, before the KV cache resumes
                await asyncio.to_thread(update, "reloaded")
                assert not waiting.done()  # kv_cache is still released: no step has run
                await c.resume_memory_occupation(["kv_cache"])
                (waited,) = await waiting
                (after,) = await c.generate([5, 6, 7, 8], sp)
                return before, after, waited, rss_loaded, rss_released

        before, after, waited, rss_loaded, rss_released = asyncio.run(go())
    finally:
        srv.stop()
    freed = rss_loaded - rss_released
    print(f"param bytes {param_bytes}, RSS {rss_loaded} -> {rss_released} (freed {freed})")
    assert freed >= 0.9 * param_bytes, (freed, param_bytes)
    assert after.output_ids == before.output_ids and waited.output_ids == before.output_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)


@pytest.mark.slow
def test_requests_during_a_release_past_the_timeout_get_a_named_error(model, tmp_path):
    srv = embedded_server(
        str(model),
        tmp_path / "server.log",
        api_key=KEY,
        extra_args=["--enable-memory-saver", "--release-wait-timeout-s", "0.2"],
    )
    start_servers([srv], timeout_s=180)
    try:

        async def go():
            async with SGLangClient(srv.url, api_key=KEY, retries=0) as c:
                await c.release_memory_occupation(["weights"])
                with pytest.raises(SGLangHTTPError) as gen:
                    await c.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
                async with c.weight_update_session():
                    with pytest.raises(SGLangHTTPError) as upd:
                        await c.update_weights_from_tensor([b"unused"])
                with pytest.raises(SGLangHTTPError) as twice:
                    await c.resume_memory_occupation(["kv_cache"])  # never released
                await c.resume_memory_occupation(["weights"])
                return gen.value, upd.value, twice.value

        gen, upd, twice = asyncio.run(go())
    finally:
        srv.stop()
    assert gen.status == 503 and "memory released (tags ['weights'])" in gen.server_message
    assert "--release-wait-timeout-s" in gen.server_message
    assert "the weights are released" in upd.server_message
    assert twice.status == 400 and "['kv_cache'] are not released" in twice.server_message
