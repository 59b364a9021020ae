"""Training features of issue 17 (point 3): the warmup-stable-decay schedule, activation checkpointing, the
chunked cross-entropy and the loss-spike guard. Each test would fail without its feature: the schedule's
values and one-line config errors, equal losses/gradients with a feature on and off, a planted spike
skipped, and a resume that keeps the spike guard's window."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
from test_train_support import read_metrics, run_training, summary_of, write_config

from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT
from pipeline.config import ConfigError, TrainConfig, load_config
from pipeline.trainer.loss import lm_loss
from pipeline.trainer.schedule import decay_start, lr_at

# ----------------------------------------------------------------------------------------------------
# Schedule


def test_wsd_holds_then_decays_with_each_shape():
    tc = TrainConfig(
        lr=1.0, warmup_steps=2, max_steps=12, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.25
    )
    assert decay_start(12, 2, 0.25) == 9
    for shape in ("linear", "cosine", "sqrt"):
        tc.decay_shape = shape
        lrs = [lr_at(s, tc) for s in range(13)]
        assert lrs[:2] == [0.5, 1.0]  # the same warmup as cosine
        assert lrs[2:10] == [1.0] * 8  # stable up to and including the decay start
        assert lrs[12] == pytest.approx(0.1) and lrs[11] > lrs[12]
        p = 1 / 3  # step 10 is a third of the way through the 3 decay steps
        want = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "sqrt": 1 - math.sqrt(p)}[shape]
        assert lrs[10] == pytest.approx(0.1 + 0.9 * want), shape
    # The stable phase does not depend on max_steps: a longer run shares it (more token budgets).
    longer = TrainConfig(**{**tc.__dict__, "max_steps": 40})
    assert [lr_at(s, longer) for s in range(10)] == [lr_at(s, tc) for s in range(10)]


def test_cosine_stays_the_default():
    tc = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert tc.schedule == "cosine"
    assert lr_at(9, tc) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.schedule=linear", "train.schedule must be cosine or wsd"),
        ("train.decay_shape=exp", "train.decay_shape must be linear, cosine or sqrt"),
        ("train.decay_fraction=0", "train.decay_fraction must be in (0, 1]"),
        ("train.decay_fraction=1.5", "train.decay_fraction must be in (0, 1]"),
        ("train.loss_chunk_tokens=-1", "train.loss_chunk_tokens must be >= 0"),
        ("train.spike_guard.factor=0.5", "train.spike_guard.factor must be > 1"),
        ("train.spike_guard.window=0", "train.spike_guard.window must be >= 1"),
        ("train.spike_guard.action=warn", "train.spike_guard.action must be skip or stop"),
    ],
)
def test_new_train_keys_are_checked_in_one_line(override, match):
    with pytest.raises(ConfigError) as e:
        load_config([], [override])
    msg = str(e.value)
    assert msg.startswith(match) and "\n" not in msg and f"(set in override '{override}')" in msg, msg


def test_chunked_loss_refuses_zero3_at_load():
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens needs train.zero_stage <= 2"):
        load_config([], ["train.loss_chunk_tokens=64", "train.zero_stage=3"])


# ----------------------------------------------------------------------------------------------------
# Chunked cross-entropy and activation checkpointing against the plain computation


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    att = AttentionConfig(kind="fpa", field="walk", impl="naive", field_weight_std=0.5)
    cfg = ModelConfig(vocab_size=97, n_layer=2, n_head=2, d_model=32, max_seq_len=64, attention=att)
    return GPT(cfg, **kw)


@pytest.mark.parametrize("chunk", [1, 7, 24, 1000])  # 7: chunks that do not divide the 48 tokens
def test_chunked_loss_equals_plain_loss_and_gradients(chunk):
    model = _tiny_gpt()
    other = copy.deepcopy(model)
    idx = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:].clone()
    y[0, 3] = y[1, 20] = -100  # ignored targets (passkey rows) count in neither form
    plain = lm_loss(model(x), y)
    plain.backward()
    chunked = lm_loss(other(x, head=False), y, head=other.lm_head.weight, chunk_tokens=chunk)
    chunked.backward()
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    ref = _grads(model)
    for name, g in _grads(other).items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_never_makes_all_logits_at_once():
    """Every tensor with a vocab dimension made by the chunked loss, forward and backward, has at most
    chunk rows (the plain loss makes several of 48 rows)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                # (32, 97) is the head weight's transpose (d_model x vocab), not logits
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == 97 and t.shape[0] != 32:
                    self.rows.append(t.shape[0])
            return out

    model = _tiny_gpt()
    idx = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(1))
    hidden = model(idx[:, :-1], head=False)
    with Shapes() as chunked:
        lm_loss(hidden, idx[:, 1:], head=model.lm_head.weight, chunk_tokens=8).backward(retain_graph=True)
    with Shapes() as plain:
        lm_loss(model.lm_head(hidden), idx[:, 1:]).backward()
    assert chunked.rows and max(chunked.rows) == 8
    assert max(plain.rows) == 48  # the control: the spy sees the full logits of the plain loss


