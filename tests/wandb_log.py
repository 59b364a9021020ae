"""Reading an offline W&B run back, for tests: the records of a run-<id>.wandb file.

wandb 0.31 has no public reader for offline runs, so this parses the transaction log itself (a LevelDB-style
log of protobuf records). The trainer never reads its W&B files; only the tests that check what was logged
(and that a resumed run continues the same W&B run) do.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records
_FILE_HEADER = 7  # ":W&B" + magic 0xBEE1 + version byte


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log (bad header)")
    out: list[bytes] = []
    pos, partial = _FILE_HEADER, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block tail too short for a record header is zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if pos + length > len(data):  # the writer is mid-record: the tail is not on disk yet
            break
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            break
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            partial = chunk
        elif kind == 3:  # middle
            partial += chunk
        elif kind == 4:  # last
            out.append(partial + chunk)
    return out


def read_wandb_file(path: str | Path) -> dict[str, Any]:
    """Parse a run-<id>.wandb file: {"run_id", "config", "history": [{key: value}], "summary", "finished"}."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    # finished: the exit record is written (the W&B service may still be flushing just after finish()).
    result: dict[str, Any] = {"run_id": None, "config": {}, "history": [], "summary": {}, "finished": False}

    def key_of(item: Any) -> str:
        return item.key or "/".join(item.nested_key)

    for raw in _records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            result["run_id"] = rec.run.run_id
            for item in rec.run.config.update:
                result["config"][key_of(item)] = json.loads(item.value_json)
        elif kind == "history":
            result["history"].append({key_of(it): json.loads(it.value_json) for it in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                result["summary"][key_of(item)] = json.loads(item.value_json)
        elif kind == "exit":
            result["finished"] = True
    return result


def read_finished_wandb_file(path: str | Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """read_wandb_file once the segment's exit record is on disk (or raise TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    from google.protobuf.message import DecodeError

    while True:
        try:
            rec = read_wandb_file(path)
        except DecodeError:  # read while the service was writing a record: read again
            rec = {"finished": False}
        if rec["finished"]:
            return rec
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no exit record after {timeout_s} s")
        time.sleep(0.1)


def find_wandb_files(run_dir: str | Path, run_id: str) -> list[Path]:
    """The .wandb files of one run id under <run_dir>/wandb, oldest first (one per resumed segment)."""
    files = Path(run_dir, "wandb").glob(f"*-{run_id}/run-{run_id}.wandb")
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))
