"""File writes that never leave a half-written file behind, and what a failed write names as its cause."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through `path.tmp`, fsynced, then renamed: a crash keeps the old file or
    the new one, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


PROBE_BYTES = 1 << 20  # a test write after a failed one: more than a full disk's last free blocks
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
# torch's C++ file writer (zip container / iostream) reports a failed write with no errno: an enforce
# failure ("unexpected pos 704 vs 598", "file write failed") or an iostream state
_TORCH_WRITER = re.compile(r"\[enforce fail at [^\]]*\]\s*\.?\s*|basic_ios::clear")


def errno_name(number: int) -> str:
    """ENOSPC for 28: the name a person searches for."""
    return errno.errorcode.get(number, f"errno {number}")


def write_probe(directory: str | Path, size: int = PROBE_BYTES) -> OSError | None:
    """Write `size` bytes into a new file of `directory` (or of its nearest existing parent), fsync, remove
    it: the OSError that raised (a full disk, a quota, a read-only file system), or None if it worked."""
    where = Path(directory)
    while not where.exists() and where != where.parent:
        where = where.parent
    path = where / f".write_probe.{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            chunk, left = bytes(1 << 16), size
            while left > 0:
                left -= os.write(fd, chunk[: min(left, len(chunk))])
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return None


def save_failure_text(error: BaseException, directory: str | Path, rank: int | None = None) -> str:
    """`write_failure_text` of a failed checkpoint save, as 'rank N: ...' (when `rank` is given); torch's
    CheckpointException (a BaseException megatron-core raises when a writer failed) gives each failed
    rank's, joined. Every such rank's test write goes into `directory`."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        return "; ".join(save_failure_text(e, directory, r) for r, (e, _) in sorted(error.failures.items()))
    text = write_failure_text(error, directory)
    return text if rank is None else f"rank {rank}: {text}"


def write_failure_text(error: BaseException, directory: str | Path) -> str:
    """'Type: message' of why a write into `directory` failed, with the OS error named (No space left on
    device (ENOSPC), Disk quota exceeded (EDQUOT), Read-only file system (EROFS), ...). The innermost cause
    speaks; when it carries no errno (torch's own file writer hides it) a test write into `directory` tells
    whether the file system refuses writes, and with which error. Call it before the partial files are
    removed: they hold the space a full disk lacks."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).splitlines()[0] if str(error) else ""
    number = getattr(error, "errno", None) if isinstance(error, OSError) else None
    if number is None and (found := _ERRNO_IN_TEXT.search(text)):  # an OSError's text, from a writer process
        number = int(found.group(1))
    if number is not None:
        return f"{type(error).__name__}: {text} ({errno_name(number)})"
    torch_writer = _TORCH_WRITER.search(text) is not None
    if torch_writer:
        text = f"torch could not write the file ({_TORCH_WRITER.sub('', text)})"
    probe = write_probe(directory)
    if probe is not None and probe.errno is not None:
        text += f"; a test write into {directory} fails: {probe.strerror} ({errno_name(probe.errno)})"
    elif torch_writer:
        text += f"; is the disk full? (a {PROBE_BYTES >> 20} MiB test write into {directory} succeeds now)"
    return f"{type(error).__name__}: {text}"
