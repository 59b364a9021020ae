"""docs/data.md, "Your own corpus": its commands run as written on a small generated corpus, so the guide
cannot rot.

Every `fpa` line of the section's bash blocks runs (as `python -m launch.cli`) in a fresh directory holding
`configs/` (the repository's), the generated `corpus/` and the section's YAML files (a yaml block whose
first line is `# <file name>`), with overrides appended that make it quick (2 training steps, a short
eval). The error shown in the section is the one the config loader gives.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "data.md"
SECTION = "## Your own corpus"
QUICK = [
    "train.max_steps=2",
    "train.val_every=2",
    "train.val_batches=1",
    "train.checkpoint.every=0",
    "train.passkey.batch=2",
    "data.num_workers=1",
    "logging.wandb_mode=disabled",
    "logging.progress=false",
    "eval.passkey.enabled=false",
    "eval.ppl_sequences=1",
    "eval.ppl_length_multipliers=[1]",
]


def section(text: str) -> str:
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else len(text)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def commands(text: str) -> list[list[str]]:
    out = []
    for block in blocks(text, "bash"):
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                argv = shlex.split(line)
                assert argv[0] == "fpa", line  # the section shows fpa commands only
                out.append(argv[1:])
    return out


def make_corpus(root: Path) -> None:
    """English text to stand for the user's: 300 KJV chapters (from Genesis on) as corpus/*.txt, and the
    same as corpus/docs.jsonl."""
    from data_prep.config import SourceConfig
    from data_prep.sources import iter_documents

    (root / "corpus").mkdir()
    chapters = iter_documents(SourceConfig(type="packaged", name="kjv", max_docs=300), max_doc_chars=100_000)
    with open(root / "corpus" / "docs.jsonl", "w") as f:
        for i, text in enumerate(chapters):
            (root / "corpus" / f"doc{i:03d}.txt").write_text(text)
            f.write(json.dumps({"text": text}) + "\n")


def fpa(cwd: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.slow
def test_own_corpus_commands_run_as_written(tmp_path: Path) -> None:
    text = section(DOC.read_text())
    cmds = commands(text)
    assert len(cmds) >= 3 and cmds[0][0] == "prepare"
    (tmp_path / "configs").symlink_to(REPO / "configs")
    make_corpus(tmp_path)
    for block in blocks(text, "yaml"):
        first = block.splitlines()[0]
        if re.fullmatch(r"# [\w.-]+\.yaml", first):
            (tmp_path / first[2:]).write_text(block)
    for args in cmds:
        r = fpa(tmp_path, [*args, *QUICK])
        assert r.returncode == 0, f"fpa {shlex.join(args)}:\n{r.stderr[-4000:]}"

    def splits(run: str) -> set[str]:
        return set(json.loads((tmp_path / "runs" / run / "data" / "index.json").read_text())["splits"])

    # The presets: the user's documents only, validation held out from them, the whole pipeline ran.
    for run in ("my-text", "my-jsonl"):
        assert splits(run) == {"train", "validation"}
        report = json.loads((tmp_path / "runs" / run / "eval" / "report.json").read_text())
        assert report, run
    manifest = json.loads((tmp_path / "runs" / "my-text" / "manifests" / "train.json").read_text())
    assert manifest["status"] == "done" and manifest["result"]["val_loss"] > 0
    assert splits("my-hf") == {"train", "validation"}
    # The override form keeps the packaged out-of-domain split; the YAML form empties it.
    assert splits("mine") == {"train", "validation", "wiki"}
    assert splits("mine-yaml") == {"train", "validation"}
    prepared = json.loads((tmp_path / "runs" / "mine-yaml" / "manifests" / "prepare.json").read_text())
    assert prepared["inputs"]["data"]["train"]["doc_separator"] == "\n\n\n"
    assert prepared["inputs"]["data"]["validation"] is None  # held out from the user's documents


def test_the_error_shown_is_the_one_given() -> None:
    from pipeline.config import ConfigError, load_config

    text = section(DOC.read_text())
    shown = [b.strip() for b in blocks(text, "") if b.startswith("fpa: error: ")]
    assert len(shown) == 1
    key = re.search(r"error: (data\.\S+)", shown[0]).group(1)
    assert key == "data.train.exclude_books"
    with pytest.raises(ConfigError) as e:
        load_config([REPO / "configs" / "tiny.yaml"], ["data.train.name=wiki_summaries"])
    got = str(e.value).replace(str(REPO) + "/", "")
    assert shown[0] == f"fpa: error: {got}"
