"""Issue 24 item 2: checkpoints saved as Megatron-LM saves them by default (args Namespace in the common
state: `common.pt` up to megatron-core 0.16.1, the `common_state` object in the DCP files in 0.19; numpy RNG
state in the `rng_state` ShardedObject, plain or distributed optimizer state) convert through
`megatron-dapo convert megatron-to-hf`, bit-identically; code hidden in those same places is refused by
name before anything runs it. The checkpoints come from tests/workers/megatron_lm_checkpoint.py."""

from __future__ import annotations

import argparse
import io
import os
import re

import pytest
import torch

from megatron_dapo.bridge.cli import main as convert_main
from megatron_dapo.bridge.dcp_metadata import check_dcp_metadata, megatron_safe_globals
from megatron_dapo.bridge.manifest import ManifestError
from megatron_dapo.models.tiny import save_tiny_hf_model
from megatron_dapo.runtime.megatron_compat import COMMON_PT, COMMON_STATE_KEY, common_state_file, read_common_state
from tests.dist_utils import run_torchrun

RNG_ITEM = "rng_state/shard_0.0_1.1"  # ShardedObject('rng_state', ..., (pp, tp) = (1, 1), (0, 0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm")
    hf = save_tiny_hf_model("qwen3_moe", root / "hf", seed=5, mlp_only_layers=[])
    work = root / "work"
    work.mkdir()
    out = run_torchrun("megatron_lm_checkpoint.py", 1, str(hf), str(work), timeout=600)
    assert "CHECK PASSED saved hostile" in out, out[-4000:]
    return hf, work


def _rng_item(iter_dir):
    import torch.distributed.checkpoint as dcp

    state = {RNG_ITEM: io.BytesIO()}
    dcp.load(state, checkpoint_id=str(iter_dir), no_dist=True)
    return state[RNG_ITEM]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_megatron_lm_default_checkpoint_converts_bit_identically(saved, tmp_path, capsys, optimizer):
    from safetensors.torch import load_file

    hf, work = saved
    iter_dir = work / optimizer / "iter_0000005"
    # What the pre-check refused before: numpy's RNG state and an argparse.Namespace.
    ((rng,),) = _rng_item(iter_dir)  # megatron-core stores [ShardedObject.data]; Megatron-LM's data is [state]
    assert rng["np_rng_state"][0] == "MT19937" and {"random_rng_state", "torch_rng_state"} <= set(rng)
    with megatron_safe_globals():
        common = read_common_state(iter_dir)  # torch's weights_only loader, in either format
    assert isinstance(common["args"], argparse.Namespace) and common["iteration"] == 5
    assert "optimizer" in common and "opt_param_scheduler" in common

    out = tmp_path / "hf_out"
    rc = convert_main(["megatron-to-hf", "--ckpt", str(work / optimizer), "--hf-config", str(hf), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    want = torch.load(work / f"{optimizer}_expected.pt")
    assert sorted(got) == sorted(want)
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, different[:4]
    # the trained model is not the HF one it was built from: the comparison is not vacuous
    original = load_file(next(hf.glob("*.safetensors")))
    assert any(not torch.equal(original[n], want[n]) for n in want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, refused",
    [
        ("hostile_rng", rf"__0_\d\.distcp: item '{RNG_ITEM}' is not plain data"),
        ("hostile_nested", rf"__0_\d\.distcp: item '{RNG_ITEM}' is not plain data"),
        ("hostile_args", "COMMON_STATE"),  # where the installed megatron-core saved the common state
        ("hostile_extra_state", r"item 'decoder\.layers\.self_attention\.linear_qkv\._extra_state/shard_0_4' is not"),
    ],
)
def test_code_in_a_megatron_lm_checkpoint_is_refused_by_name(saved, tmp_path, capsys, name, refused):
    hf, work = saved
    if refused == "COMMON_STATE":
        where = common_state_file(work / name / "iter_0000005")
        item = "" if where == COMMON_PT else f"item '{COMMON_STATE_KEY}/shard_0_1' "
        refused = rf"iter_0000005/{re.escape(where)}: {item}is not plain data"
    marker = work / "pwned"
    rc = convert_main(
        ["megatron-to-hf", "--ckpt", str(work / name), "--hf-config", str(hf), "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 1 and re.search(refused, err), err
    assert "posix.system" in err and not marker.exists() and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_check_sets_aside_globals_others_registered(saved):
    """Whatever this process registered with torch (here os.system itself) is not admitted, and is
    registered again afterwards; megatron.core's own registration (it runs on import) is not needed."""
    _, work = saved
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()  # as if megatron.core had never been imported
    try:
        check_dcp_metadata(work / "distributed")
        torch.serialization.add_safe_globals([os.system])
        for name in ("hostile_rng", "hostile_nested", "hostile_args", "hostile_extra_state"):
            with pytest.raises(ManifestError, match="posix.system"):
                check_dcp_metadata(work / name)
        assert os.system in torch.serialization.get_safe_globals()
        assert not (work / "pwned").exists()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickles_nested_in_items_are_checked_each_once(tmp_path):
    import torch.distributed.checkpoint as dcp

    shared = [1]
    for _ in range(80):  # 2**80 paths through 81 objects: each is visited once
        shared = [shared, shared]
    shared = argparse.Namespace(shared=shared)  # DCP's own save would walk the lists every way
    dcp.save({"w": torch.zeros(2), "shared": shared}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    check_dcp_metadata(tmp_path / "ok")

    marker = tmp_path / "pwned"
    inner = io.BytesIO()
    torch.save({"state": _RunsShell(marker)}, inner)
    dcp.save(
        {"w": torch.zeros(2), "rng": argparse.Namespace(a=shared, b=inner)},
        checkpoint_id=str(tmp_path / "bad"),
        no_dist=True,
    )
    with pytest.raises(ManifestError, match=r"item 'rng' is not plain data \(.*GLOBAL posix\.system"):
        check_dcp_metadata(tmp_path / "bad")
    assert not marker.exists()
