"""ShardLoader: global order independent of world size and workers, exact resume, validation pass, errors."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.config import DataConfig, SourceConfig, TokenizerConfig
from data_prep.errors import DataError
from data_prep.index import load_index
from data_prep.loader import ShardLoader
from data_prep.prepare import prepare_data
from data_prep.shards import read_shard


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """182 train sequences in 12 shards of 16 (the last one short), 4 per member: 30 steps at G=6."""
    root = tmp_path_factory.mktemp("loader")
    rng = random.Random(7)
    words = [f"w{i}" for i in range(60)]
    with open(root / "c.jsonl", "w") as f:
        for _ in range(40):
            f.write(
                json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))}) + "\n"
            )
    cfg = DataConfig(
        train=SourceConfig(type="jsonl", paths=[str(root / "c.jsonl")]),
        val_fraction=0.1,
        tokenizer=TokenizerConfig(vocab_size=320),
        seq_len=8,
        sequences_per_member=4,
        sequences_per_shard=16,
    )
    prepare_data(cfg, root / "data", progress=False)
    return root / "data"


def stored_rows(data_dir: Path, split: str) -> list[np.ndarray]:
    index = load_index(data_dir)
    return [read_shard(data_dir, s, seq_len=index.seq_len, dtype=index.dtype) for s in index.shards(split)]


def global_batches(data_dir: Path, micro: int, world: int, steps: int, **kw) -> list[torch.Tensor]:
    """The global batch of each step: the ranks' micro batches stacked in rank order."""
    loaders = [
        ShardLoader(data_dir, "train", micro_batch=micro, dp_rank=r, dp_world=world, **kw)
        for r in range(world)
    ]
    its = [iter(ld) for ld in loaders]
    out = [torch.cat([next(it) for it in its]) for _ in range(steps)]
    for ld in loaders:
        ld.close()
    return out


def test_epoch_order_is_a_permutation_and_batches_follow_it(data_dir: Path) -> None:
    rows = stored_rows(data_dir, "train")
    n = sum(len(r) for r in rows)
    loader = ShardLoader(data_dir, "train", micro_batch=4, seed=11)
    order = loader.epoch_order(0)
    assert len({(int(s), int(r)) for s, r in order}) == n == loader.sequences
    assert order.tolist() != sorted(order.tolist())  # actually shuffled
    expected = np.stack([rows[s][r] for s, r in order])
    it = iter(loader)
    got = torch.cat([next(it) for _ in range(loader.steps_per_epoch)]).numpy()
    assert got.dtype == np.int64 and got.shape == (loader.steps_per_epoch * 4, loader.seq_len + 1)
    np.testing.assert_array_equal(got, expected[: len(got)])
    # the next epoch is a different permutation, and the loader rolls over to it
    order1 = loader.epoch_order(1)
    assert order1.tolist() != order.tolist()
    np.testing.assert_array_equal(next(it).numpy(), np.stack([rows[s][r] for s, r in order1[:4]]))
    assert loader.epoch == 1


@pytest.mark.parametrize("shuffle_block", [1 << 16, 40], ids=["one-block", "blocks-of-40"])
def test_global_order_independent_of_world_size_and_workers(data_dir: Path, shuffle_block: int) -> None:
    micro = 3
    ref = ShardLoader(data_dir, "train", micro_batch=1, shuffle_block=shuffle_block)
    rows = stored_rows(data_dir, "train")
    order = ref.epoch_order(0)
    stream = np.stack([rows[s][r] for s, r in order])
    for world in (1, 2, 3, 4):
        for workers in (0, 2):
            g = micro * world
            steps = len(order) // g
            batches = global_batches(
                data_dir, micro, world, steps, num_workers=workers, shuffle_block=shuffle_block
            )
            got = torch.cat(batches).numpy()
            # step s of rank r = positions [s*G + r*micro, ...): stacked in rank order, it is the stream
            np.testing.assert_array_equal(
                got, stream[: steps * g], err_msg=f"world={world} workers={workers}"
            )
            # every sequence at most once, and all but the dropped tail (< one global batch) exactly once
            assert len(order) - steps * g < g


def test_tiny_cache_and_read_ahead_do_not_change_the_stream(data_dir: Path) -> None:
    """With cache_bytes=0 only the current and next block stay in memory: shards are re-read each epoch."""
    steps = 75  # two and a half epochs of 6-sequence batches
    ref = global_batches(data_dir, 6, 1, steps, shuffle_block=40)
    got = global_batches(data_dir, 6, 1, steps, shuffle_block=40, cache_bytes=0, num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_blocks_stay_within_shard_groups(data_dir: Path) -> None:
    loader = ShardLoader(data_dir, "train", micro_batch=1, shuffle_block=40)
    order = loader.epoch_order(0)
    plan = loader._epoch_plan(0)
    assert len(plan) > 1
    for block in plan:  # the block's positions hold exactly its shards' sequences
        seg = order[block.start : block.start + block.size]
        assert set(seg[:, 0].tolist()) == set(block.shards)


@pytest.mark.parametrize("k", [0, 5, 17, 30, 33], ids=lambda k: f"after-{k}")
def test_exact_resume_mid_epoch_and_across_epochs(data_dir: Path, k: int) -> None:
    micro, world = 2, 3  # 6 per global batch, about 30 steps per epoch: k=30 crosses an epoch
    total = 45
    full = global_batches(data_dir, micro, world, total)
    loaders = [
        ShardLoader(data_dir, "train", micro_batch=micro, dp_rank=r, dp_world=world) for r in range(world)
    ]
    its = [iter(ld) for ld in loaders]
    for _ in range(k):
        for it in its:
            next(it)
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)  # one state for every rank
    assert set(states[0]) >= {"epoch", "position", "consumed"}
    json.dumps(states[0])  # plain JSON values: fits any checkpoint
    resumed = [
        ShardLoader(data_dir, "train", micro_batch=micro, dp_rank=r, dp_world=world) for r in range(world)
    ]
    for ld in resumed:
        ld.load_state_dict(states[0])
    rits = [iter(ld) for ld in resumed]
    for s in range(k, total):
        torch.testing.assert_close(torch.cat([next(it) for it in rits]), full[s], rtol=0, atol=0)


