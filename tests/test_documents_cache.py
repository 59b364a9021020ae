"""model.attention.document_mask in the KV-cache decoder: a prompt holding end-of-document tokens starts a
new document after each (row by row): decoding equals the masked forward on the packed prompt, keys of
ended documents leave the cache, and the evicting cache still runs."""

from __future__ import annotations

import pytest
import torch

from data_prep.loader import document_segments
from fpa_model.cache import EvictionPolicy, KVCache, generate, prefill
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT

EOD = 0


def _model(kind: str, log_len: int | None = None, kv_shift: bool = False) -> GPT:
    torch.manual_seed(0)
    att = AttentionConfig(kind=kind, impl="chunked", block_size=4, field_weight_std=0.5, document_mask=True,
                          log_scale_length=log_len, kv_shift=kv_shift)  # fmt: skip
    return GPT(ModelConfig(vocab_size=29, n_layer=2, n_head=2, d_model=32, attention=att)).eval()


def _prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(1, 29, (3, 23), generator=g)
    x[0, [3, 4, 15]] = EOD  # a one-token document (the second eod), an eod on a chunk edge below
    x[1, [9]] = EOD
    x[2, -1] = EOD  # row 2: one document, ended by the last prompt token
    return x


@pytest.mark.parametrize("kind", ["fpa", "fox", "softmax"])
@pytest.mark.parametrize("chunk", [None, 5, 1])
@pytest.mark.parametrize(("log_len", "kv_shift"), [(None, False), (4, False), (None, True)])
def test_decode_equals_masked_forward_on_a_packed_prompt(kind, chunk, log_len, kv_shift):
    """log_len 4: the log-n factor at document positions >= 4, in decode as in the forward. kv_shift: the
    first token after an eod mixes in zeros, not the eod's key and value (chunk 1: across decode steps)."""
    model = _model(kind, log_len, kv_shift)
    x = _prompt()
    with torch.no_grad():
        want = model(x, segment_ids=document_segments(x, EOD))
        got, cache = prefill(model, x, chunk_size=chunk, all_logits=True, eod_id=EOD)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # Keys of ended documents are gone: row 0 keeps only its last document (positions 16..22), row 1 its
    # second (10..22).
    for lc in cache.layers:
        assert lc.kept_positions(0, 0) == list(range(16, 23))
        assert lc.kept_positions(1, 1) == list(range(10, 23))


@pytest.mark.parametrize("kind", ["fpa", "fox", "softmax"])
@pytest.mark.parametrize("kv_shift", [False, True])
def test_generate_after_an_end_of_document_is_a_fresh_document(kind, kv_shift):
    """Greedy tokens after a prompt whose last document starts after an eod are those of that document
    run alone: the earlier document is invisible, RoPE restarts and the shift mixes in nothing of it."""
    model = _model(kind, kv_shift=kv_shift)
    x = _prompt()
    new, _ = generate(model, x[:1], 6, eod_id=EOD)
    alone, _ = generate(model, x[:1, 16:], 6, eod_id=EOD)
    assert new.tolist() == alone.tolist()
    # Step by step against the masked forward of the prompt plus what was generated.
    full = torch.cat([x[:1], new[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(full, segment_ids=document_segments(full, EOD))
    assert logits[0, x.shape[1] - 1 :].argmax(-1).tolist() == new[0].tolist()


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_evicting_cache_with_documents(kind):
    model = _model(kind)
    x = _prompt()
    with torch.no_grad():
        want = model(x, segment_ids=document_segments(x, EOD))
        got, cache = prefill(model, x, policy=EvictionPolicy(enabled=True), chunk_size=4, all_logits=True,
                             eod_id=EOD)  # fmt: skip
    assert torch.isfinite(got).all()
    # The sound bound: evicted keys carry at most exp(-margin) of the softmax mass.
    assert (got.softmax(-1) - want.softmax(-1)).abs().max() < 0.2
    assert all(c <= x.shape[1] for c in cache.capacity())


def test_a_masked_cache_needs_the_eod_id():
    with pytest.raises(ValueError, match="needs the end-of-document id"):
        KVCache.for_model(_model("fpa"))
