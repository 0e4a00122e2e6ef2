"""Integrity manifest of a checkpoint directory: every file's size and SHA-256, written last.

    CKPT/manifest.json   {"format": 1, "algorithm": "sha256", "files": {"rel/path": {"size": N, "sha256": HEX}}}

`write_manifest` hashes every file under the directory (threads: hashlib releases the GIL on large
reads, so a multi-file checkpoint hashes on all cores) and writes the manifest atomically, after
everything else. `verify_manifest` checks that the directory holds exactly the listed files with
the listed sizes and hashes; the first mismatch is a `ManifestError` naming the file. A manifest
detects corruption (flipped bytes, truncated or missing shards, stray files); it is no signature:
whoever can write the checkpoint directory can rewrite it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 8 * 1024 * 1024


class ManifestError(RuntimeError):
    """A checkpoint that does not match its manifest (or has none); the message names the file."""


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> list[str]:
    """Relative paths of every regular file under `root`, the manifest itself excluded, sorted."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST and not rel.startswith(MANIFEST + "."):
                out.append(rel)
    return sorted(out)


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def write_manifest(root: str | Path) -> dict:
    """Hash every file under `root` and write `root/manifest.json` atomically; returns the manifest."""
    root = Path(root)
    rels = _files(root)
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(lambda rel: file_sha256(root / rel), rels))
    manifest = {
        "format": _FORMAT,
        "algorithm": "sha256",
        "files": {rel: {"size": (root / rel).stat().st_size, "sha256": d} for rel, d in zip(rels, digests)},
    }
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    return manifest


def read_manifest(root: str | Path) -> dict:
    """The manifest of `root`, checked for shape (not yet against the files)."""
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ManifestError(f"{path} missing: the checkpoint is incomplete or predates integrity manifests") from None
    except (ValueError, RecursionError) as e:  # truncated, not UTF-8, not JSON
        raise ManifestError(f"{path} is not a valid manifest ({type(e).__name__}: {str(e)[:80]})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == _FORMAT
        and isinstance(files, dict)
        and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
        and all(_is_relative(rel) for rel in files)
    )
    if not ok:
        raise ManifestError(f"{path} is not a valid manifest (format {_FORMAT}, relative paths -> size, sha256)")
    return manifest


def _is_relative(rel: str) -> bool:
    return bool(rel) and not rel.startswith("/") and ".." not in rel.split("/")


def verify_manifest(root: str | Path, subdir: str | None = None) -> None:
    """Raise ManifestError unless the files under `root` (or only under `root/subdir`) match its manifest."""
    root = Path(root)
    listed = read_manifest(root)["files"]
    prefix = "" if subdir is None else subdir.rstrip("/") + "/"
    listed = {rel: v for rel, v in listed.items() if rel.startswith(prefix)}
    present = [rel for rel in _files(root) if rel.startswith(prefix)]
    for rel in present:
        if rel not in listed:
            raise ManifestError(f"{root / rel}: file not in the checkpoint's manifest (added after the save?)")
    for rel, want in listed.items():
        path = root / rel
        if not path.is_file():
            raise ManifestError(f"{path}: listed in the manifest but missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise ManifestError(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or replaced)")
    rels = sorted(listed)
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(lambda rel: file_sha256(root / rel), rels))
    for rel, digest in zip(rels, digests):
        if digest != listed[rel]["sha256"]:
            raise ManifestError(f"{root / rel}: SHA-256 differs from the manifest (the file is corrupt)")
