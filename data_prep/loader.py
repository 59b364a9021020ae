"""A deterministic, resumable, world-size independent loader over prepared webdataset shards.

Global order. Each epoch has one global order of the split's sequences, a function of (seed, epoch) and the
shard list only, never of dp_world or num_workers:
  1. the shards are permuted by a generator seeded with (seed, epoch);
  2. consecutive shards of that order are grouped into blocks of at least `shuffle_block` sequences;
  3. the order is block after block, each block a full permutation of its sequences, seeded with
     (seed, epoch, block).
A split that fits in one block (the packaged corpora: a few thousand sequences) gets an exact global
permutation. A bigger corpus is shuffled within blocks of whole shards: a rank then needs only the current
(and, at a boundary, the next) block in memory, and reads each shard sequentially, which is what
webdataset and remote storage are good at. The trade-off is the usual shard-block shuffle: sequences
from far-apart blocks never meet in one global batch of an epoch, but blocks move every epoch.

Mixtures. A train split prepared from a weighted mixture (data.mixture; index.json "mixture") keeps each
source in its own shards. An epoch still has as many positions as the split holds sequences; source j gets
c_j of them, the weight-proportional share (largest remainder, so the c_j add up exactly), and the
positions are a permutation seeded with (seed, epoch) of c_j labels j. The k-th draw from source j in an
epoch is position k mod N_j of that source's own shard-block order for pass k // N_j (seeded with
(seed, epoch, source, pass)): a source whose share exceeds its size is repeated, each repeat in a new
order (sampling WITH repetition across passes, never within one); a source below its share contributes
a different subset every epoch. Everything is still a function of (seed, epoch) only.

Batches. With G = micro_batch * dp_world, step s of rank r gets global positions
[s*G + r*micro_batch, s*G + (r+1)*micro_batch) of the epoch's order, so every rank gets the same number of
rows every step. An epoch ends when fewer than G sequences remain: that tail is DROPPED for this epoch
(the next epoch's order is a different permutation, so no sequence is dropped systematically).
steps_per_epoch = sequences // G for an epoch started from position 0.

State. `state_dict()` is a few ints: epoch, position (global sequences consumed in the epoch), consumed
(global sequences since the start) plus the seed, shuffle block and a fingerprint of the shards to refuse
resuming on different data. It holds no rank: it is the same on every rank, and resuming on another
dp_world continues the same global stream (position is counted in sequences, not steps). The state is
updated before a batch is yielded: after taking k batches, state_dict() resumes at batch k + 1. One live
iterator per loader: `iter(loader)` continues from the current state.

Reading. Shards are read whole through webdataset (local paths, URLs, or `pipe:` commands with a
{path} placeholder in data_dir), their sha256 checked on every read from storage, and decoded arrays kept
in an in-memory cache (the whole split when it fits `cache_bytes`, so later epochs read nothing).
num_workers > 0 starts that many threads that read the next block's shards ahead (file reads, hashing and
decompression release the GIL); they change only speed, never order.

Validation. `iter_once()` goes over the split once in stored order (rank r gets positions
[b*G + r*micro_batch, ...) of batch b), drops the tail that does not fill a global batch, and leaves the
training state alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.errors import DataError
from data_prep.index import DataIndex, load_index
from data_prep.shards import read_shard

STATE_VERSION = 1


@dataclass(frozen=True)
class _Block:
    shards: tuple[int, ...]  # shard indices, in the epoch's shard order
    offsets: np.ndarray  # row offset of each shard within the block, plus the total at the end
    start: int  # global position of the block's first sequence in the epoch order

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


class _Order:
    """The shard-block order of a group of shards for one pass: a pass key (the epoch; for a mixture
    source, epoch, source and pass) seeds the shard permutation with (seed, *key) and block b's
    permutation with (seed, *key, b). The last plan and block permutation are cached."""

    def __init__(self, shard_ids: list[int], sizes: list[int], seed: int, shuffle_block: int) -> None:
        self.ids = shard_ids  # global shard indices of the group
        self.sizes = sizes  # sequences per shard of the group
        self.total = sum(sizes)
        self.seed = seed
        self.shuffle_block = shuffle_block
        self._plan_key: tuple[int, ...] | None = None
        self._plan: list[_Block] = []
        self._perm_key: tuple[int, ...] | None = None
        self._perm = np.zeros(0, dtype=np.int64)
        self._first: dict[tuple[int, ...], tuple[int, ...]] = {}

    def _shard_order(self, key: tuple[int, ...]) -> list[int]:
        order = np.random.default_rng([self.seed, *key]).permutation(len(self.ids))
        return [self.ids[i] for i in order.tolist()]

    def plan(self, key: tuple[int, ...]) -> list[_Block]:
        if key == self._plan_key:
            return self._plan
        size = dict(zip(self.ids, self.sizes))
        blocks: list[_Block] = []
        current: list[int] = []
        rows = 0
        start = 0
        for i in self._shard_order(key):
            current.append(i)
            rows += size[i]
            if rows >= self.shuffle_block:
                blocks.append(self._block(current, start, size))
                start += rows
                current, rows = [], 0
        if current:
            blocks.append(self._block(current, start, size))
        self._plan_key, self._plan = key, blocks
        return blocks

    @staticmethod
    def _block(shards: list[int], start: int, size: dict[int, int]) -> _Block:
        offsets = np.concatenate([[0], np.cumsum([size[i] for i in shards])]).astype(np.int64)
        return _Block(tuple(shards), offsets, start)

    def perm(self, key: tuple[int, ...], b: int, block: _Block) -> np.ndarray:
        if self._perm_key != (*key, b):
            self._perm = np.random.default_rng([self.seed, *key, b]).permutation(block.size)
            self._perm_key = (*key, b)
        return self._perm

    def first_block(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """The shards of a pass's first block (to read ahead across a pass boundary), without planning."""
        if key not in self._first:
            size = dict(zip(self.ids, self.sizes))
            first: list[int] = []
            rows = 0
            for i in self._shard_order(key):
                first.append(i)
                rows += size[i]
                if rows >= self.shuffle_block:
                    break
            self._first = {key: tuple(first)}  # one remembered: the next pass's
        return self._first[key]

    def locate(
        self, key: tuple[int, ...], a: int, b: int
    ) -> Iterator[tuple[int, _Block, list[int], list[int]]]:
        """(block index, block, shard ids, rows) for the positions [a, b) of a pass, block by block."""
        plan = self.plan(key)
        starts = [blk.start for blk in plan]
        pos = a
        while pos < b:
            bi = int(np.searchsorted(starts, pos, side="right") - 1)
            block = plan[bi]
            end = min(b, block.start + block.size)
            local = self.perm(key, bi, block)[pos - block.start : end - block.start]
            k = np.searchsorted(block.offsets, local, side="right") - 1
            shards = np.asarray(block.shards)[k].tolist()
            yield bi, block, shards, (local - block.offsets[k]).tolist()
            pos = end


