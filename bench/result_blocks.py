"""Keep the figures on the README and the guide pages (docs/*.md, experiments/*.md) equal to the result
files the code wrote.

A block on a page

    <!-- result: docs/results/cache_bound/result.md -->
    ...
    <!-- /result -->

holds a copy of that file (without its top-level `# title` line), or with `path#Heading` of the section
under the first heading that starts with `Heading` (to the next heading of the same or a higher level).

Paths are relative to the repository root, whichever page holds the block.

    python bench/result_blocks.py            # rewrite the blocks of every page from the files
    python bench/result_blocks.py --check    # exit 1 naming every block that differs (the tests run this)
    python bench/result_blocks.py docs/results.md   # only these pages
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- result: (?P<ref>[^ ]+) -->\n)(?P<body>.*?)(<!-- /result -->)", re.DOTALL)


class ResultRefError(ValueError):
    """A block names a file or section that does not exist."""


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks are kept: the README and the guide (docs/*.md, experiments/*.md)."""
    guide = [*sorted((root / "docs").glob("*.md")), *sorted((root / "experiments").glob("*.md"))]
    return [root / "README.md", *guide]


def _heading(line: str) -> int:
    m = re.match(r"(#+) ", line)
    return len(m.group(1)) if m else 0


def extract(ref: str, root: Path = ROOT) -> str:
    """The text a block naming `ref` must hold (ends with one newline)."""
    path, _, section = ref.partition("#")
    file = root / path
    if not file.is_file():
        raise ResultRefError(f"a block names {path}, which does not exist (run the command that writes it)")
    lines = file.read_text().splitlines()
    if section:
        starts = [
            i for i, ln in enumerate(lines) if _heading(ln) and ln.lstrip("#").strip().startswith(section)
        ]
        if not starts:
            raise ResultRefError(f"{path} has no heading starting with {section!r}")
        level = _heading(lines[starts[0]])
        end = next(
            (j for j in range(starts[0] + 1, len(lines)) if 0 < _heading(lines[j]) <= level), len(lines)
        )
        lines = lines[starts[0] + 1 : end]
    elif lines and _heading(lines[0]) == 1:
        lines = lines[1:]
    return "\n".join(lines).strip("\n") + "\n"


def sync(text: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """(the page's text with every block refreshed, the refs of the blocks that changed)."""
    changed: list[str] = []

    def repl(m: re.Match[str]) -> str:
        want = extract(m.group("ref"), root)
        if m.group("body") != want:
            changed.append(m.group("ref"))
        return m.group(1) + want + m.group(4)

    return BLOCK.sub(repl, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report blocks that differ from their files")
    ap.add_argument("--root", type=Path, default=ROOT, help="the directory block paths are relative to")
    ap.add_argument("pages", nargs="*", type=Path, help="pages to sync (default: README.md, docs/*.md, ...)")
    args = ap.parse_args(argv)
    todo = args.pages or pages(args.root)
    stale: list[str] = []
    for page in todo:
        text = page.read_text()
        name = page.relative_to(args.root) if page.is_relative_to(args.root) else page
        try:
            new, changed = sync(text, args.root)
        except ResultRefError as e:
            print(f"result_blocks: {name}: {e}", file=sys.stderr)
            return 1
        if args.check:
            stale += [f"{name}: block {ref}" for ref in changed]
        elif changed:
            page.write_text(new)
            stale += [f"{name}: block {ref}" for ref in changed]
    if args.check:
        for s in stale:
            print(f"result_blocks: {s} differs from its file (run python bench/result_blocks.py)")
        return 1 if stale else 0
    print(f"{len(stale)} block(s) updated" if stale else "every block matches its result file")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
