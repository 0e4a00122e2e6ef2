"""Read a W&B run file (`run-<id>.wandb`) back: wandb 0.31 ships no reader, so the records are taken
from the file's framing (a LevelDB-style log: a 7-byte header, 32 KiB blocks, records of a CRC-32, a
length and a type, split across blocks as first / middle / last) and parsed with wandb's own protobuf
classes (`wandb.proto.wandb_internal_pb2.Record`)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version 0
CHUNK = struct.Struct("<IHB")  # crc32(type + data), length, type
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B run file ({data[:7]!r})"
    pos, records, pending = HEADER.size, [], b""
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        chunk = data[pos + CHUNK.size : pos + CHUNK.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad checksum at byte {pos}"
        pos += CHUNK.size + length
        pending += chunk
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records


def read_run(path: Path) -> tuple[dict, dict[int, dict]]:
    """(config, {step: {key: value}}) of a run file; nested keys are joined with '/'; a step logged
    several times is merged into one row, as W&B shows it."""
    from wandb.proto import wandb_internal_pb2 as pb

    config, history = {}, {}
    for raw in raw_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history.setdefault(int(row["_step"]), {}).update(row)
    return config, history