def apportion(total: int, weights: list[float]) -> list[int]:
    """Integer counts proportional to weights that add up to total (largest remainder; ties to the
    earlier source), e.g. apportion(10, [2, 1]) == [7, 3]."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    return counts.tolist()


_MIX_TAG = 0x313D  # separates the mixture's seeds from a single source's (seed, epoch, block)
_CHECKPOINT = 4096  # positions between stored per-source counts of the mixture labels


@dataclass(frozen=True)
class _EpochMix:
    labels: np.ndarray  # source of each position of the epoch (uint16)
    counts: np.ndarray  # counts[c, j]: draws of source j before position c * _CHECKPOINT


class ShardLoader:
    """Yields torch.LongTensor batches of shape (micro_batch, seq_len + 1) forever; see the module doc."""

    def __init__(
        self,
        data_dir: Path | str,
        split: str,
        *,
        micro_batch: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 1234,
        num_workers: int = 0,
        shuffle_block: int = 65536,
        cache_bytes: int = 2 << 30,
        verify: bool = True,
    ) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world; got dp_rank={dp_rank}, dp_world={dp_world}")
        if shuffle_block < 1 or num_workers < 0:
            raise ValueError("shuffle_block must be >= 1 and num_workers >= 0")
        self.data_dir = data_dir
        self.split = split
        self.index: DataIndex = load_index(data_dir)
        self.shards = self.index.shards(split)
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.num_workers = num_workers
        self.shuffle_block = shuffle_block
        self.cache_bytes = cache_bytes
        self.verify = verify
        self.seq_len = self.index.seq_len
        self.vocab_size = self.index.vocab_size
        self.eod_id = self.index.eod_id
        self.sequences = sum(s.sequences for s in self.shards)
        self.global_batch = micro_batch * dp_world
        if self.sequences < self.global_batch:
            raise DataError(
                f"{split} split of {data_dir} has {self.sequences} sequences, fewer than one global batch "
                f"of {self.global_batch} (micro_batch {micro_batch} x dp_world {dp_world})"
            )
        self.steps_per_epoch = self.sequences // self.global_batch
        self._fingerprint = self.index.fingerprint(split)
        self._epoch = 0
        self._position = 0
        self._consumed = 0
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._inflight: dict[int, Future[np.ndarray]] = {}
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="shards") if num_workers else None
        # One shard-block order per source: the whole split, or each source of a mixture.
        sizes = [s.sequences for s in self.shards]
        self.mixture = self.index.mixture.get(split, [])
        if self.mixture:
            self.weights = [float(m["weight"]) for m in self.mixture]
            self._orders = []
            first = 0
            for m in self.mixture:
                ids = list(range(first, first + int(m["shards"])))
                self._orders.append(_Order(ids, sizes[first : first + len(ids)], seed, shuffle_block))
                first += len(ids)
            if first != len(self.shards) or not any(w > 0 for w in self.weights):
                raise DataError(f"index.json of {data_dir}: the {split} mixture does not match its shards")
        else:
            self.weights = []
            self._orders = [_Order(list(range(len(sizes))), sizes, seed, shuffle_block)]
        self._mix_epoch = -1
        self._mix = _EpochMix(np.zeros(0, np.uint16), np.zeros((1, 0), np.int64))
        self._keep: dict[int, set[int]] = {}  # per order: the shards of its current and next block

    # ------------------------------------------------------------------------------------------------
    # State

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "consumed": self._consumed,
            "seed": self.seed,
            "shuffle_block": self.shuffle_block,
            "sequences": self.sequences,
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "position", "consumed", "seed", "shuffle_block", "fingerprint"):
            if key not in state:
                raise DataError(f"loader state has no {key!r} (keys: {', '.join(state)})")
        for key, mine in (
            ("seed", self.seed),
            ("shuffle_block", self.shuffle_block),
            ("fingerprint", self._fingerprint),
        ):
            if state[key] != mine:
                raise DataError(
                    f"loader state {key}={state[key]!r} does not match this loader's {mine!r} "
                    f"({self.split} split of {self.data_dir}): resuming would not continue the same order"
                )
        if not 0 <= int(state["position"]) <= self.sequences or int(state["epoch"]) < 0:
            raise DataError(f"loader state position {state['position']} is outside 0..{self.sequences}")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._consumed = int(state["consumed"])

    @property
    def epoch(self) -> int:
        return self._epoch

    # ------------------------------------------------------------------------------------------------
    # Order

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole global order of an epoch as (shard, row) pairs, shape (sequences, 2); for tests."""
        pairs = [(k, r) for part in self._locate(epoch, 0, self.sequences, read=False) for k, r in part]
        return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)

    def _epoch_plan(self, epoch: int) -> list[_Block]:
        """The shard blocks of a single-source epoch (a mixture has one plan per source and pass)."""
        return self._orders[0].plan((epoch,))

    def epoch_counts(self, epoch: int) -> list[int]:
        """Sequences drawn from each mixture source in an epoch ([all] for a single source)."""
        if not self.mixture:
            return [self.sequences]
        return np.bincount(self._epoch_mix(epoch).labels, minlength=len(self.mixture)).tolist()

    def _epoch_mix(self, epoch: int) -> _EpochMix:
        """Which source each position of a mixture epoch draws from, with running counts every
        _CHECKPOINT positions (a batch then counts its draws from the nearest checkpoint only)."""
        if epoch == self._mix_epoch:
            return self._mix
        counts = apportion(self.sequences, self.weights)
        labels = np.repeat(np.arange(len(counts), dtype=np.uint16), counts)
        labels = np.random.default_rng([self.seed, epoch, _MIX_TAG]).permutation(labels)
        whole = len(labels) // _CHECKPOINT * _CHECKPOINT
        chunks = labels[:whole].reshape(-1, _CHECKPOINT)
        per_chunk = np.stack([(chunks == j).sum(1) for j in range(len(counts))], axis=1)
        running = np.concatenate([np.zeros((1, len(counts)), np.int64), np.cumsum(per_chunk, 0)])
        self._mix_epoch, self._mix = epoch, _EpochMix(labels, running)
        return self._mix

    def _locate(self, epoch: int, a: int, b: int, read: bool = True) -> Iterator[list[tuple[int, int]]]:
        """(shard, row) of the global positions [a, b) of an epoch, in position order, in pieces; with
        read, each piece's blocks are entered in the cache first (current kept, next read ahead)."""
        if not self.mixture:
            order = self._orders[0]
            for bi, _, shards, rows in order.locate((epoch,), a, b):
                if read:
                    plan = order.plan((epoch,))
                    nxt = plan[bi + 1].shards if bi + 1 < len(plan) else order.first_block((epoch + 1,))
                    self._enter(0, plan[bi].shards, nxt)
                yield list(zip(shards, rows))
            return
        mix = self._epoch_mix(epoch)
        c0 = a // _CHECKPOINT
        seg = mix.labels[c0 * _CHECKPOINT : b]
        occ = np.zeros(len(seg), dtype=np.int64)
        for j in np.unique(seg).tolist():
            idx = np.nonzero(seg == j)[0]
            occ[idx] = mix.counts[c0, j] + np.arange(len(idx))
        skip = a - c0 * _CHECKPOINT
        seg, occ = seg[skip:], occ[skip:]
        out: list[tuple[int, int]] = [(0, 0)] * len(seg)
        for j in np.unique(seg).tolist():
            order = self._orders[j]
            slots = np.nonzero(seg == j)[0]
            draws = occ[slots]  # consecutive: the j-th source's draws in this range
            passes = draws // order.total
            for p in np.unique(passes).tolist():
                sel = passes == p
                lo, hi = int(draws[sel][0] % order.total), int(draws[sel][-1] % order.total) + 1
                key = (epoch, _MIX_TAG, j, p)
                got: list[tuple[int, int]] = []
                for bi, _, shards, rows in order.locate(key, lo, hi):
                    if read:
                        plan = order.plan(key)
                        nxt = (
                            plan[bi + 1].shards
                            if bi + 1 < len(plan)
                            else order.first_block((*key[:3], p + 1))
                        )
                        self._enter(j, plan[bi].shards, nxt)
                    got += zip(shards, rows)
                for slot, pair in zip(slots[sel].tolist(), got):
                    out[slot] = pair
        yield out

    # ------------------------------------------------------------------------------------------------
    # Iteration

    def __iter__(self) -> Iterator[torch.Tensor]:
        m, g = self.micro_batch, self.global_batch
        while True:
            if self._position + g > self.sequences:  # the tail of this epoch is dropped
                self._epoch += 1
                self._position = 0
            start = self._position + self.dp_rank * m
            batch = self._gather(self._epoch, start, start + m)
            self._position += g
            self._consumed += g
            yield torch.from_numpy(batch.astype(np.int64))

    def iter_once(self, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """One in-order pass over the split (this rank's share); does not touch the training state."""
        m, g = self.micro_batch, self.global_batch
        offsets = np.concatenate([[0], np.cumsum([s.sequences for s in self.shards])])
        n = self.steps_per_epoch if max_batches is None else min(max_batches, self.steps_per_epoch)
        for b in range(n):
            a = b * g + self.dp_rank * m
            rows = []
            pos = a
            while pos < a + m:
                k = int(np.searchsorted(offsets, pos, side="right") - 1)
                take = min(a + m, int(offsets[k + 1])) - pos
                self._prefetch([k + 1] if k + 1 < len(self.shards) else [])
                self._evict({k, k + 1})  # a pass over a big split keeps only what it reads next
                rows.append(self._shard(k)[pos - offsets[k] : pos - offsets[k] + take])
                pos += take
            yield torch.from_numpy(np.concatenate(rows).astype(np.int64))

    def _gather(self, epoch: int, a: int, b: int) -> np.ndarray:
        """Rows at global positions [a, b) of the epoch's order."""
        parts = []
        for piece in self._locate(epoch, a, b):
            parts += [self._shard(k)[row] for k, row in piece]
        return np.stack(parts)

    # ------------------------------------------------------------------------------------------------
    # Shard cache

    def _enter(self, source: int, current: tuple[int, ...], nxt: tuple[int, ...]) -> None:
        """Keep a source's current block and start reading its next block in the background; the cache
        keeps the current and next blocks of every source (one source: of the split)."""
        self._prefetch(list(nxt))
        self._keep[source] = set(current) | set(nxt)
        self._evict(set().union(*self._keep.values()))

    def _read(self, i: int) -> np.ndarray:
        return read_shard(
            self.data_dir,
            self.shards[i],
            seq_len=self.seq_len,
            dtype=self.index.dtype,
            verify=self.verify,
            vocab_size=self.vocab_size,
        )

    def _prefetch(self, shard_ids: list[int]) -> None:
        if self._pool is None:
            return
        for i in shard_ids:
            if i not in self._cache and i not in self._inflight:
                self._inflight[i] = self._pool.submit(self._read, i)

    def _shard(self, i: int) -> np.ndarray:
        arr = self._cache.get(i)
        if arr is not None:
            self._cache.move_to_end(i)
            return arr
        fut = self._inflight.pop(i, None)
        arr = fut.result() if fut is not None else self._read(i)
        self._cache[i] = arr
        return arr

    def _evict(self, keep: set[int]) -> None:
        """Drop least recently used shards outside `keep` while the cache is over cache_bytes."""
        total = sum(a.nbytes for a in self._cache.values())
        for i in list(self._cache):
            if total <= self.cache_bytes:
                break
            if i not in keep:
                total -= self._cache.pop(i).nbytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._inflight.clear()
        self._cache.clear()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def check_split(make_loader: Callable[[], Any], split: str, hint: str = "") -> None:
    """Build a loader and read its first batch now, then close it: a missing, empty, too small or unreadable
    split is one DataError before a run starts instead of an error after hours of it (a validation pass
    runs only at train.val_every). Any loader works; ShardLoader's pass leaves no training state behind.
    """
    try:
        loader = make_loader()
        try:
            it = loader.iter_once(1) if hasattr(loader, "iter_once") else iter(loader)
            if next(it, None) is None:
                raise DataError(f"the {split} split yields no batches")
        finally:
            if hasattr(loader, "close"):
                loader.close()
    except DataError as e:
        raise DataError(f"{split} check before training: {e}{hint}") from None


def document_segments(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(B, T) int64 document index of every position of token windows (B, T), for
    model.attention.document_mask.

    The stream is documents each followed by an end-of-document token, cut into windows: an end-of-document
    token ends, and belongs to, its document; the next document starts after it. A document cut by the
    window start is segment 0 (its own, whatever came before the window). Non-decreasing along T.
    """
    if tokens.dim() != 2:
        raise ValueError(
            f"document_segments expects (batch, T) token windows; got shape {tuple(tokens.shape)}"
        )
    ends = (tokens == eod_id).long()
    return ends.cumsum(dim=1) - ends  # documents ended strictly before each position
