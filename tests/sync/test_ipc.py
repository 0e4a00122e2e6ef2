"""The IPC transport into a real embedded server on loopback: shared-memory handles through
/update_weights_from_tensor, both load formats, buckets bounded by the bucket size, the logprob check."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.rollout.client import SGLangClient
from megatron_dapo.rollout.launcher import embedded_server, start_servers
from megatron_dapo.sync.errors import WeightSyncError
from megatron_dapo.sync.ipc import IpcTransport

pytestmark = pytest.mark.slow
KEY = "ipc-secret"
PROBE = [(7 * i) % 200 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = tmp_path_factory.mktemp("ckpt")
    return {seed: save_tiny_hf_model("qwen3", d / f"s{seed}", seed=seed) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    srv = embedded_server(str(ckpts[0]), tmp_path_factory.mktemp("logs") / "server.log", api_key=KEY)
    start_servers([srv], timeout_s=120)
    yield srv
    srv.stop()


def _weights(ckpt) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(ckpt / "model.safetensors")).items())


def _reference_logprobs(ckpt) -> list[float]:
    """float64 log-softmax of the HF model's logits: token t given tokens < t, t >= 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].double(), -1)
    return [float(lp[t - 1, PROBE[t]]) for t in range(1, len(PROBE))]


def _weight_version(url: str) -> str:
    async def ask():
        async with SGLangClient(url, api_key=KEY) as c:
            return (await c.get_model_info())["weight_version"]

    return asyncio.run(ask())


@pytest.mark.parametrize("flatten", [False, True], ids=["named_tensors", "flattened_bucket"])
def test_ipc_sync_loads_every_tensor_and_passes_the_logprob_check(server, ckpts, flatten):
    seed = 1 if flatten else 2  # each case loads weights the server does not hold yet
    new, ref = _weights(ckpts[seed]), _reference_logprobs(ckpts[seed])
    transport = IpcTransport([server.url], SyncConfig(flatten_bucket=flatten, verify_tolerance=1e-4), api_key=KEY)
    transport.bucket_bytes = 48 * 1024  # several buckets of this small model
    transport.connect()
    try:
        with pytest.raises(WeightSyncError, match="differ from the trainer's"):
            transport.verify(PROBE, ref)  # the server does not hold these weights yet
        stats = transport.sync(iter(new), version=f"v{seed}")
        diff = transport.verify(PROBE, ref)
    finally:
        transport.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in new)
    biggest = max(t.numel() * t.element_size() for _, t in new)
    assert stats.num_tensors == len(new) and stats.nbytes == nbytes
    # buckets bounded by the bucket size: at least as many as a packing at the bound needs
    assert stats.num_buckets >= nbytes // max(transport.bucket_bytes, biggest)
    assert stats.payload_bytes < nbytes / 20  # handles travel, not the tensors
    assert diff < 1e-4
    assert _weight_version(server.url) == f"v{seed}"


def test_ipc_refuses_servers_on_another_host():
    with pytest.raises(ValueError, match=r"servers \['http://192.0.2.1:30000'\] are not on this host"):
        IpcTransport(["http://192.0.2.1:30000", "http://127.0.0.1:30001"])
