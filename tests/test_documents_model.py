"""model.attention.document_mask end to end: segment ids from the end-of-document tokens, a masked model on
a packed window against its documents run one by one, the training loss wiring, and the paths that refuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_prep.loader import document_segments
from fpa_model.cache import KVCache
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT
from fpa_model.ops.fpa.segments import document_positions
from pipeline.trainer.step import micro_loss

EOD = 0


def test_document_segments_and_positions():
    """An end-of-document token ends (and belongs to) its document; a document cut by the window start is
    segment 0; positions restart after every end-of-document token."""
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9], [EOD, EOD, EOD, EOD, 1, 2, 3, 4]])
    seg = document_segments(tokens, EOD)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 2, 3, 4, 4, 4, 4]]
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 1, 2, 3]]


def _model(kind: str, **attn) -> GPT:
    torch.manual_seed(0)
    attn = {"impl": "chunked", **attn}
    cfg = ModelConfig(
        vocab_size=31, n_layer=2, n_head=2, d_model=32,
        attention=AttentionConfig(kind=kind, block_size=8, field_weight_std=0.3, **attn),
    )  # fmt: skip
    return GPT(cfg).eval()


def _documents(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Documents of these lengths, each ending in the end-of-document token (no other one inside)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(1, 31, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]


@pytest.mark.parametrize("kind", ["fpa", "fox", "softmax"])
@pytest.mark.parametrize("impl", ["naive", "chunked"])
@pytest.mark.parametrize("log_len", [None, 6])
@pytest.mark.parametrize("kv_shift", [False, True])
def test_packed_window_loss_is_the_sum_of_its_documents_losses(kind, impl, log_len, kv_shift):
    """A masked model's summed token loss on a packed window equals the sum of its documents' losses, each
    document run alone (the logits too). softmax has RoPE, so the positions must restart as well; so must
    the log-n factor (log_len 6: documents longer than 6 tokens have queries it scales), and the key/value
    shift must not mix a document's last token into the next one's first."""
    model = _model(kind, document_mask=True, impl=impl, log_scale_length=log_len, kv_shift=kv_shift)
    docs = _documents([7, 1, 12, 1, 9, 18, 1, 16], seed=3)  # 65 tokens: a window of 64 and its targets
    window = torch.cat(docs)[None]
    x, y = window[:, :-1], window[:, 1:]
    packed = model(x, segment_ids=document_segments(x, EOD))
    loss_sum = F.cross_entropy(packed[0], y[0], reduction="sum")
    want, start = 0.0, 0
    for d in docs:
        n = min(len(d), x.shape[1] - start)
        if n <= 0:
            break
        alone = model(x[:, start : start + n], segment_ids=torch.zeros(1, n, dtype=torch.long))
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=2e-5, rtol=2e-5)
        want = want + F.cross_entropy(alone[0], y[0, start : start + n], reduction="sum")
        start += n
    torch.testing.assert_close(loss_sum, want, atol=1e-4, rtol=1e-5)
    # Without the mask the same window is one sequence: the loss differs (the test can tell).
    plain = _model(kind, impl=impl, log_scale_length=log_len, kv_shift=kv_shift)
    assert not torch.allclose(plain(x), packed, atol=1e-3)


@pytest.mark.parametrize("kv_shift", [False, True])
def test_masked_gradients_match_documents_alone(kv_shift):
    """The training gradient of the packed window equals that of its documents run one by one (with the
    key/value shift, its gates' gradients too)."""
    model = _model("fpa", document_mask=True, kv_shift=kv_shift)
    docs = _documents([5, 1, 20, 14, 9], seed=4)
    x = torch.cat(docs)[None]
    model.zero_grad()
    F.cross_entropy(model(x, segment_ids=document_segments(x, EOD))[0], x[0], reduction="sum").backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    start = 0
    for d in docs:
        xs = x[:, start : start + len(d)]
        F.cross_entropy(model(xs, segment_ids=torch.zeros_like(xs))[0], xs[0], reduction="sum").backward()
        start += len(d)
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, atol=2e-4, rtol=2e-4, msg=lambda m, n=n: f"{n}: {m}")


