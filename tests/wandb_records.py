"""A small reader of W&B's offline transaction log (``run-<id>.wandb``), for the W&B sink's tests.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, a version byte), then
32 KiB blocks of chunks. A chunk is a 7-byte header -- CRC-32 of (type byte + data), data length (uint16), type
(1 full, 2 first, 3 middle, 4 last) -- and its data; a chunk never starts in a block's last 6 bytes (zero padding).
Chunks join into records, each a serialized ``wandb.proto.wandb_internal_pb2.Record`` (wandb's own classes).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILE_HEADER = struct.Struct("<4sHB")
CHUNK_HEADER = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_payloads(path: Path) -> Iterator[bytes]:
    """Every record's bytes, in order. Raises ValueError on a bad header, checksum or chunk sequence."""
    data = Path(path).read_bytes()
    ident, magic, _version = FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    offset, pending = FILE_HEADER.size, bytearray()
    in_record = False
    while offset + CHUNK_HEADER.size <= len(data):
        room = BLOCK - offset % BLOCK
        if room < CHUNK_HEADER.size:  # block trailer
            offset += room
            continue
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, offset)
        if checksum == 0 and length == 0 and kind == 0:  # zero padding at the end of a block or the file
            offset += room
            continue
        start = offset + CHUNK_HEADER.size
        chunk = data[start:start + length]
        if len(chunk) < length:
            break  # a torn last chunk (the writer was killed): stop, like wandb's own reader
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: checksum mismatch at byte {offset}")
        offset = start + length
        if kind == FULL:
            yield bytes(chunk)
        elif kind == FIRST:
            pending, in_record = bytearray(chunk), True
        elif kind in (MIDDLE, LAST) and in_record:
            pending += chunk
            if kind == LAST:
                yield bytes(pending)
                in_record = False
        else:
            raise ValueError(f"{path}: unexpected chunk type {kind} at byte {offset}")


def read_records(path: Path) -> list[Any]:
    """The log's records as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for payload in read_payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def alerts(records: list[Any]) -> list[dict[str, Any]]:
    """The alert records: title, text, level, wait_duration."""
    return [{"title": r.alert.title, "text": r.alert.text, "level": r.alert.level,
             "wait_duration": r.alert.wait_duration} for r in records if r.WhichOneof("record_type") == "alert"]


def history(records: list[Any]) -> list[dict[str, Any]]:
    """The logged history rows, ``{key: value}`` (values JSON-decoded)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_ids(records: list[Any]) -> set[str]:
    """The run ids the log's run records name."""
    return {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}


def transaction_logs(wandb_dir: Path) -> list[Path]:
    """Every ``run-*.wandb`` under ``wandb_dir`` (one per W&B run directory)."""
    return sorted(Path(wandb_dir).rglob("run-*.wandb"))
