"""transformers config of the FPA / FoX / softmax GPT (`fpa export --format hf` ships this file).

The project's whole `model:` section is kept as one dict (`fpa_model`), so the modeling file rebuilds the
exact fpa_model.config.ModelConfig; the usual transformers names (hidden_size, ...) are copies for tools
that read them (lm-eval reads max_position_embeddings as the context length). `evict*` and
`prefill_chunk` set the KV-cache eviction policy of `generate()` (fpa_model.cache.EvictionPolicy).
`document_eod_id` (document_mask models only) is the end-of-document token that separates packed documents.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class FPAConfig(PretrainedConfig):
    model_type = "fpa_gpt"

    def __init__(
        self,
        fpa_model: dict[str, Any] | None = None,
        evict: bool = False,
        evict_margin: float = 2.0,
        evict_delta: float | None = None,
        evict_norm_slack: float = 1.25,
        evict_max_tokens: int | None = None,
        prefill_chunk: int | None = None,
        document_eod_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.fpa_model = dict(fpa_model or {})
        self.evict = evict
        self.evict_margin = evict_margin
        self.evict_delta = evict_delta
        self.evict_norm_slack = evict_norm_slack
        self.evict_max_tokens = evict_max_tokens
        self.prefill_chunk = prefill_chunk
        # model.attention.document_mask: the end-of-document token documents are cut after (no position_ids)
        self.document_eod_id = document_eod_id
        m = self.fpa_model
        # Mirrors for tools that look for the standard names; the dict above is what the model is built from.
        self.vocab_size = m.get("vocab_size")
        self.hidden_size = m.get("d_model")
        self.num_hidden_layers = m.get("n_layer")
        self.num_attention_heads = m.get("n_head")
        self.max_position_embeddings = m.get("max_seq_len")
        kwargs.setdefault("tie_word_embeddings", bool(m.get("tie_embeddings", True)))
        super().__init__(**kwargs)
