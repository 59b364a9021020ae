"""GPT with FPA / FoX / softmax attention: pre-norm blocks (RMSNorm), SwiGLU MLP, optional tied embeddings.

The parts are plain attributes (`embed`, `blocks[i].norm1 / attn / norm2 / mlp`, `norm_f`, `lm_head`) so
the KV-cache decoder can run the blocks one step at a time with `Block.attn.project / output` and
`Block.mlp` without going through `GPT.forward`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from fpa_model.attention import Attention, RMSNorm
from fpa_model.config import ModelConfig
from fpa_model.sequence_parallel import SequenceParallel


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_head, cfg.attention, cfg.max_seq_len)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: Tensor, segment_ids: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), segment_ids)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only language model: forward(idx (B,T) int64) -> logits (B,T,vocab)."""

    def __init__(self, cfg: ModelConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        # train.activation_checkpointing: recompute each block's activations in backward, not kept.
        self.activation_checkpointing = activation_checkpointing
        if cfg.vocab_size is None or cfg.vocab_size < 1:
            raise ValueError(
                "model.vocab_size must be set (train() takes it from the data index when it is null)"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """FoX / GPT-2 recipe: normal(init_std), residual projections scaled by 1/sqrt(2 n_layer)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layer)
        nn.init.normal_(self.embed.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            block.attn.reset_parameters(std, out_std)
            nn.init.normal_(block.mlp.gate.weight, std=std)
            nn.init.normal_(block.mlp.up.weight, std=std)
            nn.init.normal_(block.mlp.down.weight, std=out_std)
            block.norm1.weight.fill_(1.0)
            block.norm2.weight.fill_(1.0)
        self.norm_f.weight.fill_(1.0)

    def forward(
        self, idx: Tensor, head: bool = True, keep: Tensor | None = None, segment_ids: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, vocab); head=False: the final normed hidden states (B, T, d_model), for a loss that
        applies lm_head itself (pipeline.trainer.loss, chunked).

        keep: a (B, T) bool mask; only those positions come out, as (N, vocab) logits or (N, d_model) states
        (N = keep.sum(), row-major). A loss on a few positions (passkey answers) then skips the vocab-wide
        head everywhere else, inside this forward (so ZeRO-3 still gathers the head's weight).

        segment_ids (B, T): the document of each position of packed windows
        (data_prep.loader.document_segments); required with model.attention.document_mask and taken only
        then, so the documents of a window attend as if each stood alone. Under sequence parallelism idx is
        this rank's part and segment_ids the whole sequence's (B, T), the same on every rank.
        """
        if self.cfg.attention.document_mask != (segment_ids is not None):
            raise ValueError(
                "model.attention.document_mask=true needs segment_ids (data_prep.loader.document_segments)"
                if segment_ids is None
                else "segment_ids given to a model without model.attention.document_mask=true"
            )
        x = self.embed(idx)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, segment_ids, use_reentrant=False)
            else:
                x = block(x, segment_ids)
        x = self.norm_f(x)
        if keep is not None:
            x = x[keep]
        return self.lm_head(x) if head else x

    def compile_blocks(self, **options: Any) -> None:
        """torch.compile every block in place (parameter names and checkpoints unchanged); options go to
        torch.compile. The attention op inside is one custom-op node (fpa_model.ops.fpa.library)."""
        for block in self.blocks:
            block.compile(**options)

    def set_sequence_parallel(self, sp: SequenceParallel | None) -> int:
        """Every attention layer attends across sp's group (None: whole sequences here); returns the count.

        forward then takes this rank's part of the sequence (fpa_model.sequence_parallel.shard_batch) and
        returns this rank's logits; the trainer makes the groups (pipeline.trainer.sequence_parallel).
        """
        for block in self.blocks:
            block.attn.sequence_parallel = sp
        return len(self.blocks)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Unique parameter count (a tied head counts once); non_embedding drops the token embedding."""
        n = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if non_embedding:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N (non-embedding matmuls) + attention scores and values.

        Attention: 2 matmuls (QK^T, PV) of 2 * T * d flops per token and layer in the forward, halved for
        causality, times 3 for forward + backward: 6 * n_layer * T * d.
        """
        n = self.num_parameters(non_embedding=True)
        if self.cfg.tie_embeddings:
            n += self.lm_head.weight.numel()  # the head matmul is real work even when tied
        return 6.0 * n + 6.0 * self.cfg.n_layer * seq_len * self.cfg.d_model