def test_chunked_loss_bf16_tracks_fp32():
    model = _tiny_gpt()
    idx = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(1))
    ref = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    half = copy.deepcopy(model).to(torch.bfloat16)
    got = lm_loss(half(idx[:, :-1], head=False), idx[:, 1:], head=half.lm_head.weight, chunk_tokens=16)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=2e-2)
    got.backward()
    assert half.lm_head.weight.grad.dtype == torch.bfloat16


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    plain, ckpt = _tiny_gpt(), _tiny_gpt(activation_checkpointing=True)
    idx = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(1))
    calls = [0]
    for block in ckpt.blocks:  # the blocks run twice (forward, then the recompute in backward)
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    a = lm_loss(plain(idx[:, :-1]), idx[:, 1:])
    b = lm_loss(ckpt(idx[:, :-1]), idx[:, 1:])
    a.backward()
    b.backward()
    assert calls[0] == 2 * len(ckpt.blocks)
    assert torch.equal(a, b)
    ref = _grads(plain)
    for name, g in _grads(ckpt).items():
        torch.testing.assert_close(g, ref[name], rtol=0, atol=0, msg=name)


def _sp_chunked(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from fpa_model.sequence_parallel import shard_sequence

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, 8, generator=g, dtype=torch.float64)
    head = torch.randn(11, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (2, 16), generator=g)
    y[0, 2] = y[1, 13] = -100
    full_h, full_w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    logits = (full_h @ full_w.t()).flatten(0, 1)
    ref = torch.nn.functional.cross_entropy(logits, y.flatten(), ignore_index=-100)  # fp64, as given
    ref.backward()
    h = shard_sequence(hidden, rank, world, dim=1).requires_grad_()
    w = head.clone().requires_grad_()
    loss = lm_loss(h, shard_sequence(y, rank, world, dim=1), head=w, chunk_tokens=5, group=dist.group.WORLD)
    loss.backward()
    dw = w.grad.clone()
    dist.all_reduce(dw)  # the ranks' shares of the head's gradient sum to the full one
    errs = [
        abs(loss.item() - ref.item()),
        float((h.grad - shard_sequence(full_h.grad, rank, world, dim=1)).abs().max()),
        float((dw - full_w.grad).abs().max()),
    ]
    torch.save(errs, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_chunked_loss_under_sequence_parallel_equals_full_batch(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sp_chunked, args=(2, port, str(tmp_path / "errs")), nprocs=2)
    for r in range(2):
        assert max(torch.load(tmp_path / f"errs.{r}")) < 1e-12


# ----------------------------------------------------------------------------------------------------
# Through the trainer


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("cfg"))


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir).items() if "loss" in r}


@pytest.mark.parametrize("stage", [0, 2])
def test_trainer_with_chunked_loss_and_activation_checkpointing_matches_plain(stage, cfg_path, tmp_path):
    """Same curve and validation loss with both memory savers on (ZeRO-2: the head's gradient reaches
    DeepSpeed's partitioned buffers); the wsd lr lands in metrics.jsonl."""
    over = ["train.max_steps=6", "train.val_every=6", "train.schedule=wsd", "train.decay_fraction=0.5"]
    over.append(f"train.zero_stage={stage}")
    a, b = tmp_path / "a", tmp_path / "b"
    pa = run_training(cfg_path, [*over, f"runs_dir={a}"])
    pb = run_training(
        cfg_path,
        [*over, "train.loss_chunk_tokens=24", "train.activation_checkpointing=true", f"runs_dir={b}"],
    )
    la, lb = losses(a / "t"), losses(b / "t")
    assert sorted(la) == sorted(lb) == list(range(1, 7))
    for s in la:
        assert lb[s] == pytest.approx(la[s], rel=2e-5), s
    assert summary_of(pb)["val_loss"] == pytest.approx(summary_of(pa)["val_loss"], rel=2e-5)
    tc = load_config([cfg_path], over).train
    assert [r["lr"] for r in read_metrics(b / "t").values()] == [lr_at(s, tc) for s in range(6)]
    assert [r["lr"] for r in read_metrics(b / "t").values()][1:3] == [tc.lr, tc.lr]  # stable phase


