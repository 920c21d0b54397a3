"""The report's building blocks and their two renderings: Markdown, and one self-contained HTML page.

The content (:mod:`cyclone_kit.analysis.report_content`) is a list of :data:`Block` values; this
module knows how each looks (Markdown: images by file name; HTML: PNG images embedded as base64,
no external resources). Pure: blocks in, text out.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Heading:
    """A section heading."""

    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of plain text."""

    text: str


@dataclass(frozen=True)
class Bullets:
    """A bulleted list of plain-text items."""

    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """A table of plain-text cells."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    """A plot, by file stem (``<stem>.png`` / ``<stem>.svg`` in OUT)."""

    stem: str
    alt: str


Block = Heading | Paragraph | Bullets | Table | Image


def _md_cell(text: str) -> str:
    """Escape a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block]) -> str:
    """Render blocks as Markdown; images refer to ``<stem>.png`` next to the file."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(_md_cell(h) for h in block.header) + " |",
                     "|" + "|".join("---" for _ in block.header) + "|"]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            out.append("\n".join(lines))
        elif isinstance(block, Image):
            out.append(f"![{block.alt}]({block.stem}.png)\n\n([SVG]({block.stem}.svg))")
    return "\n\n".join(out) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: left; }
th { background: #f2f2f2; }
img { max-width: 100%; height: auto; display: block; margin: 0.5rem 0 1.5rem; }
"""


def render_html(blocks: Sequence[Block], images: dict[str, bytes]) -> str:
    """Render blocks as one self-contained HTML page (PNG images embedded as base64).

    Args:
        blocks: the report content.
        images: plot stem -> PNG bytes.
    """
    title = next((b.text for b in blocks if isinstance(b, Heading)), "Scaling report")
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
    ]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{html.escape(block.text)}</p>")
        elif isinstance(block, Bullets):
            out.append("<ul>" + "".join(f"<li>{html.escape(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.header)
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block.rows
            )
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif isinstance(block, Image) and block.stem in images:
            encoded = base64.b64encode(images[block.stem]).decode("ascii")
            out.append(f'<img alt="{html.escape(block.alt)}" src="data:image/png;base64,{encoded}">')
    out.append("</body></html>")
    return "\n".join(out) + "\n"
