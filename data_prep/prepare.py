"""Corpus -> tokenizer -> webdataset shards + index.json, atomically.

`prepare_data(cfg, out_dir)` builds everything in a temporary directory next to out_dir and swaps it in
only when complete, so a failure (bad input, disk full, Ctrl-C) leaves a previous good output untouched.
The same input and config give byte-identical shards, tokenizer and index (no timestamps are stored).

Splits: the train source feeds "train"; "validation" comes from its own source, or (none given) from the
last `val_fraction` of the train documents; each `extra_validation` source is a held-out split of its
name. The tokenizer is trained on the train documents only, before any synthetic passkey documents are
mixed in, so the passkey mix does not change the vocabulary.

Passkey mix (cfg.passkey_mix > 0): round(passkey_mix / (1 - passkey_mix) * n_train_docs) whole passkey
documents, so that they are that fraction of the train split's documents,
(data_prep.passkey.passkey_documents) are inserted into the train document stream at positions drawn from
a generator with a fixed seed (data.seed steers the loader's order only, never the bytes on disk); their
filler count is capped so that a document fits one sequence.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import passkey
from data_prep.config import DataConfig, SourceConfig, data_config_dict
from data_prep.errors import DataError
from data_prep.index import (
    INDEX_FILE,
    TOKENIZER_FILE,
    DataIndex,
    load_index,
    sha256_cached,
    sha256_file,
    write_index,
)
from data_prep.shards import SplitWriter, Tagged, TokenizerPool, pick_dtype, stream_batches, tokenize_streams
from data_prep.sources import describe_source, iter_documents, source_label
from data_prep.tokenizer import eod_id, read_tokenizer_file, tokenizer_json, train_tokenizer

# Written last into every output: a directory is prepare's to replace only when this file says so and
# lists every file in it (folder names prove nothing: a corpus may have train/ and validation/ too).
MARKER_FILE = ".fpa-prepare.json"
_PASSKEY_SEED = 0x9A55  # fixed: the passkey documents and their positions are part of the data


def content_config(cfg: DataConfig) -> dict[str, Any]:
    """The config fields that determine the bytes written (not where they go or how many cores)."""
    d = data_config_dict(cfg)
    # seed/shuffle_block only steer the loader; packing is a stream, so batch sizes change no byte
    for k in ("out_dir", "num_workers", "seed", "shuffle_block", "tokenize_batch_docs"):
        d.pop(k, None)
    return d


def content_key(cfg: DataConfig) -> str:
    """A hash of what determines the bytes: the content config and the sources it reads, their files by
    sha256 (the index records sizes only; an edit that keeps a file's size must not count as the same)."""
    try:
        sources: Any = _describe_sources(cfg)
        for desc in sources.values():
            for f in desc.get("files", []):
                f["sha256"] = _cached_sha256(Path(f["path"]))
        if cfg.tokenizer.path:
            sources["tokenizer"] = _cached_sha256(Path(cfg.tokenizer.path).expanduser())
    except (DataError, OSError):  # sources gone: the config alone (such a directory is not current anyway)
        sources = None
    text = json.dumps({"config": content_config(cfg), "sources": sources}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def _cached_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime): one prepare asks for a corpus' key twice."""
    st = path.stat()
    k = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if k not in _SHA_CACHE:
        _SHA_CACHE[k] = sha256_file(path)
    return _SHA_CACHE[k]


def consumable_problem(cfg: DataConfig, out_dir: Path) -> str | None:
    """Why a stage that reads out_dir (training, evaluation, the exports) must not read it under this
    config (None: it may): the index unreadable or changed since prepare wrote it, another content config
    (tokenizer, vocabulary, sequence packing...), or a tokenizer.json that is not the one the index
    records. Unlike data_problem, the corpus the data came from need not be there any more."""
    try:
        index = load_index(out_dir)
    except DataError as e:
        return str(e)
    marker = _read_marker(out_dir)  # absent in directories from before the marker: the index alone
    if marker is not None and marker.get("index_sha256") != sha256_cached(out_dir / INDEX_FILE):
        return f"{out_dir / INDEX_FILE} changed since fpa prepare wrote it"
    if index.config != content_config(cfg):
        return f"{out_dir} was prepared with another content config ({_config_diff(index.config, cfg)})"
    tok = out_dir / TOKENIZER_FILE
    if not tok.is_file():
        return f"{tok} is missing"
    found = sha256_cached(tok)
    if found != index.tokenizer_sha256:
        return (
            f"{tok} is not the tokenizer index.json records (sha256 {index.tokenizer_sha256[:12]} recorded, "
            f"{found[:12]} found): the shards' token ids belong to another tokenizer"
        )
    return None


def data_problem(cfg: DataConfig, out_dir: Path) -> str | None:
    """Why out_dir is not a complete prepared directory made from this config and these sources (None: it
    is). Checks consumable_problem, the sources and every shard's presence and size (not the shards'
    hashes: reading a whole corpus per check would be too slow; every read verifies them)."""
    problem = consumable_problem(cfg, out_dir)
    if problem is not None:
        return problem
    index = load_index(out_dir)
    try:
        if index.sources != _describe_sources(cfg):
            return f"{out_dir} was prepared from other source files"
    except DataError as e:
        return str(e)
    for shards in index.splits.values():
        for s in shards:
            p = out_dir / s.file
            if not p.is_file() or p.stat().st_size != s.bytes:
                return f"shard {p} is missing or not the size index.json records"
    return None


def _config_diff(theirs: dict[str, Any], cfg: DataConfig) -> str:
    """The dotted keys where a recorded content config differs from cfg's, e.g. 'tokenizer.vocab_size'."""

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}{key}.").items()}

    a, b = flat(theirs), flat(content_config(cfg))
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    shown = ", ".join(f"data.{k}: {a.get(k)!r} there, {b.get(k)!r} here" for k in keys[:3])
    return shown + (", ..." if len(keys) > 3 else "") if keys else "the same keys"


