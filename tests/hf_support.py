"""Shared by test_hf, test_generate and test_harness: a tiny prepared KJV data dir (tokenizer + index) and
a random GPT written as `fpa export` writes one. No training: the tests compare the project's model with
what the transformers / lm-eval / generate paths make of the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from data_prep.config import DataConfig, SourceConfig, TokenizerConfig
from pipeline.config import RunConfig, load_config, to_yaml

SEQ_LEN = 64
VOCAB = 320


def prepare_tiny_data(out: Path) -> Path:
    from data_prep.prepare import prepare_data

    cfg = DataConfig(
        train=SourceConfig(type="packaged", name="kjv", max_docs=12),
        val_fraction=0.25,
        tokenizer=TokenizerConfig(vocab_size=VOCAB),
        seq_len=SEQ_LEN,
        sequences_per_member=16,
        sequences_per_shard=64,
        num_workers=1,
    )
    prepare_data(cfg, out, progress=False)
    return out


def run_cfg(tmp: Path, data_dir: Path, name: str, kind: str, overrides: list[str] = ()) -> RunConfig:
    return load_config(
        [],
        [
            f"name={name}",
            f"runs_dir={tmp}",
            f"data.out_dir={data_dir}",
            f"data.seq_len={SEQ_LEN}",
            # prepare_tiny_data's content config: the stages check the data is what this config prepares
            "data.train.type=packaged",
            "data.train.name=kjv",
            "data.train.max_docs=12",
            "data.val_fraction=0.25",
            f"data.tokenizer.vocab_size={VOCAB}",
            "data.sequences_per_member=16",
            "data.sequences_per_shard=64",
            f"model.vocab_size={VOCAB}",
            "model.n_layer=2",
            "model.n_head=2",
            "model.d_model=32",
            "model.max_seq_len=256",
            "model.init_std=0.2",  # larger than training's init: greedy text that does not repeat one token
            f"model.attention.kind={kind}",
            "model.attention.field_bias_init=[-2.0,-0.5]",  # fast-falling fields: eviction has work to do
            "eval.device=cpu",
            "eval.cache.prefill_chunk=8",
            "logging.wandb_mode=disabled",
            *overrides,
        ],
    )


def export_random_model(cfg: RunConfig, seed: int = 0) -> Path:
    """A random GPT (with a structured field) at <run_dir>/export, as pipeline.export writes it."""
    from fpa_model.model import GPT
    from pipeline.export import CONFIG, WEIGHTS

    torch.manual_seed(seed)
    model = GPT(cfg.model)
    with torch.no_grad():
        for blk in model.blocks:
            if blk.attn.field_proj is not None:
                blk.attn.field_proj.weight.normal_(0, 0.5)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.model.tie_embeddings:
        sd.pop("lm_head.weight")
    out = cfg.run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / WEIGHTS))
    (out / CONFIG).write_text(to_yaml(cfg))
    return out
