"""What specdec-run logged to a W&B offline run, read from its run-*.wandb log by hand.

Only this module knows the log's format (it needs nothing of wandb but its protobuf definitions), so
a reader from wandb itself can replace it without the rest of specdec-analyze changing:
``logged_results`` is its interface.

A run-*.wandb file is wandb's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0)
and then LevelDB's log format, 32 KiB blocks of chunks (crc32c, length, type) that reassemble
into protobuf `Record`s as defined by the installed wandb package. The checksums are not checked
(crc32c is not in the standard library); a truncated last record (a killed run) is dropped.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from experiments.analyze import AnalyzeError

WANDB_LOG_HEADER = b":W&B\xe1\xbe\x00"
LOG_BLOCK_BYTES = 32 * 1024
CHUNK_HEADER_BYTES = 7
CHUNK_FULL, CHUNK_FIRST, CHUNK_MIDDLE, CHUNK_LAST = 1, 2, 3, 4


def logged_results(log: Path) -> dict[str, Any]:
    """The summary specdec-run logged to the run, with the run's config under "config"."""
    records = read_wandb_log(log)
    results = _specdec_summary(records, log)
    results["config"] = _wandb_config(records)
    return results


def read_wandb_log(path: Path) -> list[Any]:
    """The protobuf records of a W&B transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data.startswith(WANDB_LOG_HEADER):
        raise AnalyzeError(f"{path} does not start with a W&B log header; it is not a W&B offline run log")
    records, pending, position = [], b"", len(WANDB_LOG_HEADER)
    while position + CHUNK_HEADER_BYTES <= len(data):
        room = LOG_BLOCK_BYTES - position % LOG_BLOCK_BYTES
        if room < CHUNK_HEADER_BYTES:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER_BYTES])
        start = position + CHUNK_HEADER_BYTES
        if kind == 0 or start + length > len(data):  # zero padding, or the run was killed mid-write
            break
        chunk, position = data[start : start + length], start + length
        pending = chunk if kind in (CHUNK_FULL, CHUNK_FIRST) else pending + chunk
        if kind in (CHUNK_FULL, CHUNK_LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _items(items) -> dict[str, Any]:
    """Summary/config update items -> {top-level key: value}."""
    values = {}
    for item in items:
        key = item.key or ".".join(item.nested_key)
        values[key] = json.loads(item.value_json)
    return values


def _specdec_summary(records: list[Any], log: Path) -> dict[str, Any]:
    """The summary specdec-run logged in one update at the end of the run. Later automatic updates
    (wandb copies each history row into the summary) are ignored: they would replace the run's tau
    with the last batch's."""
    for record in reversed(records):
        if record.WhichOneof("record_type") == "summary":
            values = _items(record.summary.update)
            if "speedup" in values:
                return values
    raise AnalyzeError(f"{log} holds no specdec-run summary: the run did not finish, so there is nothing to analyse")


def _wandb_config(records: list[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update(_items(record.run.config.update))
        elif kind == "config":
            config.update(_items(record.config.update))
    config.pop("_wandb", None)
    return config