def _describe_sources(cfg: DataConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"train": describe_source(cfg.train)}
    if cfg.mixture:  # a mixture is the train split: its sources by name, with their weights
        out["train"] = {
            "mixture": {
                name: {**describe_source(src), "weight": src.weight} for name, src in cfg.mixture.items()
            }
        }
    if cfg.validation is not None:
        out["validation"] = describe_source(cfg.validation)
    elif cfg.val_fraction > 0:
        out["validation"] = {"from_train_fraction": cfg.val_fraction}
    for name, src in cfg.extra_validation.items():
        out[name] = describe_source(src)
    return out


def prepare_data(
    cfg: DataConfig,
    out_dir: Path,
    *,
    progress: bool = True,
    shared: bool = False,
    reuse: bool = False,
    merge: bool = False,
) -> dict[str, Any]:
    """Write out_dir/{tokenizer.json, index.json, train/*.tar, validation/*.tar}; return a summary.

    merge: instead of reading the sources, pack the token streams that prepare_part wrote for each of
    data.prepare_parts parts (see prepare_plan) into the same shards a one-process prepare writes; the
    parts' folder is removed once the data is in place.

    An existing out_dir is replaced only when prepare wrote everything in it (its marker file lists it).
    shared: other runs may use out_dir (an explicit data.out_dir): data made from another content config
    is refused, never replaced. reuse: a complete out_dir made from this content config is kept as it is
    (summary["reused"] is True) instead of being written again.

    Summary keys: out_dir, splits (per split: documents, passkey_documents, tokens, sequences,
    dropped_tokens, shards, bytes), tokens, sequences, shards, tokenizer_trained, tokenizer_seconds,
    seconds, tokens_per_s.
    """
    out_dir = Path(out_dir)
    key = content_key(cfg)  # of the sources as they are now, before they are read
    mine = cfg if shared else None
    if reuse and (summary := _reusable(cfg, out_dir, key)) is not None:
        return summary
    _check_replaceable(out_dir, mine, key)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.parent):
        # again under the lock: another process may have written there meanwhile (the same data or not)
        if reuse and (summary := _reusable(cfg, out_dir, key)) is not None:
            return summary
        _check_replaceable(out_dir, mine, key)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if merge:
                summary = _merge_into(cfg, tmp, parts_dir(out_dir), key, progress=progress)
            else:
                with _rayon_threads(cfg.num_workers):
                    summary = _prepare_into(cfg, tmp, progress=progress)
            _write_marker(tmp, key)
            _swap_in(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if merge:
        shutil.rmtree(parts_dir(out_dir), ignore_errors=True)
    summary["out_dir"] = str(out_dir)
    return summary


def reusable_data(cfg: DataConfig, out_dir: Path) -> bool:
    """True when out_dir is a complete directory that prepare made from this content config."""
    return _reusable(cfg, Path(out_dir), content_key(cfg)) is not None


def _reusable(cfg: DataConfig, out_dir: Path, key: str) -> dict[str, Any] | None:
    """The summary of an existing complete out_dir made by prepare from this content (None: not such)."""
    marker = _read_marker(out_dir)
    if marker is None or marker.get("content_key") != key or data_problem(cfg, out_dir) is not None:
        return None
    index = load_index(out_dir)
    splits = {
        name: {**index.stats.get(name, {}), "shards": len(shards), "bytes": sum(s.bytes for s in shards)}
        for name, shards in index.splits.items()
    }
    return {
        "out_dir": str(out_dir),
        "reused": True,
        "splits": splits,
        "tokens": sum(s.get("tokens", 0) for s in index.stats.values()),
        "sequences": sum(index.sequences(name) for name in index.splits if index.splits[name]),
        "shards": sum(len(v) for v in index.splits.values()),
        "vocab_size": index.vocab_size,
    }


def _write_marker(root: Path, key: str) -> None:
    """The last file of an output: what made it and every file it holds (deterministic bytes)."""
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    index_sha = sha256_file(root / INDEX_FILE)  # the index holds the other files' hashes
    marker = {"written_by": "fpa prepare", "content_key": key, "files": files, "index_sha256": index_sha}
    (root / MARKER_FILE).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(marker, dict) and isinstance(marker.get("files"), list)
    return marker if ok and marker.get("written_by") == "fpa prepare" else None


@contextlib.contextmanager
def _rayon_threads(n: int) -> Iterator[None]:
    """data.num_workers > 0: tokenizers' Rust pool size. The pool reads RAYON_NUM_THREADS once, at its
    first use in the process, so this only takes effect when prepare tokenizes first; the variable is
    removed again so that child processes do not inherit it."""
    if n <= 0 or "RAYON_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["RAYON_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        os.environ.pop("RAYON_NUM_THREADS", None)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on a directory: concurrent prepares into one place (say, every rank of a job
    calling prepare) run one after the other instead of racing on the final rename. No lock file is left
    behind. Local file systems only; on NFS the lock may be advisory per node."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _check_replaceable(out_dir: Path, shared: DataConfig | None = None, key: str | None = None) -> None:
    """Refuse (DataError, one line) to replace an out_dir holding anything prepare did not write there.

    shared: this run's config when other runs may use out_dir; prepared data made from another content
    config (or other sources) is then refused too: it may be what they train on. key: its content_key.
    """
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise DataError(f"data output {out_dir} exists and is not a directory")
    if not out_dir.is_dir():
        return
    found = _entries(out_dir)
    if all(e.endswith("/") for e in found):
        return  # no files, only (empty) folders: nothing to lose
    marker = _read_marker(out_dir)
    if marker is None:
        raise DataError(
            f"refusing to replace {out_dir}: it was not written by fpa prepare (no {MARKER_FILE}, which "
            f"older versions did not write either) and holds {_names(found)}; move it away or choose "
            f"another data.out_dir"
        )
    ours = {MARKER_FILE, *marker["files"]}
    ours |= {f"{parent}/" for f in marker["files"] for parent in Path(f).parents if parent != Path(".")}
    extra = [e for e in found if e not in ours]
    if extra:
        raise DataError(
            f"refusing to replace {out_dir}: it holds files fpa prepare did not write ({_names(extra)}); "
            f"move them elsewhere or choose another data.out_dir"
        )
    if shared is not None and marker.get("content_key") != (key or content_key(shared)):
        try:
            theirs = load_index(out_dir).config
        except DataError:
            theirs = None
        why = _config_diff(theirs, shared) if theirs is not None else "its index.json is unreadable"
        if theirs == content_config(shared):
            why = "the same config, other source files"
        raise DataError(
            f"data.out_dir {out_dir} holds data prepared with another content config ({why}); other runs "
            f"may train on it, so it is not replaced: give this run its own data.out_dir, or delete "
            f"{out_dir} if no run needs it"
        )


def _entries(root: Path) -> list[str]:
    """Every path under root, relative; folders end in '/', symbolic links in '@' (never followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for name in sorted(dirnames) + sorted(filenames):
            p = Path(dirpath) / name
            tag = "@" if p.is_symlink() else "/" if name in dirnames else ""
            out.append(f"{rel / name}{tag}")
    return sorted(out)


def _names(entries: list[str]) -> str:
    return ", ".join(entries[:3]) + ("..." if len(entries) > 3 else "")


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Replace out_dir by tmp; the old directory is renamed aside first and removed only afterwards."""
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        out_dir.rename(old)
        try:
            tmp.rename(out_dir)
        except BaseException:
            old.rename(out_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)


def _count(docs: Iterable[str]) -> int:
    return sum(1 for _ in docs)


@dataclass
class _Stream:
    """One document stream that becomes shards: a split, or one mixture source of the train split."""

    split: str
    name: str  # shard file prefix: the split's name, or the mixture source's
    label: str  # names the source in error messages
    docs: Callable[[], Iterable[str]]  # a fresh pass over the documents
    n_docs: int | None  # known count (progress bar), or None
    passkey: int = 0  # passkey documents mixed in (counted in n_docs)
    weight: float | None = None  # mixture sources only


@dataclass
class _TrainSource:
    name: str
    src: SourceConfig
    label: str
    n_train: int | None  # None: not counted (no split point or passkey mix needs it)
    n_val: int  # documents at its end held out for validation (val_fraction, no validation source)

    def train_docs(self, cfg: DataConfig) -> Iterator[str]:
        return itertools.islice(iter_documents(self.src, max_doc_chars=cfg.max_doc_chars), self.n_train)

    def val_docs(self, cfg: DataConfig) -> Iterator[str]:
        return itertools.islice(iter_documents(self.src, max_doc_chars=cfg.max_doc_chars), self.n_train, None)


def _train_sources(cfg: DataConfig, count: bool = False) -> list[_TrainSource]:
    """The train split's sources, counted where the split point or the passkey mix needs it, or `count`
    (a full read of the source: only then)."""
    out = []
    hold_out = cfg.validation is None and cfg.val_fraction > 0
    for name, src in cfg.train_sources().items():
        label = f"data.mixture.{name} ({source_label(src)})" if cfg.mixture else source_label(src)
        n_train, n_val = None, 0
        if hold_out or cfg.passkey_mix > 0 or count:
            n_source = _count(iter_documents(src, max_doc_chars=cfg.max_doc_chars))
            if n_source == 0:
                raise DataError(f"{label}: no text (every document is empty)")
            if hold_out:
                n_val = max(1, round(n_source * cfg.val_fraction))
                if n_val >= n_source:
                    raise DataError(
                        f"{label}: only {n_source} documents, too few to hold out "
                        f"data.val_fraction={cfg.val_fraction} for validation"
                    )
            n_train = n_source - n_val
        out.append(_TrainSource(name, src, label, n_train, n_val))
    return out


def _streams(cfg: DataConfig, train: list[_TrainSource], tok: Any) -> list[_Stream]:
    """Every stream to write, in order: the train source(s), validation, the extra held-out splits."""
    out = []
    for t in train:
        n_passkey = 0
        docs: Callable[[], Iterable[str]] = functools.partial(t.train_docs, cfg)
        if cfg.passkey_mix > 0:  # single source only (DataConfig refuses it with a mixture)
            assert t.n_train is not None
            n_passkey = passkey_count(cfg.passkey_mix, t.n_train)
            docs = functools.partial(_mix_passkey, docs, t.n_train, n_passkey, cfg, tok)
        n = None if t.n_train is None else t.n_train + n_passkey
        weight = t.src.weight if cfg.mixture else None  # type: ignore[attr-defined]
        out.append(_Stream("train", t.name, t.label, docs, n, n_passkey, weight))
    if cfg.validation is not None:
        val = cfg.validation
        docs = functools.partial(iter_documents, val, max_doc_chars=cfg.max_doc_chars)
        out.append(_Stream("validation", "validation", source_label(val), docs, None))
    elif any(t.n_val for t in train):

        def tails() -> Iterator[str]:
            for t in train:
                yield from t.val_docs(cfg)

        n_val = sum(t.n_val for t in train)
        out.append(_Stream("validation", "validation", "the validation documents", tails, n_val))
    for name, src in cfg.extra_validation.items():
        docs = functools.partial(iter_documents, src, max_doc_chars=cfg.max_doc_chars)
        out.append(_Stream(name, name, f"data.extra_validation.{name} ({source_label(src)})", docs, None))
    return out


def _train_tokenizer(cfg: DataConfig, train: list[_TrainSource], progress: bool) -> tuple[bytes, Any, bool]:
    """The tokenizer's bytes and object: trained on the train documents of every train source (before
    any passkey documents, unweighted), or the configured file verbatim."""
    if cfg.tokenizer.path:
        raw, tok = read_tokenizer_file(cfg.tokenizer.path)
        return raw, tok, False

    def docs() -> Iterator[str]:
        for t in train:
            yield from t.train_docs(cfg)

    counts = [t.n_train for t in train]
    length = None if None in counts else sum(c for c in counts if c is not None)
    tok = train_tokenizer(docs(), cfg.tokenizer, length=length, progress=progress)
    return tokenizer_json(tok), tok, True


def _check_stream(stream: _Stream, writer: SplitWriter, shards: list[Any], cfg: DataConfig) -> None:
    # checked after the fact: no extra read of the source
    if writer.stats.documents == stream.passkey:
        raise DataError(f"{stream.label}: no text (every document is empty)")
    if not shards:
        raise DataError(
            f"{stream.label}: {writer.stats.tokens} tokens do not fill one sequence of "
            f"data.seq_len + 1 = {cfg.seq_len + 1} tokens"
        )


def _prepare_into(cfg: DataConfig, root: Path, *, progress: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    train = _train_sources(cfg)
    t_tok = time.perf_counter()
    raw, tok, trained = _train_tokenizer(cfg, train, progress)
    tok_seconds = time.perf_counter() - t_tok
    where = str(cfg.tokenizer.path) if cfg.tokenizer.path else "the trained tokenizer"
    eod = eod_id(tok, cfg.tokenizer.eod_token, where)
    vocab_size = tok.get_vocab_size()
    dtype = pick_dtype(vocab_size)
    (root / TOKENIZER_FILE).write_bytes(raw)

    written = []
    streams = _streams(cfg, train, tok)
    with (
        _tokenizer_pool(cfg, tok) as pool,
        _tokenize(tok, (s.docs() for s in streams), eod, dtype, cfg, pool) as tagged,
    ):
        for k, stream in enumerate(streams):
            writer = _writer(root, stream.split, cfg, dtype, stream.name)
            _write_split(writer, stream_batches(tagged, k), stream.n_docs, progress)
            shards = writer.close()
            _check_stream(stream, writer, shards, cfg)
            written.append((stream, shards, {**writer.stats.as_dict(), "passkey_documents": stream.passkey}))
    return _finish(cfg, root, raw, vocab_size, dtype, eod, written, trained, tok_seconds, t0)


def _finish(
    cfg: DataConfig,
    root: Path,
    raw: bytes,
    vocab_size: int,
    dtype: str,
    eod: int,
    written: list[tuple[_Stream, list[Any], dict[str, int]]],
    trained: bool,
    tok_seconds: float,
    t0: float,
) -> dict[str, Any]:
    """index.json from the written streams (a mixture's sources summed into its split) and the summary."""
    splits: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    mixture: dict[str, list[dict[str, Any]]] = {}
    for stream, shards, st in written:
        splits.setdefault(stream.split, []).extend(shards)
        total = stats.setdefault(stream.split, dict.fromkeys(st, 0))
        for k, v in st.items():
            total[k] += v
        if stream.weight is not None:
            entry = {"name": stream.name, "weight": stream.weight, "shards": len(shards), **st}
            mixture.setdefault(stream.split, []).append(entry)
    index = DataIndex(
        tokenizer_sha256=hashlib.sha256(raw).hexdigest(),
        vocab_size=vocab_size,
        seq_len=cfg.seq_len,
        dtype=dtype,
        eod_id=eod,
        sequences_per_member=cfg.sequences_per_member,
        splits=splits,
        stats=stats,
        config=content_config(cfg),
        sources=_describe_sources(cfg),
        mixture=mixture,
    )
    write_index(index, root)

    seconds = time.perf_counter() - t0
    split_summary = {
        name: {**stats[name], "shards": len(shards), "bytes": sum(s.bytes for s in shards)}
        for name, shards in splits.items()
    }
    for split, entries in mixture.items():
        split_summary[split]["sources"] = source_summary(entries)
    tokens = sum(s["tokens"] for s in stats.values())
    return {
        "splits": split_summary,
        "tokens": tokens,
        "sequences": sum(s["sequences"] for s in stats.values()),
        "shards": sum(len(v) for v in splits.values()),
        "vocab_size": vocab_size,
        "tokenizer_trained": trained,
        "tokenizer_seconds": tok_seconds,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"),
    }


# ----------------------------------------------------------------------------------------------------
# Prepare in parts (a Slurm job array): plan once, tokenize N slices anywhere, merge into one directory.
#
#   prepare_plan(cfg, out)       counts every stream's documents, trains the tokenizer (once), writes
#                                <out>.parts/{tokenizer.json, plan.json}
#   prepare_part(cfg, out, i)    tokenizes documents [D*i//N, D*(i+1)//N) of each stream (D documents,
#                                N = data.prepare_parts) into <out>.parts/part-0000i/ (raw token streams)
#   prepare_data(cfg, out, merge=True)   concatenates the parts' streams in part order and packs them
#
# The token stream of each split is the one a one-process prepare makes (documents in the same order,
# each encoded alone), so the shards, index and marker are byte-identical to it whatever N is.

PLAN_FILE = "plan.json"
PART_DONE = "done.json"


def parts_dir(out_dir: Path) -> Path:
    """Where the plan and the parts of a prepare in parts go: beside out_dir, removed by the merge."""
    out_dir = Path(out_dir)
    return out_dir.parent / f"{out_dir.name}.parts"


def _part_dir(parts: Path, i: int) -> Path:
    return parts / f"part-{i:05d}"


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.rename(path)


def prepare_plan(
    cfg: DataConfig, out_dir: Path, *, progress: bool = True, shared: bool = False
) -> dict[str, Any]:
    """Step 1 of a prepare in parts: the tokenizer, trained once, and every stream's document count."""
    out_dir = Path(out_dir)
    key = content_key(cfg)
    _check_replaceable(out_dir, cfg if shared else None, key)  # refused now, not after the array ran
    parts = parts_dir(out_dir)
    kept = _current_plan(cfg, parts, key)
    if kept is not None:  # a launch again after a failed part: the plan and finished parts stand
        return kept
    if parts.exists():  # a plan of another config or parts count: its parts must not be merged
        shutil.rmtree(parts)
    parts.mkdir(parents=True)
    t0 = time.perf_counter()
    train = _train_sources(cfg, count=True)
    raw, tok, trained = _train_tokenizer(cfg, train, progress)
    tok_seconds = time.perf_counter() - t0
    (parts / TOKENIZER_FILE).write_bytes(raw)
    streams = []
    for stream in _streams(cfg, train, tok):
        n = stream.n_docs if stream.n_docs is not None else _count(stream.docs())
        streams.append({"split": stream.split, "name": stream.name, "documents": n})
    plan = {
        "content_key": key,
        "parts": cfg.prepare_parts,
        "tokenizer_sha256": hashlib.sha256(raw).hexdigest(),
        "tokenizer_trained": trained,
        "tokenizer_seconds": tok_seconds,
        "train": [{"name": t.name, "n_train": t.n_train, "n_val": t.n_val} for t in train],
        "streams": streams,
    }
    _write_json_atomic(parts / PLAN_FILE, plan)
    return plan


def _current_plan(cfg: DataConfig, parts: Path, key: str) -> dict[str, Any] | None:
    """The plan in `parts` when it was made for this content and parts count and its tokenizer is intact."""
    try:
        plan = _read_plan(cfg, parts, key)
        raw = (parts / TOKENIZER_FILE).read_bytes()
    except (DataError, OSError):
        return None
    return plan if hashlib.sha256(raw).hexdigest() == plan["tokenizer_sha256"] else None


def _finished_part(parts: Path, part: int, plan: dict[str, Any]) -> dict[str, Any] | None:
    """A part's done.json when it belongs to this plan and its token files are whole (None: redo it)."""
    d = _part_dir(parts, part)
    try:
        rec = json.loads((d / PART_DONE).read_text())
    except (OSError, ValueError):
        return None
    mine = (rec.get("content_key"), rec.get("tokenizer_sha256"), rec.get("parts"), rec.get("part"))
    if mine != (plan["content_key"], plan["tokenizer_sha256"], plan["parts"], part):
        return None
    for k, st in enumerate(rec.get("streams", [])):
        f = d / f"stream-{k:03d}.u32"
        if not f.is_file() or f.stat().st_size != 4 * st["tokens"]:
            return None
    return rec if len(rec.get("streams", [])) == len(plan["streams"]) else None


def _read_plan(cfg: DataConfig, parts: Path, key: str) -> dict[str, Any]:
    try:
        plan = json.loads((parts / PLAN_FILE).read_text())
    except (OSError, ValueError):
        raise DataError(f"no prepare plan at {parts / PLAN_FILE}: run the plan step first") from None
    if plan.get("content_key") != key or plan.get("parts") != cfg.prepare_parts:
        raise DataError(
            f"{parts / PLAN_FILE} was made for another content config or another data.prepare_parts "
            f"({plan.get('parts')} parts): run the plan step again"
        )
    return plan


def _planned_streams(cfg: DataConfig, plan: dict[str, Any], tok: Any) -> list[_Stream]:
    by_name = {t["name"]: t for t in plan["train"]}
    train = [
        _TrainSource(name, src, "", by_name[name]["n_train"], by_name[name]["n_val"])
        for name, src in cfg.train_sources().items()
    ]
    streams = _streams(cfg, train, tok)
    assert [(s.split, s.name) for s in streams] == [(p["split"], p["name"]) for p in plan["streams"]]
    return streams


def prepare_part(cfg: DataConfig, out_dir: Path, part: int) -> dict[str, Any]:
    """Step 2: tokenize this part's slice of every stream into <out>.parts/part-NNNNN/ (uint32 token
    files, written as they come: memory stays flat); done.json is written last."""
    n_parts = cfg.prepare_parts
    if not 0 <= part < n_parts:
        raise DataError(f"prepare part {part} is outside 0..{n_parts - 1} (data.prepare_parts={n_parts})")
    parts = parts_dir(out_dir)
    plan = _read_plan(cfg, parts, content_key(cfg))
    raw, tok = read_tokenizer_file(parts / TOKENIZER_FILE)
    if hashlib.sha256(raw).hexdigest() != plan["tokenizer_sha256"]:
        raise DataError(
            f"{parts / TOKENIZER_FILE} does not match {parts / PLAN_FILE}: run the plan step again"
        )
    if (done := _finished_part(parts, part, plan)) is not None:  # a relaunch: this part stands
        return {**done, "kept": True}
    eod = eod_id(tok, cfg.tokenizer.eod_token)
    final = _part_dir(parts, part)
    tmp = parts / f".part-{part:05d}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.perf_counter()
    out: list[dict[str, int]] = []
    try:
        streams = _planned_streams(cfg, plan, tok)
        # this part's slice [lo, hi) of each stream's documents
        bounds = [
            (p["documents"] * part // n_parts, p["documents"] * (part + 1) // n_parts)
            for p in plan["streams"]
        ]
        docs = (itertools.islice(s.docs(), lo, hi) for s, (lo, hi) in zip(streams, bounds))
        with (
            _rayon_threads(cfg.num_workers),
            _tokenizer_pool(cfg, tok) as pool,
            _tokenize(tok, docs, eod, "uint32", cfg, pool) as tagged,
        ):
            for k, (stream, (lo, hi)) in enumerate(zip(streams, bounds)):
                n_docs = n_tokens = 0
                with open(tmp / f"stream-{k:03d}.u32", "wb") as f:
                    for n, arr in stream_batches(tagged, k):
                        f.write(arr.tobytes())
                        n_docs += n
                        n_tokens += len(arr)
                if n_docs != hi - lo:
                    raise DataError(f"{stream.label}: {n_docs} documents where the plan counted {hi - lo}")
                out.append({"documents": n_docs, "tokens": n_tokens})
        done = {
            "part": part,
            "parts": n_parts,
            "content_key": plan["content_key"],
            "tokenizer_sha256": plan["tokenizer_sha256"],
            "streams": out,
            "seconds": time.perf_counter() - t0,
        }
        _write_json_atomic(tmp / PART_DONE, done)
        if final.exists():  # an earlier attempt of this part (requeued, rerun): replaced whole
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


def _merge_into(cfg: DataConfig, root: Path, parts: Path, key: str, *, progress: bool) -> dict[str, Any]:
    """Step 3 (in prepare_data's temporary directory): check every part, then pack their streams."""
    t0 = time.perf_counter()
    plan = _read_plan(cfg, parts, key)
    n_parts = plan["parts"]
    done = []
    for i in range(n_parts):
        d = _part_dir(parts, i)
        try:
            rec = json.loads((d / PART_DONE).read_text())
        except (OSError, ValueError):
            raise DataError(
                f"prepare part {i} of {n_parts} is missing or did not finish (no {d / PART_DONE}): "
                f"rerun array task {i}, then the merge"
            ) from None
        if rec.get("tokenizer_sha256") != plan["tokenizer_sha256"]:
            raise DataError(
                f"prepare part {i} of {n_parts} ({d}) was tokenized with another tokenizer (sha256 "
                f"{str(rec.get('tokenizer_sha256'))[:12]}..., the plan's is "
                f"{plan['tokenizer_sha256'][:12]}...): rerun array task {i}, then the merge"
            )
        if rec.get("content_key") != key or rec.get("parts") != n_parts or rec.get("part") != i:
            raise DataError(
                f"prepare part {i} of {n_parts} ({d}) belongs to another plan: rerun array task {i}"
            )
        done.append(rec)
    raw, tok = read_tokenizer_file(parts / TOKENIZER_FILE)
    eod = eod_id(tok, cfg.tokenizer.eod_token)
    vocab_size = tok.get_vocab_size()
    dtype = pick_dtype(vocab_size)
    (root / TOKENIZER_FILE).write_bytes(raw)
    written = []
    for k, stream in enumerate(_planned_streams(cfg, plan, tok)):
        writer = _writer(root, stream.split, cfg, dtype, stream.name)
        _write_split(writer, _part_tokens(parts, k, done, dtype), stream.n_docs, progress)
        shards = writer.close()
        _check_stream(stream, writer, shards, cfg)
        written.append((stream, shards, {**writer.stats.as_dict(), "passkey_documents": stream.passkey}))
    summary = _finish(cfg, root, raw, vocab_size, dtype, eod, written, plan["tokenizer_trained"], 0.0, t0)
    summary.update(tokenizer_seconds=plan["tokenizer_seconds"], parts=n_parts)
    return summary


def _part_tokens(
    parts: Path, k: int, done: list[dict[str, Any]], dtype: str, chunk: int = 1 << 24
) -> Iterator[tuple[int, np.ndarray]]:
    """Stream k of every part in part order, in chunks of at most `chunk` tokens (memory stays flat); a
    part's documents are counted with its first chunk."""
    for i, rec in enumerate(done):
        path = _part_dir(parts, i) / f"stream-{k:03d}.u32"
        n = rec["streams"][k]["tokens"]
        if not path.is_file() or path.stat().st_size != 4 * n:
            raise DataError(f"prepare part {i} ({path}) is truncated: rerun array task {i}, then the merge")
        docs = rec["streams"][k]["documents"]
        if n == 0:
            yield docs, np.zeros(0, dtype=dtype)
            continue
        tokens = np.memmap(path, dtype=np.uint32, mode="r", shape=(n,))
        for a in range(0, n, chunk):
            yield (docs if a == 0 else 0), np.asarray(tokens[a : a + chunk]).astype(dtype)
        del tokens


def source_summary(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mixture source: weight, documents, tokens, sequences (from index.json's "mixture")."""
    keys = ("weight", "documents", "tokens", "sequences")
    return {e["name"]: {k: e[k] for k in keys} for e in entries}


def _writer(root: Path, split: str, cfg: DataConfig, dtype: str, name: str | None = None) -> SplitWriter:
    return SplitWriter(
        root,
        split,
        seq_len=cfg.seq_len,
        dtype=dtype,
        sequences_per_member=cfg.sequences_per_member,
        sequences_per_shard=cfg.sequences_per_shard,
        name=name,
    )


def _tokenizer_pool(cfg: DataConfig, tok: Any) -> contextlib.AbstractContextManager[TokenizerPool | None]:
    """data.prepare_processes > 1: worker processes for the whole prepare; else nothing (in process)."""
    if cfg.prepare_processes > 1:
        return TokenizerPool(tok, cfg.prepare_processes, cfg.num_workers)
    return contextlib.nullcontext()


def _tokenize(
    tok: Any,
    streams: Iterable[Iterable[str]],
    eod: int,
    dtype: str,
    cfg: DataConfig,
    pool: TokenizerPool | None,
) -> contextlib.closing[Iterator[Tagged]]:
    """tokenize_streams' (stream, documents, tokens) in order, in this process or in the pool's workers;
    closed on leaving the `with`, which stops its threads (also when a stream fails)."""
    tagged = tokenize_streams(
        tok, streams, eod=eod, dtype=dtype, batch_docs=cfg.tokenize_batch_docs, pool=pool
    )
    return contextlib.closing(tagged)


def _write_split(
    writer: SplitWriter, tokens: Iterable[tuple[int, np.ndarray]], total_docs: int | None, progress: bool
) -> None:
    bar = _progress_bar(progress, total_docs, f"tokenize {writer.name}")
    try:
        for n_docs, arr in tokens:
            writer.add_tokens(arr, n_docs)
            bar(n_docs)
    except BaseException:
        writer.abort()  # its open shard's file; the caller removes the unfinished folder
        raise
    finally:
        bar(None)


def _progress_bar(enabled: bool, total: int | None, desc: str) -> Callable[[int | None], None]:
    """A tqdm bar as a callable: bar(n) advances, bar(None) closes; a no-op when disabled."""
    if not enabled:
        return lambda n: None
    from tqdm import tqdm

    t = tqdm(total=total, desc=desc, unit="doc", dynamic_ncols=True)

    def update(n: int | None) -> None:
        if n is None:
            t.close()
        else:
            t.update(n)

    return update


def passkey_count(mix: float, n_train: int) -> int:
    """Passkey documents to add so they are `mix` of the train split's documents (mix < 1)."""
    return round(mix / (1.0 - mix) * n_train)


def _mix_passkey(
    docs_fn: Callable[[], Iterable[str]], n_train: int, n_passkey: int, cfg: DataConfig, tok: Any
) -> Iterator[str]:
    """The train documents with n_passkey passkey documents inserted at seeded random positions."""
    docs = docs_fn()
    per_filler = len(tok.encode(" " + passkey.FILLER, add_special_tokens=False).ids)
    key = 99999  # passkey_documents' default 5 digits; the longest key bounds the fixed part
    fixed_text = " " + passkey.NEEDLE.format(key=key) + " " + passkey.QUESTION + passkey.answer_text(key)
    fixed = len(tok.encode(fixed_text, add_special_tokens=False).ids)
    # the whole document (fillers, needle, question, answer, eod) fits one sequence
    max_fillers = max(1, (cfg.seq_len - fixed - 1) // max(1, per_filler))
    extra = passkey.passkey_documents(n_passkey, _PASSKEY_SEED, min_fillers=1, max_fillers=max_fillers)
    rng = np.random.default_rng([_PASSKEY_SEED, n_train, n_passkey])
    # slot i of the train stream gets the passkey documents whose position is i (before document i)
    positions = np.sort(rng.integers(0, n_train + 1, size=n_passkey))
    j = 0
    for i, d in enumerate(itertools.chain(docs, [None])):
        while j < n_passkey and positions[j] == i:
            yield extra[j]
            j += 1
        if d is not None:
            yield d
