"""The tokenizer: a byte-level BPE trained on the train split (or an existing tokenizer.json), stored next
to the shards with its sha256 in index.json so that training and evaluation can never pair shards with a
different vocabulary.

Special tokens come first, in config order, with the end-of-document token always among them (it gets id 0
when it is listed first). No post-processor: documents are encoded without special tokens, and the packer
places the end-of-document token itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep.config import TokenizerConfig
from data_prep.errors import DataError
from data_prep.index import TOKENIZER_FILE, data_url, load_index, read_bytes


def special_tokens(cfg: TokenizerConfig) -> list[str]:
    """The configured special tokens, deduplicated, with the end-of-document token first if not listed."""
    out = [] if cfg.eod_token in cfg.special_tokens else [cfg.eod_token]
    for t in cfg.special_tokens:
        if t not in out:
            out.append(t)
    return out


def train_tokenizer(
    docs: Iterable[str], cfg: TokenizerConfig, *, length: int | None = None, progress: bool = False
) -> Tokenizer:
    """Train a byte-level BPE with cfg.vocab_size entries (256 byte symbols + specials + merges)."""
    specials = special_tokens(cfg)
    floor = 256 + len(specials)
    if cfg.vocab_size < floor:
        raise DataError(
            f"data.tokenizer.vocab_size={cfg.vocab_size} is below the {floor} byte symbols and special tokens"
        )
    tok = Tokenizer(models.BPE())
    # use_regex: the GPT-2 split (words, numbers, punctuation); merges never cross those boundaries
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if cfg.split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=length)
    return tok


def tokenizer_json(tok: Tokenizer) -> bytes:
    """The serialized tokenizer (compact, deterministic for a deterministic training run)."""
    return tok.to_str(pretty=False).encode("utf-8")


def eod_id(tok: Tokenizer, eod_token: str, where: str = "the tokenizer") -> int:
    i = tok.token_to_id(eod_token)
    if i is None:
        raise DataError(f"{where} has no end-of-document token {eod_token!r} (data.tokenizer.eod_token)")
    return int(i)


def read_tokenizer_file(path: str | Path) -> tuple[bytes, Tokenizer]:
    """An existing tokenizer.json (cfg.tokenizer.path): its exact bytes and the parsed tokenizer."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"tokenizer file not found: {p} (data.tokenizer.path)")
    raw = p.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the Rust side raises a plain Exception for bad JSON / unknown models
        raise DataError(f"{p}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
    return raw, tok


def load_tokenizer(data_dir: Path | str) -> Tokenizer:
    """The tokenizer of a prepared data directory, checked against the sha256 recorded in index.json."""
    index = load_index(data_dir)
    raw = read_bytes(data_dir, TOKENIZER_FILE)
    where = data_url(data_dir, TOKENIZER_FILE)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != index.tokenizer_sha256:
        raise DataError(
            f"{where} does not match index.json (sha256 {digest[:12]}..., index says "
            f"{index.tokenizer_sha256[:12]}...): the shards were made with another tokenizer; re-run prepare"
        )
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:
        raise DataError(f"{where}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
    if tok.get_vocab_size() != index.vocab_size:
        raise DataError(f"{where}: vocab size {tok.get_vocab_size()} but index.json says {index.vocab_size}")
    return tok
