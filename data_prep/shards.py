"""Tokenize documents, pack them into fixed-length sequences and write / read webdataset shards.

Packing: every document is followed by the end-of-document token and the token stream is cut into
non-overlapping sequences of seq_len + 1 tokens (inputs = seq[:-1], targets = seq[1:]); the tail of a
split that does not fill a sequence is dropped and counted. Documents are not aligned to sequence starts.

Storage: `sequences_per_member` sequences per tar member, as a .npy array of shape (n, seq_len + 1)
(uint16 when the vocabulary fits, else uint32; never pickled): one member per sequence would cost +50% on
disk in tar headers and padding. Tar entries get mtime 0 and fixed owner names, so the same tokens give
byte-identical shards.

Tokenization runs in a producer thread with a small queue: tokenizers' encode_batch releases the GIL and
spreads a batch over all cores, while the main thread packs and writes the previous batch. With
processes > 1 (data.prepare_processes) the batches go to that many worker processes instead, a bounded
window of them in flight, and come back in submission order: the Python half of tokenization (token lists
to arrays) then runs on every core too, and the token stream, so every byte written, stays the same.
"""

from __future__ import annotations

import collections
import hashlib
import io
import itertools
import multiprocessing
import os
import queue
import sys
import tarfile
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from data_prep.errors import DataError
from data_prep.index import ShardInfo, data_url, is_local


def pick_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ----------------------------------------------------------------------------------------------------
# Tokenization


FIRST_BATCH_CHARS = 1 << 16  # the first batch of a prepare; each next one twice as large, up to batch_chars


