"""transformers model of the FPA / FoX / softmax GPT (`fpa export --format hf` ships this file).

This file does not re-implement attention: it imports the installed `fpa_model` package (this project,
`pip install -e .` or the wheel), wraps its GPT unchanged (`self.model`), and uses its KV cache
(fpa_model.cache: prefill / decode steps, FPA/FoX key eviction) as the `generate()` cache. Loading an
export with trust_remote_code=True therefore needs `fpa_model` importable; its logits are the project's.

Cache: the object in `outputs.cache` (`past_key_values` on older transformers) is an FPACache, the
project's KVCache. Eviction follows the config (`evict`, `evict_margin`, ...), or pass your own cache:
`model.generate(ids, cache=model.new_cache(EvictionPolicy(enabled=True)))`. Padding is not supported
(an attention mask with zeros is an error): batch prompts of equal length, or one at a time.

Packed documents (a model trained with model.attention.document_mask): each query attends only inside its
own document. The full forward takes the documents from `position_ids` when given (transformers'
DataCollatorWithFlattening: every position id 0 starts a document, as transformers' flash-attention
varlen path cuts them; inside a document the ids must count up by 1), else from the end-of-document token
(config.document_eod_id; it ends, and belongs to, its document, as in training). With a cache (generate)
a token after the end-of-document token starts a new document; position_ids resets are then an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from fpa_model.attention import Attention, rope_cos_sin
from fpa_model.cache import EvictionPolicy, KVCache, prefill
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT
from fpa_model.ops.fpa.segments import document_positions

from .configuration_fpa import FPAConfig

# transformers 5 calls the cache `cache`; 4.x called it `past_key_values`.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def model_config(d: dict[str, Any]) -> ModelConfig:
    """fpa_model's ModelConfig from the dict FPAConfig holds."""
    d = dict(d)
    att = dict(d.pop("attention", {}))
    if att.get("qk_norm") and "qk_norm_gains" not in att:  # exported before per-head gains: shared ones
        att["qk_norm_gains"] = "shared"
    attention = AttentionConfig(**att)
    return ModelConfig(**d, attention=attention)


def model_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def segments_from_positions(position_ids: Tensor) -> Tensor:
    """(B, T) segment ids of packed inputs from position_ids (B, T) that restart at 0 at every document
    (DataCollatorWithFlattening): each 0 after the first token starts a new document. A one-line error
    unless the ids are 0, 1, 2, ... inside every document (the RoPE positions the model uses)."""
    starts = position_ids == 0
    starts[:, 0] = False
    seg = starts.long().cumsum(-1)
    if not torch.equal(document_positions(seg), position_ids.long()):
        raise ValueError(
            "position_ids must restart at 0 at each packed document and count up by 1 inside it "
            f"(DataCollatorWithFlattening); got {position_ids[0, :12].tolist()}..."
        )
    return seg


def _has_resets(position_ids: Tensor | None) -> bool:
    """A position id 0 after the first token: packed documents."""
    return position_ids is not None and bool((position_ids[..., 1:] == 0).any())


class FPACache(KVCache):
    """The project's KVCache, with the few methods transformers' generation code may ask a cache for."""

    is_compileable = False

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)  # every layer attends over all kept keys (none is recurrent)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen


class FPAPreTrainedModel(PreTrainedModel):
    config_class = FPAConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        # GPT.__init__ initializes its own weights (FoX recipe) and from_pretrained loads them all; only the
        # RoPE tables (buffers derived from the config, not saved) must be recomputed: transformers builds
        # the model on the meta device and leaves them uninitialized.
        if isinstance(module, Attention) and module.use_rope:
            cos, sin = rope_cos_sin(
                torch.arange(module.rope_cos.shape[0]), module.head_dim, module.cfg.rope_theta
            )
            module.rope_cos.copy_(cos)
            module.rope_sin.copy_(sin)


class FPAForCausalLM(FPAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: FPAConfig) -> None:
        super().__init__(config)
        self.model = GPT(model_config(config.fpa_model))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not make a DynamicCache: the model makes its own FPACache

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def eviction_policy(self) -> EvictionPolicy:
        c = self.config
        return EvictionPolicy(
            enabled=bool(c.evict),
            delta=c.evict_delta,
            margin=c.evict_margin,
            norm_slack=c.evict_norm_slack,
            max_tokens=c.evict_max_tokens,
        )

    def new_cache(self, policy: EvictionPolicy | None = None) -> FPACache:
        """An empty cache (the config's eviction policy unless one is given)."""
        eod = self.config.document_eod_id if self.model.cfg.attention.document_mask else None
        return FPACache.for_model(self.model, policy or self.eviction_policy(), eod_id=eod)

    def segment_ids(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor | None:
        """The documents of a full forward pass (see the module docstring); None without document_mask,
        where position_ids resets (packed documents the model cannot keep apart) are an error."""
        if not self.model.cfg.attention.document_mask:
            if _has_resets(position_ids):
                raise ValueError(
                    "position_ids restart inside the sequence (packed documents), but this model was trained "
                    "without model.attention.document_mask: it would attend across them"
                )
            return None
        if position_ids is not None:
            if position_ids.shape[-1] != input_ids.shape[-1]:
                raise ValueError(
                    f"position_ids {tuple(position_ids.shape)} do not match input_ids "
                    f"{tuple(input_ids.shape)} in length"
                )
            return segments_from_positions(position_ids.expand_as(input_ids))
        from data_prep.loader import document_segments

        eod = self.config.document_eod_id
        if eod is None:
            raise ValueError("a document_mask export needs config.document_eod_id (or position_ids)")
        return document_segments(input_ids, eod)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: FPACache | None = None,
        past_key_values: FPACache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits (B,T,V) of the project's GPT. With a cache (or use_cache=True) the tokens go through
        fpa_model.cache.prefill after the tokens the cache has seen; without, one full forward pass.
        position_ids: only packed documents' resets are read (see the module docstring)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("FPAForCausalLM does not support padding (attention_mask with zeros)")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, KVCache):
            if cache.get_seq_length() != 0:  # a transformers cache that already holds other keys
                raise ValueError(f"FPAForCausalLM takes an FPACache, not a filled {type(cache).__name__}")
            cache = None
            use_cache = True
        if cache is None and use_cache:
            cache = self.new_cache()
        if cache is not None:
            if _has_resets(position_ids):
                raise ValueError(
                    "packed position_ids (resets to 0) are served by the full forward (use_cache=False); "
                    "with a cache a new document starts after the end-of-document token"
                )
            logits, cache = prefill(
                self.model, input_ids, cache, all_logits=True, chunk_size=self.config.prefill_chunk
            )
        else:
            seg = self.segment_ids(input_ids, position_ids)
            logits = self.model(input_ids) if seg is None else self.model(input_ids, segment_ids=seg)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: FPACache | None = None,
        past_key_values: FPACache | None = None,
        attention_mask: Tensor | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        # generate() passes the whole sequence every step: feed only what the cache has not seen yet.
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, KVCache) and cache.get_seq_length() == 0:
            cache = None
        if cache is None and use_cache:
            cache = self.new_cache()
        seen = cache.seen if cache is not None else 0
        return {
            "input_ids": input_ids[:, seen:],
            "attention_mask": attention_mask,
            _CACHE_FIELD: cache,
            "use_cache": use_cache,
        }
