"""Checkpoint publication: an interrupted save never replaces the last good checkpoint."""

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo.trainer import checkpoint as ck


def _save(save_dir, step, keep_last=0, payload=None):
    tmp = ck.begin_save(save_dir, step)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(bytes([step % 256]) * 16)
    ck.save_rng(tmp, rank=0)
    ck.write_trainer_state(tmp, {"step": step, "version": step, "world_size": 1, **(payload or {})})
    return ck.commit_save(save_dir, step, keep_last)


def test_latest_points_at_complete_checkpoints_and_prunes(tmp_path):
    assert ck.latest_checkpoint(tmp_path) is None
    for step in (2, 4, 6):
        _save(tmp_path, step, keep_last=2)
    assert ck.latest_checkpoint(tmp_path).name == "step_000006"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000004", "step_000006"]
    assert ck.read_trainer_state(ck.latest_checkpoint(tmp_path))["step"] == 6


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    _save(tmp_path, 3, payload={"version": 4})
    # a save of step 5 dies half-way: model written, trainer.json never
    tmp = ck.begin_save(tmp_path, 5)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(b"partial")
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    with pytest.raises(ck.CheckpointError, match="trainer.json missing"):
        ck.commit_save(tmp_path, 5)
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    assert ck.read_trainer_state(ck.latest_checkpoint(tmp_path)) == {"step": 3, "version": 4, "world_size": 1}
    # the retry of step 5 starts from a clean temporary directory
    _save(tmp_path, 5)
    assert not (tmp_path / "step_000005.tmp").exists()
    assert ck.latest_checkpoint(tmp_path).name == "step_000005"
    # a crash while writing the pointer leaves the old pointer (latest.tmp is never read)
    (tmp_path / "latest.tmp").write_text("step_000009\n")
    assert ck.latest_checkpoint(tmp_path).name == "step_000005"


def test_dangling_pointer_is_a_clear_error(tmp_path):
    (tmp_path / "latest").write_text("step_000042\n")
    with pytest.raises(ck.CheckpointError, match="names step_000042, which is not a complete checkpoint"):
        ck.latest_checkpoint(tmp_path)


def test_rng_round_trip(tmp_path):
    import numpy as np

    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    ck.save_rng(tmp_path, rank=1)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    ck.load_rng(tmp_path, rank=1)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]
    with pytest.raises(ck.CheckpointError, match="rank_00002.json missing"):
        ck.load_rng(tmp_path, rank=2)


# ---------------------------------------------------------------- integrity: manifest, pointer, resume refusal


def _flip(path, offset=0, n=16):
    data = bytearray(path.read_bytes())
    for i in range(offset, min(len(data), offset + n)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_and_names_the_corrupt_one(tmp_path):
    final = _save(tmp_path, 1)
    manifest = json.loads((final / "manifest.json").read_text())["files"]
    assert sorted(manifest) == ["model/weights.bin", "rng/rank_00000.json", "trainer.json"]
    assert manifest["model/weights.bin"] == {"size": 16, "sha256": hashlib.sha256(bytes([1]) * 16).hexdigest()}
    assert ck.find_resume_checkpoint(tmp_path) == final

    _flip(final / "model" / "weights.bin")
    with pytest.raises(ck.CheckpointError, match=r"weights.bin: SHA-256 differs from the manifest"):
        ck.find_resume_checkpoint(tmp_path)
    (final / "model" / "weights.bin").write_bytes(bytes([1]) * 8)  # truncated
    with pytest.raises(ck.CheckpointError, match=r"weights.bin: 8 bytes, the manifest says 16"):
        ck.find_resume_checkpoint(tmp_path)
    (final / "model" / "weights.bin").unlink()
    with pytest.raises(ck.CheckpointError, match=r"weights.bin: listed in the manifest but missing"):
        ck.find_resume_checkpoint(tmp_path)
    (final / "model" / "weights.bin").write_bytes(bytes([1]) * 16)
    (final / "model" / "extra.distcp").write_bytes(b"x")
    with pytest.raises(ck.CheckpointError, match=r"extra.distcp: file not in the checkpoint's manifest"):
        ck.find_resume_checkpoint(tmp_path)
    (final / "model" / "extra.distcp").unlink()
    (final / "manifest.json").write_text('{"format": 1, "files": {"../../etc/passwd": {"size": 1, "sha256": "0"}}}')
    with pytest.raises(ck.CheckpointError, match=r"manifest.json is not a valid manifest"):
        ck.find_resume_checkpoint(tmp_path)
    (final / "manifest.json").write_text('{"format": 1, "fil')
    with pytest.raises(ck.CheckpointError, match=r"manifest.json is not a valid manifest \(JSONDecodeError"):
        ck.find_resume_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"../elsewhere\n", "does not hold a checkpoint name"),
        (b"/tmp/step_000001\n", "does not hold a checkpoint name"),
        (b"\xff\xfe garbage", "does not hold a checkpoint name"),
        (b"step_000009\n", "names step_000009, which is not a complete checkpoint"),
    ],
)
def test_resume_refuses_a_bad_pointer_naming_the_newest_checkpoint(tmp_path, content, match):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != "latest"}
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(ck.CheckpointError, match=match) as e:
        ck.find_resume_checkpoint(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "refusing to start over" in msg and f"echo step_000002 > {tmp_path / 'latest'}" in msg
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != "latest"} == before


