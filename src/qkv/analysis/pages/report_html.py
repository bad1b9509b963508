"""The HTML of `qkv report`: one self-contained page (inline CSS, PNG data: URIs, JSON in
<script> elements), built from small escaped pieces; nothing here knows about models."""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence

__all__ = ["CSS", "FIGURE_DPI", "figure", "image", "json_script", "page", "section", "table"]

FIGURE_DPI = 80  # PNGs of ~20-80 KB each: the page stays around a megabyte
CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1200px; padding: 16px;
       color: #222; }
nav { background: #f4f4f4; padding: 8px 16px; border-radius: 4px; }
section { margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-variant-numeric:
         tabular-nums; }
tr.sub th { padding-left: 24px; font-weight: normal; }
figure { margin: 16px 0; }
figure img { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 13px; }
iframe { width: 100%; border: 1px solid #ccc; }
.note { color: #555; font-size: 13px; }
"""


def json_script(element_id: str, data: dict) -> str:
    """Data as <script type="application/json">; "<" inside could close the element, so "<",
    ">" and "&" travel as JSON escapes (the same string once parsed)."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="{element_id}">{payload}</script>'


def figure(fig, *, figure_id: str, caption: str) -> str:
    """A matplotlib figure as an inline PNG (a data: URI) with its caption; the figure is
    cleared afterwards (frees its artists)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    fig.clear()
    return image(buffer.getvalue(), figure_id=figure_id, caption=caption)


def image(png: bytes, *, figure_id: str, caption: str) -> str:
    """PNG bytes (a figure already drawn, e.g. a study's) as an inline image with its caption."""
    encoded = base64.b64encode(png).decode("ascii")
    caption = html.escape(caption)
    return (
        f'<figure id="{html.escape(figure_id)}"><img alt="{caption}" '
        f'src="data:image/png;base64,{encoded}"><figcaption>{caption}</figcaption></figure>'
    )


def table(
    rows: Sequence[Sequence[str]], *, header: Sequence[str] | None = None, row_headers=True
) -> str:
    """An HTML table; with row_headers, each row's first cell is its <th scope="row"> label
    (a label indented with spaces, e.g. "  of which embeddings", becomes a sub-row)."""
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header or ())
    lines = [f"<table><thead><tr>{head}</tr></thead><tbody>" if header else "<table><tbody>"]
    for row in rows:
        cells = "".join(f"<td>{html.escape(cell)}</td>" for cell in row[int(row_headers) :])
        if not row_headers:
            lines.append(f"<tr>{cells}</tr>")
            continue
        sub = ' class="sub"' if row[0].startswith(" ") else ""
        lines.append(f'<tr{sub}><th scope="row">{html.escape(row[0].strip())}</th>{cells}</tr>')
    return "\n".join([*lines, "</tbody></table>"])


def section(name: str, heading: str, body: str) -> str:
    """<section id=name> with its <h2> heading."""
    return f'<section id="{name}">\n<h2>{html.escape(heading)}</h2>\n{body}\n</section>'


def page(title: str, headings: dict[str, str], bodies: Sequence[str]) -> str:
    """The whole document: title, a contents list (section id -> heading), the sections."""
    contents = "".join(
        f'<li><a href="#{name}">{html.escape(heading)}</a></li>'
        for name, heading in headings.items()
    )
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<link rel="icon" href="data:,">', f"<title>{html.escape(title)}</title>",
        f"<style>{CSS}</style>", "</head>", "<body>", f"<h1>{html.escape(title)}</h1>",
        f'<nav><h2>Contents</h2><ol>{contents}</ol></nav>', *bodies, "</body>", "</html>", "",
    ])  # fmt: skip
