"""Keep the README's figures equal to the result files the code wrote.

A README block

    <!-- result: docs/results/cache_bound/result.md -->
    ...
    <!-- /result -->

holds a copy of that file (without its top-level `# title` line), or with `path#Heading` of the section
under the first heading that starts with `Heading` (to the next heading of the same or a higher level).

    python bench/readme_results.py           # rewrite the blocks from the files
    python bench/readme_results.py --check   # exit 1 naming every block that differs (the tests run this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- result: (?P<ref>[^ ]+) -->\n)(?P<body>.*?)(<!-- /result -->)", re.DOTALL)


class ResultRefError(ValueError):
    """A README block names a file or section that does not exist."""


def _heading(line: str) -> int:
    m = re.match(r"(#+) ", line)
    return len(m.group(1)) if m else 0


def extract(ref: str, root: Path = ROOT) -> str:
    """The text a block naming `ref` must hold (ends with one newline)."""
    path, _, section = ref.partition("#")
    file = root / path
    if not file.is_file():
        raise ResultRefError(f"README names {path}, which does not exist (run the command that writes it)")
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
    """(the README text with every block refreshed, the refs of the blocks that changed)."""
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
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    try:
        new, changed = sync(text, args.readme.parent)
    except ResultRefError as e:
        print(f"readme_results: {e}", file=sys.stderr)
        return 1
    if args.check:
        for ref in changed:
            print(f"readme_results: README block {ref} differs from the file (run bench/readme_results.py)")
        return 1 if changed else 0
    if changed:
        args.readme.write_text(new)
    print(f"{len(changed)} block(s) updated" if changed else "README blocks match their result files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