def test_resume_without_pointer_refuses_but_an_empty_dir_starts_fresh(tmp_path):
    assert ck.find_resume_checkpoint(tmp_path / "none") is None
    ck.begin_save(tmp_path, 3)  # an interrupted save only: nothing complete to lose
    assert ck.find_resume_checkpoint(tmp_path) is None
    _save(tmp_path, 4)
    (tmp_path / "latest").unlink()
    with pytest.raises(ck.CheckpointError, match=r"no latest pointer; refusing to start over .* step_000004"):
        ck.find_resume_checkpoint(tmp_path)
    # latest naming a symbolic link to a checkpoint elsewhere is refused too
    (tmp_path / "step_000010").symlink_to(tmp_path / "step_000004")
    (tmp_path / "latest").write_text("step_000010\n")
    with pytest.raises(ck.CheckpointError, match="a symbolic link"):
        ck.latest_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"step": 1, "vers', "trainer.json is not valid JSON"),
        ('{"step": 1, "version": 2}', "trainer.json: key 'world_size' missing"),
        (
            '{"step": "1", "version": 2, "world_size": 1}',
            "trainer.json: key 'step' missing or not a non-negative integer",
        ),
        ("[" * 100_000, "trainer.json is not valid JSON"),
        (b"\xff\x00", "trainer.json is not valid JSON"),
    ],
)
def test_broken_trainer_state_is_a_named_error(tmp_path, content, match):
    path = tmp_path / "trainer.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ck.CheckpointError, match=match) as e:
        ck.read_trainer_state(tmp_path)
    assert "\n" not in str(e.value)


def test_rng_state_is_json_and_never_unpickled(tmp_path):
    ck.save_rng(tmp_path, rank=0)
    state = json.loads((tmp_path / "rng" / "rank_00000.json").read_text())
    assert set(state) >= {"python", "numpy", "torch"}
    (tmp_path / "rng" / "rank_00000.json").write_text('{"python": [3, [1, 2], null], "numpy": [], "torch": []}')
    with pytest.raises(ck.CheckpointError, match=r"rank_00000.json: expected RNG states"):
        ck.load_rng(tmp_path, rank=0)
    (tmp_path / "rng" / "rank_00000.json").write_text(
        '{"python": [3, [1, 2], null], "numpy": ["MT19937", [1], 0, 0, 0.0], "torch": [1, 2]}'
    )
    with pytest.raises(ck.CheckpointError, match=r"rank_00000.json: not a valid RNG state"):
        ck.load_rng(tmp_path, rank=0)


