"""index.json: what a prepared data directory holds, with a sha256 for every file.

Layout of a data directory:
    index.json          this index
    tokenizer.json      the tokenizer (its sha256 is in the index)
    train/*.tar         webdataset shards; each member "<key>.npy" holds up to sequences_per_member rows
    validation/*.tar    of seq_len + 1 tokens (dtype uint16 or uint32, no pickle)

A data directory may also be remote: a URL ("https://host/data") or a pipe command with a "{path}"
placeholder ("pipe:aws s3 cp s3://bucket/data/{path} -"); files are then opened through webdataset's gopen.
That is for code that passes one explicitly (ShardLoader, read_shard): a config's data.out_dir must be a
local directory, so no config value reaches a shell.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_prep.errors import DataError

INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_VERSION = 1
DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class ShardInfo:
    file: str  # path relative to the data directory, e.g. "train/train-00000.tar"
    sha256: str
    bytes: int
    members: int
    sequences: int
    tokens: int  # sequences * (seq_len + 1)


@dataclass
class DataIndex:
    tokenizer_sha256: str
    vocab_size: int
    seq_len: int  # each stored sequence holds seq_len + 1 tokens (inputs and shifted targets)
    dtype: str  # uint16 | uint32
    eod_id: int
    sequences_per_member: int
    splits: dict[str, list[ShardInfo]]
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # per split: documents, tokens, ...
    config: dict[str, Any] = field(default_factory=dict)  # the data config that produced this directory
    sources: dict[str, Any] = field(default_factory=dict)  # per split: where the text came from
    version: int = INDEX_VERSION
    # Per split prepared from a weighted mixture (data.mixture): its sources in shard order, each
    # {"name", "weight", "shards" (how many of the split's shards, consecutive), "documents", "tokens",
    # "sequences", "dropped_tokens"}. Absent for single-source splits.
    mixture: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def sequences(self, split: str) -> int:
        return sum(s.sequences for s in self.shards(split))

    def shards(self, split: str) -> list[ShardInfo]:
        if split not in self.splits or not self.splits[split]:
            have = ", ".join(k for k, v in self.splits.items() if v) or "none"
            raise DataError(f"the prepared data has no {split!r} split (splits: {have})")
        return self.splits[split]

    def fingerprint(self, split: str) -> str:
        """A short hash of a split's shards: loader states record it to refuse resuming on other data."""
        h = hashlib.sha256()
        for s in self.shards(split):
            h.update(f"{s.file}:{s.sha256}\n".encode())
        for m in self.mixture.get(split, []):  # other weights give another order: not the same stream
            h.update(f"{m['name']}:{m['weight']!r}:{m['shards']}\n".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> str:
        # sorted keys and no timestamps: re-preparing the same input gives a byte-identical index
        d = asdict(self)
        if not d["mixture"]:  # single-source data keeps the index bytes it had before mixtures existed
            del d["mixture"]
        return json.dumps(d, indent=1, sort_keys=True) + "\n"


def data_url(data_dir: Path | str, rel: str) -> str:
    """Where a file of a data directory lives: a local path, a URL, or a pipe command."""
    d = str(data_dir)
    if d.startswith("pipe:"):
        if "{path}" not in d:
            raise DataError(f"a pipe: data directory needs a {{path}} placeholder: {d!r}")
        return d.replace("{path}", rel)
    if "://" in d and not d.startswith("file://"):
        return d.rstrip("/") + "/" + rel
    return os.path.join(d.removeprefix("file://"), rel)


def is_local(data_dir: Path | str) -> bool:
    d = str(data_dir)
    return not d.startswith("pipe:") and ("://" not in d or d.startswith("file://"))


def read_bytes(data_dir: Path | str, rel: str) -> bytes:
    """A whole (small) file of a data directory; DataError naming it when missing or unreadable."""
    url = data_url(data_dir, rel)
    try:
        if is_local(data_dir):
            return Path(url).read_bytes()
        from webdataset.gopen import gopen

        with gopen(url, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"missing {url} (was the data prepared? run `fpa prepare`)") from None
    except Exception as e:  # gopen pipes raise plain Exceptions with the exit status
        raise DataError(f"cannot read {url}: {str(e).splitlines()[0]}") from None


def load_index(data_dir: Path | str) -> DataIndex:
    """Parse and check index.json of a prepared data directory."""
    where = data_url(data_dir, INDEX_FILE)
    try:
        raw = json.loads(read_bytes(data_dir, INDEX_FILE))
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e})") from None
    try:
        if raw.get("version") != INDEX_VERSION:
            raise DataError(f"{where}: index version {raw.get('version')!r}, this code reads {INDEX_VERSION}")
        splits = {name: [ShardInfo(**s) for s in shards] for name, shards in dict(raw.pop("splits")).items()}
        index = DataIndex(splits=splits, **raw)
    except DataError:
        raise
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{where}: malformed index ({type(e).__name__}: {e})") from None
    if index.dtype not in DTYPES:
        raise DataError(f"{where}: dtype must be one of {', '.join(DTYPES)}; got {index.dtype!r}")
    if index.seq_len < 1 or index.vocab_size < 1 or not 0 <= index.eod_id < index.vocab_size:
        raise DataError(f"{where}: bad seq_len / vocab_size / eod_id")
    return index


def write_index(index: DataIndex, data_dir: Path) -> Path:
    path = Path(data_dir) / INDEX_FILE
    path.write_text(index.to_json())
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


_SHA_CACHE: dict[tuple[str, int, int, int], str] = {}


def sha256_cached(path: Path) -> str:
    """sha256_file remembered per (path, inode, size, mtime) for this process: a stage checks the same
    export or index several times (its fingerprint, the producer's record, the checksums), hashing once."""
    st = Path(path).stat()
    k = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if k not in _SHA_CACHE:
        _SHA_CACHE[k] = sha256_file(path)
    return _SHA_CACHE[k]
