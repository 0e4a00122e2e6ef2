"""What a failed write names as its cause (runtime.files.write_failure_text): the OS error by its name,
also where only its text survived (a writer process) or where torch's file writer hid it (then a test
write into the directory speaks). The real full and read-only file systems: tests/trainer/test_checkpoint.py."""

import errno

from megatron_dapo.runtime.files import write_failure_text, write_probe


def test_an_os_error_is_named_by_its_errno_name_through_the_cause_chain(tmp_path):
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("saving failed") from disk_full
    except RuntimeError as e:
        wrapped = e
    assert write_failure_text(wrapped, tmp_path) == "OSError: [Errno 28] No space left on device (ENOSPC)"
    quota = RuntimeError("Worker failure: [Errno 122] Disk quota exceeded")  # only the text crossed over
    assert write_failure_text(quota, tmp_path) == f"RuntimeError: {quota} (EDQUOT)"


def test_torchs_hidden_cause_is_probed_in_the_directory(tmp_path):
    hidden = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    text = write_failure_text(hidden, tmp_path / "not" / "made")  # probed in its nearest existing parent
    assert text == (
        "RuntimeError: torch could not write the file (unexpected pos 704 vs 598); is the disk full? "
        f"(a 1 MiB test write into {tmp_path / 'not' / 'made'} succeeds now)"
    )
    assert list(tmp_path.iterdir()) == []  # the test write left nothing
    # a directory that refuses writes: the probe's own OSError is what the message names
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert write_probe(blocker).errno == errno.ENOTDIR
    assert write_failure_text(hidden, blocker).endswith(f"a test write into {blocker} fails: Not a directory (ENOTDIR)")
