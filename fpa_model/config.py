"""Typed model configuration (the `model:` section of a run config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The one list of each choice: the ops, the ring and the configs import these (no torch here, so the
# configs stay quick to load).
ATTENTION_KINDS = ("fpa", "fox", "softmax")
FIELD_MODES = ("walk", "gate", "direct")
ATTENTION_IMPLS = ("auto", "naive", "chunked", "triton")
# Sequence parallelism (fpa_model.sequence_parallel): how a sequence is cut over ranks, how they attend.
SP_LAYOUTS = ("zigzag", "contiguous")
SP_MODES = ("ring", "ulysses")
# qk-norm gains: one (Dh) vector per head (FoX-Pro's default), or one shared by every head (this project's
# runs before the choice existed, and FoX's old backward-compatible mode).
QK_NORM_GAINS = ("per_head", "shared")


@dataclass
class AttentionConfig:
    kind: str = "fpa"  # fpa | fox | softmax: the ablation axis
    field: str = "walk"  # walk | gate | direct: how the FPA field phi is parametrized
    impl: str = "auto"  # auto (triton on CUDA, chunked on CPU) | naive | chunked | triton
    block_size: int = 128  # tile size of the chunked path (CPU: 128-256 measured 10-15% faster than 64)
    output_gate: bool = False  # FoX "Pro": sigmoid gate on the attention output
    # FoX "Pro": RMSNorm of each head's attention output over its Dh channels, with gains per head and
    # channel, before the output gate and the out projection.
    output_norm: bool = False
    qk_norm: bool = False  # FoX "Pro": RMSNorm on q and k per head
    # per_head: gains (H, Dh) for q and for k; shared: one (Dh) gain across heads. A saved config from
    # before the key (qk_norm on, no qk_norm_gains) loads as shared (pipeline.config.from_yaml_text).
    qk_norm_gains: str = "per_head"
    # With qk_norm, |q| = |k| = sqrt(Dh) x gains, so the logits are capped near sqrt(Dh) x gain^2 (5.7 at
    # Dh = 32) and the gains (init 1) move slowly: a head cannot sharpen enough to pick one key out of
    # 8x more keys than it was trained on. This is the logit scale at init as a multiple of 1/sqrt(Dh): the
    # q and k gains start at its square root and still learn (the cache's eviction bound reads them).
    qk_norm_scale: float = 1.0
    # Log-n attention scaling past the training length L (this value; None: off): the query at position
    # i >= L has its logits multiplied by ln(i + 1) / ln(L), 1 inside the training length, so training on
    # sequences of at most L tokens is unchanged (1.375 at 8x for L = 256). Softmax over n keys dilutes a
    # head's pick by ~ln(n); the factor keeps a head as sharp among 8x the keys as it was trained to be
    # (bench/passkey_sharpness.py). Configs set it to ${data.seq_len}.
    log_scale_length: int | None = None
    # FoX "Pro": data-dependent key/value shift, k'_t = g k_t + (1 - g) k_{t-1} (same for v) with a
    # per-head gate g = sigmoid(W x_t + b) (zero init: a 50/50 mix); false adds no parameters.
    kv_shift: bool = False
    # Packed windows hold several documents: true makes every query attend only inside its own document
    # (segment ids from the end-of-document tokens, data_prep.loader.document_segments) and restarts RoPE
    # positions at each document start. false: the window is one sequence (as before the switch existed).
    document_mask: bool = False
    # Tile skipping (fpa_model/ops/fpa/skipping.py): key tiles whose softmax mass is provably below this
    # fraction of every query row of the tile are not computed, forward and backward (fpa, fox; softmax
    # has no field and computes every tile). Served by the chunked path and the Triton kernels; null
    # (off) computes every tile.
    skip_epsilon: float | None = None
    rope: bool | None = None  # None: on for softmax only (fpa/fox get position from the field)
    rope_theta: float = 10000.0
    # Init of the per-head field bias c_h: the increments start slightly negative so a fresh model
    # behaves like FoX with its usual forget-gate init. Heads are spread between the two values.
    field_bias_init: list[float] = dataclasses.field(default_factory=lambda: [-0.2, -0.02])
    # Init std of the field weights w_h. 0: every increment starts at c_h, so an fpa head starts as an
    # exact FoX head with constant decay (the weights still get gradients and move away from 0).
    field_weight_std: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("model.attention.kind", self.kind, ATTENTION_KINDS)
        _check_choice("model.attention.field", self.field, FIELD_MODES)
        _check_choice("model.attention.impl", self.impl, ATTENTION_IMPLS)
        _check_choice("model.attention.qk_norm_gains", self.qk_norm_gains, QK_NORM_GAINS)
        if len(self.field_bias_init) not in (1, 2):
            raise ValueError(
                f"model.attention.field_bias_init must hold 1 or 2 values; got {list(self.field_bias_init)}"
            )
        if self.block_size < 1:
            raise ValueError(f"model.attention.block_size must be >= 1, got {self.block_size}")
        if not self.qk_norm_scale > 0:
            raise ValueError(f"model.attention.qk_norm_scale must be > 0, got {self.qk_norm_scale}")
        if self.log_scale_length is not None and self.log_scale_length < 2:
            raise ValueError(
                f"model.attention.log_scale_length must be >= 2 (a training length) or null; "
                f"got {self.log_scale_length}"
            )
        skip = check_skip_epsilon(self.skip_epsilon, where="model.attention.skip_epsilon")
        if skip is not None and self.impl == "naive":
            raise ValueError(
                "model.attention.skip_epsilon is served by impl chunked, triton or auto; got impl 'naive' "
                "(the naive oracle computes every pair)"
            )
        if self.qk_norm_scale != 1.0 and not self.qk_norm:
            raise ValueError(
                f"model.attention.qk_norm_scale={self.qk_norm_scale} needs model.attention.qk_norm=true "
                "(it sets the qk-norm gains)"
            )

    @property
    def use_rope(self) -> bool:
        return self.kind == "softmax" if self.rope is None else self.rope


@dataclass
class ModelConfig:
    vocab_size: int | None = None  # None: taken from the prepared data's tokenizer
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    mlp_hidden: int | None = None  # None: SwiGLU width 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 4096  # only bounds RoPE tables and decode buffers
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "d_model"):  # before the modulo: n_head=0 would divide by zero
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be >= 1; got {getattr(self, key)}")
        if self.d_model % self.n_head:
            raise ValueError(f"model.n_head ({self.n_head}) must divide model.d_model ({self.d_model})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return ((8 * self.d_model // 3) + 63) // 64 * 64


def check_skip_epsilon(epsilon: float | None, *, where: str = "skip_epsilon") -> float | None:
    """epsilon as a float in (0, 1) (the softmax mass a row may lose to skipped tiles), None for off; a
    one-line error naming `where` for anything else (NaN, bools and strings included)."""
    if epsilon is None:
        return None
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise ValueError(f"{where} must be a number in (0, 1) or null (off); got {epsilon!r}")
    eps = float(epsilon)
    if not (0.0 < eps < 1.0):  # NaN fails this too
        raise ValueError(f"{where} must be in (0, 1) (the softmax mass a row may lose) or null; got {eps}")
    return eps


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
