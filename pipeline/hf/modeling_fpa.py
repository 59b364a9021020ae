"""transformers model of the FPA / FoX / softmax GPT (`fpa export --format hf` ships this file).

This file does not re-implement attention: it imports the installed `fpa_model` package (this project,
`pip install -e .` or the wheel), wraps its GPT unchanged (`self.model`), and uses its KV cache
(fpa_model.cache: prefill / decode steps, FPA/FoX key eviction) as the `generate()` cache. Loading an
export with trust_remote_code=True therefore needs `fpa_model` importable; its logits are the project's.

Cache: the object in `outputs.cache` (`past_key_values` on older transformers) is an FPACache, the
project's KVCache. Eviction follows the config (`evict`, `evict_margin`, ...), or pass your own cache:
`model.generate(ids, cache=model.new_cache(EvictionPolicy(enabled=True)))`. Padding is not supported
(an attention mask with zeros is an error): batch prompts of equal length, or one at a time.
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

from .configuration_fpa import FPAConfig

# transformers 5 calls the cache `cache`; 4.x called it `past_key_values`.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def model_config(d: dict[str, Any]) -> ModelConfig:
    """fpa_model's ModelConfig from the dict FPAConfig holds."""
    d = dict(d)
    attention = AttentionConfig(**d.pop("attention", {}))
    return ModelConfig(**d, attention=attention)


def model_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


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
        return FPACache.for_model(self.model, policy or self.eviction_policy())

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: FPACache | None = None,
        past_key_values: FPACache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits (B,T,V) of the project's GPT. With a cache (or use_cache=True) the tokens go through
        fpa_model.cache.prefill after the tokens the cache has seen; without, one full forward pass."""
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
            logits, cache = prefill(
                self.model, input_ids, cache, all_logits=True, chunk_size=self.config.prefill_chunk
            )
        else:
            logits = self.model(input_ids)
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
