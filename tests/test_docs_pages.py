"""The user pages stay readable and their links land.

The README is the page a new user reads first: at most 800 words, code included, so that it reads in
ten minutes; docs/performance.md is one page of headline tables, at most 15 KB, with the runs themselves
in benchmarks/results/. Every relative link between pages names a file that exists and, with a
``#fragment``, a heading that file has (GitHub's heading slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()  # a link reads as its text
    text = re.sub(r"[^\w\- ]", "", text)  # GitHub drops punctuation, keeps word characters, '-' and ' '
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, flags=re.M)}


def test_the_readme_reads_in_ten_minutes():
    words = len((ROOT / "README.md").read_text().split())
    assert words <= 800, f"README.md has {words} words; move detail to docs/ (the limit is 800, code included)"


def test_the_performance_page_is_one_page():
    size = (ROOT / "docs" / "performance.md").stat().st_size
    assert size <= 15 * 1024, f"docs/performance.md is {size:,} bytes; run logs belong in benchmarks/results/"


def test_every_relative_link_lands():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no heading #{frag} in {dest.name})")
    assert not bad, "\n".join(bad)


def test_the_slug_is_githubs():
    assert slug('Riding along: `capture="training_step"`') == "riding-along-capturetraining_step"
    assert slug("Parts inside rows: the forward-mode engine") == "parts-inside-rows-the-forward-mode-engine"
