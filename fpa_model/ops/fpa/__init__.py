"""The FPA attention family (fpa | fox | softmax): naive reference, chunked PyTorch path, Triton kernel."""

from fpa_model.ops.fpa.naive import fpa_attention_naive, fpa_bias_naive

__all__ = ["fpa_attention_naive", "fpa_bias_naive"]
