"""README figures are copies of result files the code wrote, and those files say where they came from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.readme_results import BLOCK, ResultRefError, extract, main, sync  # noqa: E402


def test_readme_blocks_match_their_result_files() -> None:
    text = (ROOT / "README.md").read_text()
    refs = [m.group("ref") for m in BLOCK.finditer(text)]
    assert refs, "the README should copy its figures from docs/results"
    _, changed = sync(text)
    assert not changed, (
        f"README blocks differ from their files (run python bench/readme_results.py): {changed}"
    )


def test_every_result_says_commit_machine_and_command() -> None:
    docs = ROOT / "docs" / "results"
    results = sorted([*docs.glob("*/result.json"), *docs.glob("*/results.json")])  # bench / sweep --collect
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
    assert main(["--check", "--readme", str(readme)]) == 0
    readme.write_text(good.replace("| 1 | 2 |", "| 1 | 9 |"))  # a figure edited by hand
    assert main(["--check", "--readme", str(readme)]) == 1
    assert main(["--readme", str(readme)]) == 0 and readme.read_text() == good  # rewritten from the file
    assert extract("r/result.md#Part", tmp_path) == "x = 3\n"
    with pytest.raises(ResultRefError, match="no heading"):
        extract("r/result.md#Nope", tmp_path)
    readme.write_text("<!-- result: gone/result.md -->\nold\n<!-- /result -->\n")
    assert main(["--check", "--readme", str(readme)]) == 1
