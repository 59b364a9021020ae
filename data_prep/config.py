"""Typed data configuration (the `data:` section of a run config)."""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCE_TYPES = ("packaged", "text", "jsonl", "parquet", "hf")
PACKAGED_CORPORA = ("kjv", "wiki_summaries")


@dataclass
class SourceConfig:
    type: str = "packaged"  # packaged | text | jsonl | parquet | hf
    name: str = "kjv"  # packaged corpus name, or HF dataset name / builder ("json", "parquet", ...)
    paths: list[str] = field(default_factory=list)  # local files or globs (text/jsonl/parquet/hf data_files)
    text_field: str = "text"
    hf_config: str | None = None
    hf_split: str = "train"
    max_docs: int | None = None  # cap for quick runs

    def __post_init__(self) -> None:
        if self.type not in SOURCE_TYPES:
            raise ValueError(f"data source type must be one of {', '.join(SOURCE_TYPES)}; got {self.type!r}")
        if self.type == "packaged" and self.name not in PACKAGED_CORPORA:
            raise ValueError(
                f"packaged corpus must be one of {', '.join(PACKAGED_CORPORA)}; got {self.name!r}"
            )


@dataclass
class TokenizerConfig:
    path: str | None = None  # an existing tokenizer.json; None: train a byte-level BPE on the train split
    vocab_size: int = 8192
    min_frequency: int = 2
    eod_token: str = "<|endoftext|>"
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>", "<|pad|>"])


@dataclass
class DataConfig:
    train: SourceConfig = field(default_factory=SourceConfig)
    # Held-out split: its own source, or (None) the last `val_fraction` of the train documents.
    validation: SourceConfig | None = None
    val_fraction: float = 0.01
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seq_len: int = 256  # tokens per training sequence (each stored sequence holds seq_len + 1)
    sequences_per_member: int = 64  # sequences packed into one tar member
    sequences_per_shard: int = 4096
    max_doc_chars: int = 100_000  # longer documents are split
    num_workers: int = 0  # 0: all cores
    out_dir: str | None = None  # None: <run_dir>/data; point several runs at one dir to share shards
    seed: int = 1234  # loader shuffle seed (global order depends on seed and epoch only)
    # Fraction of train documents that are synthetic passkey documents (data_prep.passkey.passkey_documents),
    # so a model learns the retrieval format it is evaluated on; 0 keeps the corpus pure.
    passkey_mix: float = 0.0

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 <= self.passkey_mix < 1.0:
            raise ValueError(f"data.passkey_mix must be in [0, 1), got {self.passkey_mix}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