class _Engine:
    def __init__(self, model):
        self.module = model

    def __call__(self, *a, **kw):
        return self.module(*a, **kw)


def test_micro_loss_passes_segment_ids():
    model = _model("fpa", document_mask=True)
    batch = torch.cat(_documents([10, 3, 20, 1, 31], seed=5))[None]  # (1, T + 1)
    loss, _ = micro_loss(_Engine(model), batch, torch.device("cpu"), None, eod_id=EOD)
    x, y = batch[:, :-1], batch[:, 1:]
    want = F.cross_entropy(model(x, segment_ids=document_segments(x, EOD))[0], y[0])
    torch.testing.assert_close(loss, want)
    with pytest.raises(ValueError, match="needs segment_ids"):
        micro_loss(_Engine(model), batch, torch.device("cpu"), None)


def test_paths_without_the_mask_refuse_it():
    model = _model("fpa", document_mask=True)
    with pytest.raises(ValueError, match="needs the end-of-document id"):
        KVCache.for_model(model)
    with pytest.raises(ValueError, match="without model.attention.document_mask"):
        _model("fpa")(torch.zeros(1, 4, dtype=torch.long), segment_ids=torch.zeros(1, 4, dtype=torch.long))
    from pipeline.export import hf_model

    with pytest.raises(ValueError, match="the HF export needs eos_id"):
        hf_model(model)


def test_trainer_with_document_mask_on_prepared_shards(tmp_path):
    """`python -m pipeline.train` with model.attention.document_mask=true on real prepared shards (whose
    windows hold several documents): segment ids from the index's end-of-document id reach the model in
    training and validation, the loss falls and the checkpoint's config keeps the switch."""
    import json
    import os
    import subprocess
    import sys

    from test_train_support import REPO, prepare_word_corpus

    prepare_word_corpus(tmp_path)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        f"""
name: docs
runs_dir: {tmp_path / "runs"}
model: {{n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64,
        attention: {{kind: fpa, impl: chunked, block_size: 8, document_mask: true}}}}
data: {{out_dir: {tmp_path / "data"}, seq_len: 32}}
train: {{micro_batch: 4, max_steps: 6, lr: 1.0e-2, warmup_steps: 2, log_every: 3, val_every: 6,
         val_batches: 2, checkpoint: {{every: 6}}}}
logging: {{wandb_mode: disabled, progress: false}}
"""
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.train", str(cfg_file)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[train] summary "))
    summary = json.loads(line[len("[train] summary ") :])
    assert summary["steps"] == 6 and summary["val_loss"] is not None
    recs = [json.loads(x) for x in (tmp_path / "runs" / "docs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    client = torch.load(tmp_path / summary["checkpoint"] / "mp_rank_00_model_states.pt", weights_only=False)
    assert "document_mask: true" in client["config_yaml"]


@pytest.mark.parametrize("kind", ["fpa", "softmax"])
def test_bad_segment_ids_given_to_the_model_are_one_line_errors(kind):
    """Checked before the RoPE positions are read off them (softmax has RoPE): a wrong shape, a decrease
    inside a window, a float tensor; under sequence parallelism (one rank) ids that are not the whole
    sequence's."""
    from fpa_model.sequence_parallel import SequenceParallel

    model = _model(kind, document_mask=True)
    x = torch.randint(1, 31, (2, 12))
    good = document_segments(x, EOD)
    for seg, match in [
        (good[:, :-1], "must be \\(B, Tk\\) = \\(2, 12\\)"),
        (good[:1], "must be \\(B, Tk\\) = \\(2, 12\\)"),
        (torch.tensor([[0] * 6 + [1] * 3 + [0] * 3] * 2), "non-decreasing"),
        (good.float(), "integer tensor"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            model(x, segment_ids=seg)
        assert "\n" not in str(e.value)
    model.set_sequence_parallel(SequenceParallel())
    with pytest.raises(ValueError, match="whole sequence's \\(B, T\\) = \\(2, 12\\)"):
        model(x, segment_ids=good[:, :6])
    with pytest.raises(ValueError, match="non-decreasing"):
        model(x, segment_ids=torch.tensor([[0] * 6 + [1] * 3 + [0] * 3] * 2))
