"""Typed data configuration (the `data:` section of a run config)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

SOURCE_TYPES = ("packaged", "text", "jsonl", "parquet", "hf")
PACKAGED_CORPORA = ("kjv", "wiki_summaries")
# The keys each source type reads, besides type, max_docs, skip_docs (and a mixture source's weight). A
# config layer that changes a source's type drops the keys the new type does not read
# (pipeline.config.load_config); `name` is a packaged corpus for one and a datasets builder for the other.
SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "packaged": ("name", "books", "exclude_books"),
    "text": ("paths", "doc_separator"),
    "jsonl": ("paths", "text_field"),
    "parquet": ("paths", "text_field"),
    "hf": ("name", "paths", "text_field", "hf_config", "hf_split"),
}
COMMON_SOURCE_KEYS = ("type", "max_docs", "skip_docs", "weight")


def kept_source_keys(old: str, new: str) -> set[str]:
    """The keys a source keeps when its type changes from old to new: those the new type reads, but not
    `name` between packaged and hf (a corpus there, a datasets builder here)."""
    keep = set(SOURCE_KEYS.get(new, ()))
    if "packaged" in (old, new) and old != new:
        keep.discard("name")
    return keep


@dataclass
class SourceConfig:
    type: str = "packaged"  # packaged | text | jsonl | parquet | hf
    name: str = "kjv"  # packaged corpus name, or HF dataset name / builder ("json", "parquet", ...)
    paths: list[str] = field(default_factory=list)  # local files or globs (text/jsonl/parquet/hf data_files)
    text_field: str = "text"
    hf_config: str | None = None
    hf_split: str = "train"
    max_docs: int | None = None  # cap for quick runs
    # Leave out the first skip_docs documents (before max_docs applies): a train source and a held-out
    # split can take disjoint parts of one corpus (configs/data/mixture.yaml).
    skip_docs: int = 0
    # text sources: split each file into documents at this string (e.g. "\n\n\n"); None: one per file
    doc_separator: str | None = None
    # Packaged "kjv" only: keep just these books (None: all), or drop these; a held-out split of whole
    # books shares no chapter, and few verses, with the training split.
    books: list[str] | None = None
    exclude_books: list[str] | None = field(default_factory=list)  # null: none, as []

    def __post_init__(self) -> None:
        if self.exclude_books is None:  # stored as [] so the data fingerprint does not change
            self.exclude_books = []
        if self.type not in SOURCE_TYPES:
            raise ValueError(f"data source type must be one of {', '.join(SOURCE_TYPES)}; got {self.type!r}")
        if self.type == "packaged" and self.name not in PACKAGED_CORPORA:
            raise ValueError(
                f"packaged corpus must be one of {', '.join(PACKAGED_CORPORA)}; got {self.name!r}"
            )
        if self.type in ("text", "jsonl", "parquet") and not self.paths:
            raise ValueError(f"a data source of type {self.type!r} needs paths (files, folders or globs)")
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"data source max_docs must be >= 1 or null, got {self.max_docs}")
        if self.skip_docs < 0:
            raise ValueError(f"data source skip_docs must be >= 0, got {self.skip_docs}")
        if self.doc_separator == "":
            raise ValueError("data source doc_separator must be a non-empty string or null")
        if (self.books is not None or self.exclude_books) and (self.type, self.name) != ("packaged", "kjv"):
            raise ValueError(
                "data source books / exclude_books select books of the packaged corpus 'kjv' only"
            )
        if self.books is not None and not self.books:
            raise ValueError("data source books is empty: list at least one book, or null for all")


@dataclass
class MixtureSourceConfig(SourceConfig):
    """A train source of a weighted mixture (data.mixture.<name>): a source plus its sampling weight."""

    # Share of the training sequences drawn from this source: weight / sum of weights (>= 0; 0 leaves the
    # source prepared but unused). Checked by DataConfig, which knows the source's name.
    weight: float = 1.0


@dataclass
class TokenizerConfig:
    path: str | None = None  # an existing tokenizer.json; None: train a byte-level BPE on the train split
    vocab_size: int = 8192
    min_frequency: int = 2
    eod_token: str = "<|endoftext|>"
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>", "<|pad|>"])
    # One token per digit (as Llama/PaLM do): numbers tokenize the same wherever they stand, so copying a
    # number (passkey retrieval) is a token-by-token copy instead of a lookup among merged digit chunks.
    split_digits: bool = True


@dataclass
class DataConfig:
    train: SourceConfig = field(default_factory=SourceConfig)
    # A weighted mixture of train sources, by name; when set it IS the train split and data.train is
    # ignored. Each source is tokenized into its own shards (train/<name>-NNNNN.tar) and the loader draws
    # weight-proportional counts from them every epoch (data_prep.loader). Empty: the single data.train.
    mixture: dict[str, MixtureSourceConfig] = field(default_factory=dict)
    # Held-out split: its own source, or (None) the last `val_fraction` of the train documents.
    validation: SourceConfig | None = None
    # More held-out splits, by name (e.g. an out-of-domain corpus beside an in-domain "validation"):
    # written like "validation" and evaluated beside it (perplexity by position, in the report).
    extra_validation: dict[str, SourceConfig] = field(default_factory=dict)
    val_fraction: float = 0.01
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seq_len: int = 256  # tokens per training sequence (each stored sequence holds seq_len + 1)
    sequences_per_member: int = 64  # sequences packed into one tar member
    sequences_per_shard: int = 4096
    max_doc_chars: int = 100_000  # longer documents are split
    # Tokenizer threads per prepare process (0: all cores / processes; RAYON_NUM_THREADS wins).
    num_workers: int = 0
    # Tokenizer processes in prepare: 1 tokenizes in the prepare process itself; N > 1 spreads the batches
    # over N worker processes (the Python side of tokenization scales too). The bytes written are the same.
    prepare_processes: int = 1
    # Slurm only (`fpa launch slurm`, `fpa sweep`): > 1 runs prepare as a job array of this many parts
    # plus a merge job; the data is byte-identical to a one-job prepare.
    prepare_parts: int = 1
    # Documents per tokenizer batch: big enough for encode_batch to use every core, small enough to cap
    # memory (the token lists of one batch live in Python at once).
    tokenize_batch_docs: int = 2048
    # Loader shuffle granularity, in sequences: the global order is a full permutation within blocks of
    # whole shards holding at least this many sequences (blocks themselves are shuffled). A corpus that
    # fits in one block gets an exact global permutation; each rank holds up to two blocks in memory.
    shuffle_block: int = 65536
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
        for key in (
            "sequences_per_member",
            "sequences_per_shard",
            "max_doc_chars",
            "tokenize_batch_docs",
            "shuffle_block",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key} must be >= 1, got {getattr(self, key)}")
        if self.sequences_per_shard % self.sequences_per_member:
            raise ValueError(
                f"data.sequences_per_shard ({self.sequences_per_shard}) must be a multiple of "
                f"data.sequences_per_member ({self.sequences_per_member})"
            )
        for name in self.extra_validation:
            if name in ("train", "validation") or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise ValueError(
                    f"data.extra_validation split name {name!r} must be a plain name (letters, digits, "
                    f"_ . -) other than train and validation"
                )
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        for key in ("prepare_processes", "prepare_parts"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key} must be >= 1, got {getattr(self, key)}")
        self._check_mixture()
        if self.out_dir is not None and (self.out_dir.startswith("pipe:") or "://" in self.out_dir):
            # A config value never runs a command (pipe:), and the stages treat data_dir as a local Path
            # (which would turn "s3://b" into "s3:/b"); ShardLoader's Python API still reads both.
            raise ValueError(
                f"data.out_dir must be a local directory, not {self.out_dir!r}: pipe: commands and URLs "
                f"are refused (copy the data to a local or mounted path; for file://, give the path alone)"
            )

    def _check_mixture(self) -> None:
        if not self.mixture:
            return
        for name, src in self.mixture.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise ValueError(
                    f"data.mixture source name {name!r} must be a plain name (letters, digits, _ . -)"
                )
            if not (isinstance(src.weight, int | float) and math.isfinite(src.weight) and src.weight >= 0):
                raise ValueError(f"data.mixture.{name}.weight must be a finite number >= 0, got {src.weight}")
        if not any(src.weight > 0 for src in self.mixture.values()):
            raise ValueError(
                f"data.mixture: every weight is 0 ({', '.join(self.mixture)}): give one a weight > 0"
            )
        if self.passkey_mix > 0:
            raise ValueError("data.passkey_mix works with a single data.train source, not with data.mixture")

    def train_sources(self) -> dict[str, SourceConfig]:
        """The train split's sources by name, in the order they are prepared and stored: the mixture's,
        sorted by name (so reordering the YAML changes nothing), or {"train": data.train}."""
        if self.mixture:
            return {name: self.mixture[name] for name in sorted(self.mixture)}
        return {"train": self.train}


def data_config_dict(cfg: DataConfig) -> dict[str, Any]:
    """The data config as a plain dict for hashing: keys added after a layout was in use are left out
    while they hold their defaults, so data prepared before them keeps its fingerprint and is reused; an
    ignored data.train (a mixture is set) is left out too."""
    d = dataclasses.asdict(cfg)
    for key in ("prepare_processes", "prepare_parts"):  # how, not what: never change a byte
        d.pop(key, None)
    sources = [d["train"], d["validation"], *d["extra_validation"].values(), *d["mixture"].values()]
    for src in sources:
        if src is not None and src.get("skip_docs") == 0:
            del src["skip_docs"]
    if not cfg.mixture:
        d.pop("mixture", None)
    else:
        d.pop("train", None)
    return d