def test_resume_on_a_different_world_size_continues_the_global_stream(data_dir: Path) -> None:
    ref = ShardLoader(data_dir, "train", micro_batch=1)
    it = iter(ref)
    stream = torch.cat([next(it) for _ in range(24)])
    first = global_batches(data_dir, 2, 2, 3)  # 12 sequences on 2 ranks
    state = ShardLoader(data_dir, "train", micro_batch=2, dp_world=2).state_dict()
    state.update(position=12, consumed=12)
    loaders = [ShardLoader(data_dir, "train", micro_batch=3, dp_rank=r, dp_world=4) for r in range(4)]
    for ld in loaders:
        ld.load_state_dict(state)
    nxt = torch.cat([next(iter(ld)) for ld in loaders])  # 12 more on 4 ranks
    torch.testing.assert_close(torch.cat([*first, nxt]), stream, rtol=0, atol=0)


def test_seed_changes_order_and_same_seed_repeats(data_dir: Path) -> None:
    a = next(iter(ShardLoader(data_dir, "train", micro_batch=8, seed=1)))
    b = next(iter(ShardLoader(data_dir, "train", micro_batch=8, seed=1)))
    c = next(iter(ShardLoader(data_dir, "train", micro_batch=8, seed=2)))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_iter_once_goes_over_validation_in_order(data_dir: Path) -> None:
    rows = np.concatenate(stored_rows(data_dir, "validation"))
    for world in (1, 2):
        loaders = [
            ShardLoader(data_dir, "validation", micro_batch=2, dp_rank=r, dp_world=world)
            for r in range(world)
        ]
        batches = [list(ld.iter_once()) for ld in loaders]
        assert all(len(b) == loaders[0].steps_per_epoch for b in batches)  # equal counts on every rank
        got = torch.cat([torch.cat([b[s] for b in batches]) for s in range(len(batches[0]))]).numpy()
        n = len(rows) // (2 * world) * (2 * world)
        np.testing.assert_array_equal(got, rows[:n])
        assert loaders[0].state_dict()["position"] == 0  # training state untouched
    assert len(list(loaders[0].iter_once(max_batches=2))) == 2


def test_reads_through_a_pipe_url(data_dir: Path) -> None:
    url = f"pipe:cat {data_dir}/{{path}}"
    a = list(ShardLoader(url, "validation", micro_batch=4).iter_once())
    b = list(ShardLoader(data_dir, "validation", micro_batch=4).iter_once())
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_state_from_other_data_or_seed_is_refused(data_dir: Path, tmp_path: Path) -> None:
    loader = ShardLoader(data_dir, "train", micro_batch=2)
    state = loader.state_dict()
    with pytest.raises(DataError, match="loader state seed=1234 does not match this loader's 99"):
        ShardLoader(data_dir, "train", micro_batch=2, seed=99).load_state_dict(state)
    with pytest.raises(DataError, match="loader state fingerprint="):
        ShardLoader(data_dir, "validation", micro_batch=2).load_state_dict(state)
    with pytest.raises(DataError, match="loader state has no 'position'"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="position 100000 is outside"):
        loader.load_state_dict({**state, "position": 100000})


def test_loader_errors(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="fewer than one global batch"):
        ShardLoader(data_dir, "validation", micro_batch=1000)
    with pytest.raises(DataError, match="no 'test' split"):
        ShardLoader(data_dir, "test", micro_batch=1)
    with pytest.raises(DataError, match=r"missing .*index\.json"):
        ShardLoader(tmp_path, "train", micro_batch=1)
    with pytest.raises(ValueError, match="dp_rank"):
        ShardLoader(data_dir, "train", micro_batch=1, dp_rank=2, dp_world=2)
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    shard = load_index(copy).shards("validation")[0]
    p = copy / shard.file
    raw = bytearray(p.read_bytes())
    raw[700] ^= 0xFF  # inside the first member's token array
    p.write_bytes(bytes(raw))
    loader = ShardLoader(copy, "validation", micro_batch=1)
    with pytest.raises(DataError, match=r"validation-00000\.tar does not match index\.json"):
        next(iter(loader.iter_once()))
