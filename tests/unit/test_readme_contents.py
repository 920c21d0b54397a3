"""The README's table of contents lists every section and sub-section, in order, with GitHub's anchors."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_contents_match_the_headings() -> None:
    text = README.read_text(encoding="utf-8")
    contents = text.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^( *)- \[(.+)\]\(#(.+)\)$", contents, re.M)
    headings = [(level, title) for level, title in re.findall(r"^(##|###) (.+)$", text, re.M) if title != "Contents"]
    assert [("  " if level == "###" else "", title, _anchor(title)) for level, title in headings] == listed