@pytest.mark.distributed
def test_sequence_parallel_trainer_with_chunked_loss_matches_one_rank(cfg_path, tmp_path):
    """Two ranks sharing every sequence, each applying the head to its chunks of tokens: the group-wide
    loss and its gradient give the 1-rank plain curve."""
    over = ["train.micro_batch=2", "train.grad_accum=2", "train.max_steps=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    run_training(cfg_path, [*over, f"runs_dir={a}"])
    sp = ["parallel.sequence=2", "train.loss_chunk_tokens=24"]
    run_training(cfg_path, [*over, *sp, f"runs_dir={b}"], nproc=2)
    la, lb = losses(a / "t"), losses(b / "t")
    assert sorted(lb) == [1, 2, 3, 4]
    for s in la:
        assert lb[s] == pytest.approx(la[s], rel=5e-5), s


SPIKE = [
    "train.micro_batch=2",
    "train.grad_accum=2",
    "train.warmup_steps=100",
    "train.spike_guard.factor=3",
    "train.spike_guard.window=2",
    "train.checkpoint.every=2",
    "train.checkpoint.keep_last=5",
]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_planted_spike_is_skipped_and_resume_keeps_the_guard_window(stage, cfg_path, tmp_path):
    """Step index 3's loss is multiplied by 1000 (its last micro batch: the first one is already
    backpropagated). The step is skipped: the weights after it equal those after 3 steps. A run resumed
    from step 2 judges step 3 with the window restored from the checkpoint (with an empty window it would
    have no verdict and train on the spike) and continues on the same curve."""
    from test_train import assert_same_weights

    over = [*SPIKE, f"train.zero_stage={stage}"]
    spike = {"FPA_TEST_SPIKE_STEP": "3"}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_training(cfg_path, [*over, "train.max_steps=3", f"runs_dir={a}"])
    proc = run_training(cfg_path, [*over, "train.max_steps=6", f"runs_dir={b}"], env=spike)
    assert summary_of(proc)["spike_skipped_steps"] == 1 and summary_of(proc)["skipped_steps"] == 0
    assert "loss spike" in proc.stdout
    recs = read_metrics(b / "t")
    # Skip records carry the step index (3), loss records the steps done: index 3 would be step 4.
    assert recs[3].get("spike") is True and 4 not in recs and "loss" in recs[2] and "loss" in recs[5]
    assert_same_weights(a / "t", b / "t", 3, tmp_path / "export", tol=0.0, step_b=4)
    client = torch.load(
        b / "t" / "checkpoints" / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False
    )
    assert client["spike_skipped_steps"] == 1 and len(client["spike_window"]) == 2

    (c / "t" / "checkpoints").mkdir(parents=True)
    shutil.copytree(b / "t" / "checkpoints" / "global_step2", c / "t" / "checkpoints" / "global_step2")
    proc = run_training(cfg_path, [*over, "train.max_steps=6", f"runs_dir={c}"], env=spike)
    assert "at step 2" in proc.stdout and summary_of(proc)["spike_skipped_steps"] == 1
    assert read_metrics(c / "t")[3].get("spike") is True
    lb, lc = losses(b / "t"), losses(c / "t")
    for s in (5, 6):
        assert lc[s] == pytest.approx(lb[s], rel=1e-6, abs=1e-7), s


def test_spike_stop_policy_fails_with_a_clear_error(cfg_path, tmp_path):
    proc = run_training(
        cfg_path,
        [*SPIKE, "train.max_steps=5", "train.spike_guard.action=stop", f"runs_dir={tmp_path}"],
        env={"FPA_TEST_SPIKE_STEP": "3"},
        check=False,
    )
    assert proc.returncode != 0
    assert "loss spike at step 3: loss" in proc.stderr and "train.spike_guard.action=stop" in proc.stderr