def _batches(docs: Iterable[str], batch_docs: int, limits: Iterator[int]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    limit = next(limits)
    for d in docs:
        batch.append(d)
        chars += len(d)
        if len(batch) >= batch_docs or chars >= limit:
            yield batch
            batch, chars = [], 0
            limit = next(limits)
    if batch:
        yield batch


def _tagged_batches(
    streams: Iterable[Iterable[str]], batch_docs: int, batch_chars: int
) -> Iterator[tuple[int, list[str] | None]]:
    """(stream, batch) for every stream in turn, and (stream, None) where a stream ends.

    The batches grow from FIRST_BATCH_CHARS to batch_chars, doubling: the tokenizer starts on a small
    first batch while the reader goes on, instead of waiting for a whole first batch to be read (the
    default corpus's train split is 4 MB). Batching never changes the tokens: each document is encoded
    alone.
    """
    ramp = itertools.takewhile(lambda c: c < batch_chars, (FIRST_BATCH_CHARS << i for i in itertools.count()))
    limits = itertools.chain(ramp, itertools.repeat(batch_chars))
    for k, docs in enumerate(streams):
        for batch in _batches(docs, batch_docs, limits):
            yield k, batch
        yield k, None


def encode_documents(tok: Tokenizer, docs: list[str], eod: int, dtype: str) -> np.ndarray:
    """One flat token array: each document's tokens followed by the end-of-document token."""
    return flat_ids(encode(tok, docs), eod, dtype)


def encode(tok: Tokenizer, docs: list[str]) -> list[Any]:
    """The documents' encodings. encode_batch_fast (tokenizers >= 0.20) gives the same ids as
    encode_batch without computing the offsets, which prepare never reads (and which cost as much to free
    as to build)."""
    fast = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return fast(docs, add_special_tokens=False)


def flat_ids(encs: list[Any], eod: int, dtype: str) -> np.ndarray:
    """The encodings' ids, each followed by eod, as one array: np.fromiter over one chain, without a small
    array per document."""
    n = sum(len(e) for e in encs) + len(encs)
    tail = (eod,)
    ids = itertools.chain.from_iterable(itertools.chain(e.ids, tail) for e in encs)
    return np.fromiter(ids, dtype=dtype, count=n)


Tagged = tuple[int, int, np.ndarray | None]  # (stream, documents, tokens); tokens None: the stream ended


def tokenize_streams(
    tok: Tokenizer,
    streams: Iterable[Iterable[str]],
    *,
    eod: int,
    dtype: str,
    batch_docs: int = 2048,
    batch_chars: int = 1 << 20,
    prefetch: int = 2,
    pool: TokenizerPool | None = None,
) -> Iterator[Tagged]:
    """(stream, documents, tokens) per batch of each document stream in turn, in document order, and
    (stream, 0, None) where stream k ends: a reader thread batches documents, a second thread encodes
    them and a third copies their ids into arrays (with a pool: one thread hands the batches to its worker
    processes, which do both).

    One reader for all the streams of a prepare: it runs ahead into the next stream while the last
    batches of this one are tokenized and written, so reading a split (Python: JSON parsing, decoding)
    overlaps encode_batch, which releases the GIL, instead of waiting for it. Batches of a million
    characters keep every core busy and bound the memory of the batches in flight (measured: one
    encode_batch over a whole corpus used 8.8 GB; with 4M-character batches, three batches' encodings
    in flight held 120 MB more than 1M-character ones, at the same speed). A stream is a lazy iterable (a
    generator): it starts reading when reached.
    """
    if pool is not None:  # every worker needs batches to work on, also from a corpus of a few MB
        batch_chars = min(batch_chars, POOL_BATCH_CHARS)
    batches = in_thread(_tagged_batches(streams, batch_docs, batch_chars), prefetch, "read-docs")
    encoded: Iterable[Tagged]
    if pool is not None:
        encoded = pool.encode(batches, eod, dtype, prefetch)
        return in_thread(encoded, prefetch, "tokenize")
    # Two threads: encode_batch (which releases the GIL while the Rust pool works) and the ids' copy into
    # an array (Python, under the GIL), so that the next batch's encode_batch keeps the cores busy while
    # this one's ids are copied (the copy was about 5% of prepare's time, with the cores idle). One batch
    # of encodings waits between them: each holds every token's string besides its id.
    encodings = in_thread(((k, b, None if b is None else encode(tok, b)) for k, b in batches), 1, "tokenize")
    encoded = ((k, 0, None) if b is None else (k, len(b), flat_ids(e, eod, dtype)) for k, b, e in encodings)
    return in_thread(encoded, prefetch, "token-ids")


def stream_batches(tagged: Iterator[Tagged], k: int) -> Iterator[tuple[int, np.ndarray]]:
    """(documents, tokens) of stream k, taken from `tagged` up to and including stream k's end."""
    for j, n, tokens in tagged:
        if j != k:
            raise RuntimeError(f"token batches of stream {j} where stream {k}'s were expected")
        if tokens is None:
            return
        yield n, tokens


POOL_BATCH_CHARS = 1 << 18  # batches for worker processes: about 60k tokens, many per worker
_WORKER_TOK: Tokenizer | None = None


def _worker_init(tok_json: str, threads: int) -> None:
    # Before the first encode: tokenizers' Rust pool reads RAYON_NUM_THREADS once, when it starts.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    global _WORKER_TOK
    _WORKER_TOK = Tokenizer.from_str(tok_json)


def _worker_encode(docs: list[str], eod: int, dtype: str) -> tuple[int, np.ndarray]:
    assert _WORKER_TOK is not None
    return len(docs), encode_documents(_WORKER_TOK, docs, eod, dtype)


class TokenizerPool:
    """Worker processes that tokenize batches with one tokenizer (data.prepare_processes): started once
    and used by every stream of a prepare; `with TokenizerPool(...) as pool` stops them at the end.

    spawn, not fork: a forked child of a process whose tokenizer pool already ran gets a dead pool (and
    forking a process with running threads can deadlock)."""

    def __init__(self, tok: Tokenizer, processes: int, threads: int = 0) -> None:
        self.processes = processes
        threads = threads or max(1, (os.cpu_count() or 1) // processes)
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            processes, ctx, initializer=_worker_init, initargs=(tok.to_str(), threads)
        )
        # Start every worker now, with an empty __main__ in place: a spawned worker would otherwise run
        # the caller's main module again (its imports, and in a script without a __main__ guard, its
        # whole body: a second prepare waiting forever on this one's directory lock). The workers need
        # nothing from it. No other thread of prepare runs yet.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            # The executor spawns a worker per submit while none is idle; none can be idle before it
            # booted (a tenth of a second), so these submits, microseconds apart, start all of them.
            for f in [self._pool.submit(int) for _ in range(processes)]:
                f.result()
        finally:
            sys.modules["__main__"] = main

    def encode(
        self, batches: Iterable[tuple[int, list[str] | None]], eod: int, dtype: str, prefetch: int = 2
    ) -> Iterator[Tagged]:
        """tokenize_streams' (stream, documents, tokens) for its (stream, batch) items, in submission
        order; at most processes + prefetch batches in flight (Pool.imap would read the whole corpus
        ahead into memory)."""
        window: collections.deque[tuple[int, Future[tuple[int, np.ndarray]] | None]] = collections.deque()

        def result(k: int, f: Future[tuple[int, np.ndarray]] | None) -> Tagged:
            return (k, 0, None) if f is None else (k, *f.result())

        try:
            for k, batch in batches:
                window.append(
                    (k, None if batch is None else self._pool.submit(_worker_encode, batch, eod, dtype))
                )
                if len(window) >= self.processes + prefetch:
                    yield result(*window.popleft())
            while window:
                yield result(*window.popleft())
        finally:
            for _, f in window:
                if f is not None:
                    f.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def in_thread(items: Iterable[Any], prefetch: int = 2, name: str = "producer") -> Iterator[Any]:
    """Iterate `items` in a daemon thread, up to `prefetch` ahead; its exceptions re-raise here.

    Closing the returned generator (or an exception in the consumer) stops the thread at its next item.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(done)
        except BaseException as e:  # handed to the consumer, which re-raises it with its own traceback
            put(_Raised(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # a generator's own cleanup (a worker pool) runs now, not at GC
                close()

    def consume() -> Iterator[Any]:
        worker = threading.Thread(target=produce, name=name, daemon=True)
        worker.start()
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, _Raised):
                    raise item.exc
                yield item
        finally:
            stop.set()
            worker.join()

    return consume()


@dataclass
class _Raised:
    exc: BaseException


# ----------------------------------------------------------------------------------------------------
# Writing


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


@dataclass
class SplitStats:
    documents: int = 0
    tokens: int = 0  # tokens in the stream, end-of-document tokens included
    sequences: int = 0
    dropped_tokens: int = 0  # the tail that did not fill a sequence

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _HashingWriter:
    """A write-only stream wrapper that hashes and counts everything written through it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        self.nbytes += len(b)
        return self.raw.write(b)


class SplitWriter:
    """Packs token batches into sequences and writes them as shards <split>/<name>-NNNNN.tar (name: the
    split's, or a mixture source's, whose shards then sit beside the other sources' in the split).

    Each member (sequences_per_member sequences) goes into the open shard as soon as its sequences are
    complete, so writing overlaps tokenization instead of waiting for a shard's worth (the default
    corpus's whole train split is one shard, which was written after the last encode_batch). The bytes
    are those of writing each shard at once: the same members, in the same order, through one tar stream.
    """

    def __init__(
        self,
        root: Path,
        split: str,
        *,
        seq_len: int,
        dtype: str,
        sequences_per_member: int,
        sequences_per_shard: int,
        name: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.split = split
        self.name = name or split
        self.row = seq_len + 1
        self.dtype = dtype
        self.per_member = sequences_per_member
        self.per_shard = sequences_per_shard
        (self.root / split).mkdir(parents=True, exist_ok=True)
        self.shards: list[ShardInfo] = []
        self.stats = SplitStats()
        self._carry = np.zeros(0, dtype=dtype)  # tokens not yet forming a whole sequence
        self._pending: list[np.ndarray] = []  # whole sequences not yet written (less than a member)
        self._pending_rows = 0
        self._shard: _OpenShard | None = None

    def add_tokens(self, tokens: np.ndarray, documents: int = 0) -> None:
        self.stats.documents += documents
        self.stats.tokens += len(tokens)
        stream = np.concatenate([self._carry, tokens]) if len(self._carry) else tokens
        n = len(stream) // self.row
        self._carry = stream[n * self.row :].copy()
        if n:
            self._pending.append(stream[: n * self.row].reshape(n, self.row))
            self._pending_rows += n
        while self._pending_rows and self._pending_rows >= self._member_rows():
            rows = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
            m = self._member_rows()
            self._write_member(rows[:m])
            rest = rows[m:]
            self._pending = [rest] if len(rest) else []
            self._pending_rows = len(rest)

    def close(self) -> list[ShardInfo]:
        if self._pending_rows:  # fewer than a member: the short last member of the last shard
            self._write_member(np.concatenate(self._pending))
        self._pending, self._pending_rows = [], 0
        if self._shard is not None:
            self._finish_shard()
        self.stats.dropped_tokens = len(self._carry)
        self.stats.sequences = sum(s.sequences for s in self.shards)
        return self.shards

    def abort(self) -> None:
        """Close the open shard's file without finishing it (prepare removes its folder)."""
        if self._shard is not None:
            self._shard.file.close()
            self._shard = None

    def _member_rows(self) -> int:
        """Rows of the next member: a whole member, or what is left of the open shard if less."""
        done = self._shard.rows if self._shard is not None else 0
        return min(self.per_member, self.per_shard - done)

    def _write_member(self, rows: np.ndarray) -> None:
        if self._shard is None:
            self._shard = _OpenShard(self.root, f"{self.split}/{self.name}-{len(self.shards):05d}.tar")
        sh = self._shard
        payload = _npy_bytes(rows)
        info = tarfile.TarInfo(f"{self.name}-{len(self.shards):05d}-{sh.members:06d}.npy")
        info.size, info.mtime, info.mode = len(payload), 0, 0o444
        info.uname = info.gname = "fpa"
        sh.tar.addfile(info, io.BytesIO(payload))
        sh.members += 1
        sh.rows += len(rows)
        sh.tokens += int(rows.size)
        if sh.rows == self.per_shard:
            self._finish_shard()

    def _finish_shard(self) -> None:
        sh = self._shard
        assert sh is not None
        sh.tar.close()
        sh.file.close()
        self._shard = None
        self.shards.append(
            ShardInfo(
                file=sh.rel,
                sha256=sh.out.sha.hexdigest(),
                bytes=sh.out.nbytes,
                members=sh.members,
                sequences=sh.rows,
                tokens=sh.tokens,
            )
        )


class _OpenShard:
    """A shard being written: its file, hashed on its way there (no second read of what was written).

    Plain tarfile writes the same USTAR layout as webdataset's TarWriter(mtime=0) without importing
    webdataset, which imports torch (seconds) in a step that needs neither."""

    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        self.file = open(root / rel, "wb")  # noqa: SIM115 (closed by SplitWriter, shard by shard)
        self.out = _HashingWriter(self.file)
        self.tar = tarfile.open(fileobj=self.out, mode="w|", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self.members = self.rows = self.tokens = 0


# ----------------------------------------------------------------------------------------------------
# Reading


class _HashingReader:
    """A read-only stream wrapper that hashes everything read through it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n)
        self.sha.update(b)
        self.nbytes += len(b)
        return b

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def read_shard(
    data_dir: Path | str,
    shard: ShardInfo,
    *,
    seq_len: int,
    dtype: str,
    verify: bool = True,
    opener: Callable[[str], Any] | None = None,
    vocab_size: int | None = None,
) -> np.ndarray:
    """All sequences of a shard as one (sequences, seq_len + 1) array, read through webdataset.

    The sha256 is computed while streaming (verify=True) and checked at the end; a missing, truncated or
    altered shard raises DataError naming the file. vocab_size: every token id must be below it (a
    hash-valid shard may still come from another tokenizer; the model would fail on it with an IndexError).
    """
    from webdataset.gopen import gopen
    from webdataset.tariterators import tar_file_iterator

    url = data_url(data_dir, shard.file)
    if is_local(data_dir) and not Path(url).is_file():
        raise DataError(f"missing shard {url} (listed in index.json)")
    try:
        raw = (opener or (lambda u: gopen(u, "rb")))(url)
    except Exception as e:
        raise DataError(f"cannot open shard {url}: {str(e).splitlines()[0]}") from None
    stream = _HashingReader(raw)
    parts: list[np.ndarray] = []
    try:
        for sample in tar_file_iterator(stream):
            if not sample["fname"].endswith(".npy"):
                raise DataError(f"shard {url}: unexpected member {sample['fname']!r}")
            arr = np.load(io.BytesIO(sample["data"]), allow_pickle=False)
            if arr.dtype != np.dtype(dtype) or arr.ndim != 2 or arr.shape[1] != seq_len + 1:
                raise DataError(
                    f"shard {url}: member {sample['fname']} is {arr.dtype}{list(arr.shape)}, "
                    f"index.json says {dtype}[n, {seq_len + 1}]"
                )
            parts.append(arr)
        stream.drain()
    except DataError:
        raise
    except (tarfile.TarError, ValueError, OSError, EOFError) as e:
        raise DataError(f"shard {url} is truncated or corrupt ({str(e).splitlines()[0]})") from None
    finally:
        close = getattr(raw, "close", None)
        if close is not None:
            try:
                close()
            except Exception as e:  # a pipe: command that failed reports its exit status on close
                raise DataError(f"shard {url}: reader failed ({str(e).splitlines()[0]})") from None
    rows = np.concatenate(parts) if parts else np.zeros((0, seq_len + 1), dtype=dtype)
    if stream.nbytes != shard.bytes:
        raise DataError(
            f"shard {url} is truncated or corrupt ({stream.nbytes} bytes, index.json says {shard.bytes})"
        )
    if verify and stream.sha.hexdigest() != shard.sha256:
        raise DataError(
            f"shard {url} does not match index.json (sha256 {stream.sha.hexdigest()[:12]}..., "
            f"expected {shard.sha256[:12]}...)"
        )
    if len(rows) != shard.sequences:
        raise DataError(f"shard {url} holds {len(rows)} sequences, index.json says {shard.sequences}")
    if vocab_size is not None and rows.size and int(rows.max()) >= vocab_size:
        raise DataError(
            f"shard {url}: token id {int(rows.max())} is outside the vocabulary of {vocab_size} tokens "
            f"(index.json): it was not made with this data's tokenizer; re-run `fpa prepare`"
        )
    return rows