class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_crafted_dcp_metadata_is_refused_even_with_a_matching_manifest(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    from megatron_dapo.bridge.manifest import write_manifest

    final = _save(tmp_path, 1)
    dcp.save({"w": torch.arange(4.0), "sched": {"step": 3}}, checkpoint_id=str(final / "model"))  # real DCP passes
    write_manifest(final)
    assert ck.find_resume_checkpoint(tmp_path) == final
    marker = tmp_path / "pwned"
    (final / "model" / ".metadata").write_bytes(pickle.dumps({"x": _RunsShell(marker)}))
    write_manifest(final)  # whoever can write the checkpoint can rewrite its manifest
    with pytest.raises(ck.CheckpointError, match=r"model/.metadata: refers to posix.system, which a checkpoint"):
        ck.find_resume_checkpoint(tmp_path)
    assert not marker.exists()
    (final / "model" / ".metadata").write_bytes(pickle.dumps(torch.nn.Linear))
    write_manifest(final)
    with pytest.raises(ck.CheckpointError, match=r"refers to torch.nn.modules.linear.Linear"):
        ck.find_resume_checkpoint(tmp_path)
    # DCP's non-tensor items are pickles inside the data files, loaded by torch with weights_only=False
    shutil.rmtree(final / "model")
    dcp.save({"w": torch.arange(4.0), "sched": _RunsShell(marker)}, checkpoint_id=str(final / "model"))
    write_manifest(final)
    with pytest.raises(ck.CheckpointError, match=r"\.distcp: item 'sched' is not plain data"):
        ck.find_resume_checkpoint(tmp_path)
    assert not marker.exists()


def test_unwritable_run_and_checkpoint_dirs_are_named_at_setup(tmp_path):
    import os

    from megatron_dapo.config import DapoConfig
    from megatron_dapo.trainer.loop import prepare_output_dirs

    cfg = DapoConfig()
    cfg.logging.run_dir = str(tmp_path / "run")
    prepare_output_dirs(cfg)
    assert (tmp_path / "run" / "checkpoints").is_dir() and not list((tmp_path / "run").glob("tmp*"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg.logging.run_dir = str(blocker / "run")
    with pytest.raises(OSError, match=f"logging.run_dir: cannot write to {blocker / 'run'} \\("):
        prepare_output_dirs(cfg)
    cfg.logging.run_dir = str(tmp_path / "run")
    read_only = Path("/sys/megatron_dapo_test") if os.geteuid() == 0 else tmp_path / "ro"  # root ignores modes
    if os.geteuid() != 0:
        read_only.mkdir(mode=0o555)
    cfg.checkpoint.save_dir = str(read_only / "ckpts")
    with pytest.raises(OSError, match=f"checkpoint.save_dir: cannot write to {read_only / 'ckpts'}"):
        prepare_output_dirs(cfg)
    assert blocker.read_text() == "x"


def test_full_disk_is_one_checkpoint_error_and_removes_the_partial_save(tmp_path):
    """torch.save onto a full disk (/dev/full) fails with "enforce fail at inline_container.cc": the save
    becomes a CheckpointError naming the .tmp and the cause, the .tmp is removed, `latest` is kept."""
    _save(tmp_path, 1)

    def write_model(tmp):
        (tmp / "model").mkdir()
        (tmp / "model" / "common.pt").symlink_to("/dev/full")
        torch.save({"w": torch.arange(200_000.0)}, tmp / "model" / "common.pt")

    def write_state(tmp):
        ck.write_trainer_state(tmp, {"step": 2, "version": 3, "world_size": 1})

    tmp = ck.tmp_dir(tmp_path, 2)
    with pytest.raises(ck.CheckpointError) as e:
        ck.save_collective(tmp_path, 2, write_model, write_state)
    assert f"checkpoint save into {tmp} failed (rank 0: RuntimeError: torch could not write the file" in str(e.value)
    assert "enforce fail" in str(e.value.__cause__)  # what torch said, kept as the cause
    assert not tmp.exists()
    assert ck.latest_checkpoint(tmp_path).name == "step_000001"
    # the disk has room again: the same step saves, as save_collective and in full
    final = ck.save_collective(tmp_path, 2, lambda tmp: (tmp / "model").mkdir(), write_state)
    assert final == ck.latest_checkpoint(tmp_path) and ck.read_trainer_state(final)["step"] == 2


def _in_a_tmpfs_of_its_own(mount_point: Path, size: str, command: list[str]) -> list[str]:
    """`command` in a mount namespace of its own (unshare; a user namespace too when not root) with a
    tmpfs of `size` on `mount_point`: the mount ends with the process, whatever happens to the test. Skips
    the test, saying why, where no such namespace can be made (no unshare, no user namespaces, a container
    without the capability)."""
    import os
    import shlex
    import subprocess

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no `unshare` here: the test needs a small file system (a tmpfs in a mount namespace)")
    prefix = [unshare, "--mount", *(() if os.geteuid() == 0 else ("--map-root-user",))]
    mount = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount_point))}"
    tried = subprocess.run([*prefix, "sh", "-c", mount], capture_output=True, text=True, timeout=30)
    if tried.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs in a mount namespace here ({tried.stderr.strip()[:200]}): the test "
            "needs a small file system"
        )
    return [*prefix, "sh", "-c", f"{mount} && exec {shlex.join(command)}"]


@pytest.mark.slow
def test_a_full_or_read_only_file_system_names_the_os_error_and_keeps_latest(tmp_path):
    """Issue 41: saves onto a real 4 MiB tmpfs, full (torch's writer failing mid-shard with only "unexpected
    pos ..."; trainer.json's own OSError) and read-only, each a CheckpointError naming the OS error (ENOSPC,
    EROFS), with `latest` and the previous checkpoint intact; then the same step saves. The bridge's save
    names ENOSPC too (tests/workers/checkpoint_small_fs.py asserts each case)."""
    import os
    import subprocess
    import sys

    from tests.dist_utils import WORKERS

    fs = tmp_path / "fs"
    fs.mkdir()
    command = _in_a_tmpfs_of_its_own(fs, "4m", [sys.executable, str(WORKERS / "checkpoint_small_fs.py"), str(fs)])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "small fs OK" in out, out[-6000:]
    cases = dict(line[len("CASE ") :].split(": ", 1) for line in out.splitlines() if line.startswith("CASE "))
    assert set(cases) == {"full-shard", "full-trainer-json", "read-only", "bridge"}, out[-4000:]
    assert all("unexpected pos" in cases[c] and "(ENOSPC)" in cases[c] for c in ("full-shard", "bridge")), cases
    assert "(EROFS)" in cases["read-only"]


@pytest.mark.slow
def test_full_disk_in_a_two_rank_megatron_save_fails_every_rank_alike(tmp_path):
    from tests.dist_utils import run_torchrun

    out = run_torchrun("checkpoint_full_disk.py", 2, str(tmp_path), timeout=300)
    assert "rank 0 OK" in out and "rank 1 OK" in out, out[-4000:]
    for step in (2, 3, 4, 5):  # both ranks raised the same error (the free space they saw may differ)
        lines = {
            line.split(": ", 1)[1].split(" MiB free")[0].rsplit("(", 1)[0]
            for line in out.splitlines()
            if line.startswith("rank ") and f"step {step}:" in line
        }
        assert len(lines) == 1, lines
