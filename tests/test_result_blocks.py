"""The figures on the README and the guide pages are copies of result files the code wrote, and those
files say where they came from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_blocks import BLOCK, ResultRefError, extract, main, pages, sync  # noqa: E402


def test_blocks_on_every_page_match_their_result_files() -> None:
    readme = (ROOT / "README.md").read_text()
    assert list(BLOCK.finditer(readme)), "the README should copy its headline figures from docs/results"
    for page in pages():
        _, changed = sync(page.read_text())
        assert not changed, (
            f"{page.name}: blocks differ from their files (run python bench/result_blocks.py): {changed}"
        )


def test_every_result_says_commit_machine_and_command() -> None:
    docs = ROOT / "docs" / "results"
    results = sorted(docs.glob("*/result.json"))  # bench, experiments and sweep --collect alike
    assert results
    for path in results:
        prov = json.loads(path.read_text())["provenance"]
        assert len(prov["commit"]) == 40, path
        assert prov["command"].startswith(("python ", "fpa ")), path
        assert prov["machine"]["cpu"] and prov["machine"]["cores"] >= 1, path
        md = path.with_suffix(".md").read_text()
        assert prov["commit"][:10] in md and prov["command"] in md, (
            f"{path.parent}/result.md lacks its provenance"
        )


def test_a_stale_or_dangling_block_is_caught(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "result.md").write_text(
        "# Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## Part\n\nx = 3\n"
    )
    readme = tmp_path / "README.md"
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n\n## Part\n\nx = 3\n"
    good = f"intro\n<!-- result: r/result.md -->\n{table}<!-- /result -->\n"
    readme.write_text(good)
    assert main(["--check", "--root", str(tmp_path), str(readme)]) == 0
    readme.write_text(good.replace("| 1 | 2 |", "| 1 | 9 |"))  # a figure edited by hand
    assert main(["--check", "--root", str(tmp_path), str(readme)]) == 1
    assert main(["--root", str(tmp_path), str(readme)]) == 0  # rewritten from the file
    assert readme.read_text() == good
    assert extract("r/result.md#Part", tmp_path) == "x = 3\n"
    with pytest.raises(ResultRefError, match="no heading"):
        extract("r/result.md#Nope", tmp_path)
    readme.write_text("<!-- result: gone/result.md -->\nold\n<!-- /result -->\n")
    assert main(["--check", "--root", str(tmp_path), str(readme)]) == 1


def test_every_guide_page_is_checked_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "result.md").write_text("# Title\n\nx = 3\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- result: r/result.md -->\nx = 3\n<!-- /result -->\n")
    page = tmp_path / "docs" / "results.md"
    page.write_text("<!-- result: r/result.md -->\nx = 4\n<!-- /result -->\n")  # stale, on a guide page
    assert pages(tmp_path) == [tmp_path / "README.md", page]
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/results.md: block r/result.md differs" in capsys.readouterr().out
    assert main(["--root", str(tmp_path)]) == 0 and page.read_text().count("x = 3") == 1
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_a_module_run_records_its_path_from_the_repository_root() -> None:
    from pipeline.provenance import provenance

    prov = provenance([str(ROOT / "experiments" / "cache_bound.py"), "--run", "runs/x"])
    assert prov["command"] == "python experiments/cache_bound.py --run runs/x"
