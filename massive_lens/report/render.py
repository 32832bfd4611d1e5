"""Rendering for the report: one list of sections, two outputs.

A :class:`Section` holds blocks (paragraphs, preformatted summaries, tables, matplotlib
figures, circuitsvis views). :func:`to_html` turns them into one self-contained page
(figures as base64 PNG data URIs, the circuitsvis bundle embedded once, no external
resource); :func:`to_markdown` into ``report.md`` with the figures as PNG files beside it;
:func:`write_tables` writes every table, whole, as a CSV file.
"""

from __future__ import annotations

import base64
import html
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from massive_lens.core.fmt import cell as _fmt
from massive_lens.core.render import close_figure, figure_of
from massive_lens.viz.views import bundle_tag

LONG_CELL = 60  # a text cell longer than this is prose: it wraps, or folds into <details> beyond FOLD_CELL
FOLD_CELL = 160
_NOTEBOOK_HINT = re.compile(r" ?\((?:see|See) `?\.\w+\(\)`?[^)]*\)")
_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #444; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
pre { background: #f6f8fa; padding: .8em; font-size: 12px; white-space: pre-wrap; overflow-wrap: anywhere; }
table { border-collapse: collapse; font-size: 12px; margin: .5em 0 1em; max-width: 100%; }
caption { text-align: left; font-size: 12px; color: #555; padding-bottom: .3em; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; vertical-align: top; }
th { background: #f0f0f0; font-weight: 600; }
td { white-space: nowrap; } td.name { text-align: left; }
td.prose { white-space: normal; text-align: left; min-width: 16em; }
details summary { cursor: pointer; color: #245; } details[open] { white-space: normal; max-width: 40em; }
img { max-width: 100%; height: auto; }
figure { margin: 1em 0; } figcaption { font-size: 12px; color: #555; }
.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: .4em .8em; }
nav ol { columns: 2; } .view-title { font-size: 12px; color: #555; margin-bottom: 0; }
.ml-view { max-width: 100%; overflow: hidden; }
"""


@dataclass
class Section:
    """A report section; ``blocks`` are (kind, payload, caption) triples in order.

    ``tables`` holds each table block's whole frame and caption (the block shows its head).
    """

    title: str
    blocks: list[tuple[str, Any, str]] = field(default_factory=list)
    seconds: float = 0.0
    tables: list[tuple[pd.DataFrame, str]] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-")

    def text(self, value: str) -> None:
        self.blocks.append(("text", value, ""))

    def note(self, value: str) -> None:
        self.blocks.append(("note", value, ""))

    def pre(self, value: str) -> None:
        """A preformatted summary, without the notebook hints that point at methods
        (``(see .by_dim())``): the report shows those tables itself."""
        self.blocks.append(("pre", _NOTEBOOK_HINT.sub("", value), ""))

    def table(self, frame: pd.DataFrame, caption: str = "", max_rows: int = 30) -> None:
        self.blocks.append(("table", frame.head(max_rows), caption))
        self.tables.append((frame, caption))

    def figure(self, fig_or_ax: Any, caption: str) -> None:
        """Add a figure, drawn to PNG bytes now (and closed: a report holds no live figures)."""
        self.blocks.append(("figure", _png(figure_of(fig_or_ax)), caption))

    def view(self, view: Any) -> None:
        self.blocks.append(("view", view, view.title))


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    close_figure(fig)
    return buf.getvalue()


def _md(text: Any) -> str:
    """Text for Markdown outside code: raw HTML escaped (``&`` and ``<``, so no tag or entity
    survives), as index.html escapes it; ``>`` stays readable."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;")


def _fence(text: str) -> list[str]:
    """A fenced code block whose fence is longer than any backtick run in ``text`` (so the text
    cannot close it early and reach the page as Markdown or HTML)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, text, fence]


def _md_table(frame: pd.DataFrame) -> str:
    head = "| " + " | ".join(_md(c) for c in frame.columns) + " |"
    rule = "|" + "---|" * len(frame.columns)
    rows = ["| " + " | ".join(_md(_fmt(v)).replace("|", "\\|").replace("\n", "\\n") for v in row) + " |"
            for row in frame.itertuples(index=False)]
    return "\n".join([head, rule, *rows])


def _header(name: Any) -> str:
    """A column name that may break after its underscores (``sink_mass_original``), never inside a word."""
    return html.escape(str(name)).replace("_", "_<wbr>")


def _cell(value: Any, first: bool) -> str:
    """One ``<td>``: names and numbers never wrap; prose wraps at spaces, and folds into an
    expandable ``<details>`` when it is long."""
    text = _fmt(value)
    if first:
        return f"<td class='name'>{html.escape(text)}</td>"
    if len(text) > FOLD_CELL:
        return (f"<td class='prose'><details><summary>{html.escape(text[:LONG_CELL].rsplit(' ', 1)[0])} ...</summary>"
                f"{html.escape(text)}</details></td>")
    if len(text) > LONG_CELL:
        return f"<td class='prose'>{html.escape(text)}</td>"
    return f"<td>{html.escape(text)}</td>"


def html_table(frame: pd.DataFrame, caption: str = "") -> str:
    """A table for the page: the caption, headers that break only after underscores, the
    first column (names) and numbers on one line, long text as wrapping or expandable prose.

    >>> t = html_table(pd.DataFrame({"setting": ["sink_term_mean"], "sink_mass": [0.25]}), "demo")
    >>> "<th>sink_<wbr>mass</th>" in t, "<td class='name'>sink_term_mean</td>" in t
    (True, True)
    """
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{_header(c)}</th>" for c in frame.columns)
    rows = "".join("<tr>" + "".join(_cell(v, i == 0) for i, v in enumerate(row)) + "</tr>"
                   for row in frame.itertuples(index=False))
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def render_figures(sections: list[Section], folder: Path) -> None:
    """Write each figure block's PNG bytes to ``folder``, and name it there."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for section in sections:
        for i, (kind, payload, caption) in enumerate(section.blocks):
            if kind == "figure":
                n += 1
                name = f"{n:02d}-{section.anchor}.png"
                (folder / name).write_bytes(payload)
                section.blocks[i] = ("png", (name, payload), caption)


def write_tables(sections: list[Section], folder: Path) -> list[Path]:
    """Write every table of the sections, whole, as ``folder/NN-<section>-<caption>.csv``.

    Args:
        sections: the report's sections, in order (``NN`` counts their tables from 01).
        folder: the folder for the CSV files (created if missing).

    Returns:
        The paths written, in order.
    """
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for section in sections:
        for frame, caption in section.tables:
            slug = re.sub(r"[^a-z0-9]+", "-", caption.lower()).strip("-")[:60].rstrip("-") or "table"
            path = folder / f"{len(written) + 1:02d}-{section.anchor}-{slug}.csv"
            frame.to_csv(path, index=False)
            written.append(path)
    return written


def to_html(title: str, intro: str, sections: list[Section], footer: str) -> str:
    has_views = any(kind == "view" for s in sections for kind, _, _ in s.blocks)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1><p>{html.escape(intro)}</p>",
             "<nav><ol>" + "".join(f"<li><a href='#{s.anchor}'>{html.escape(s.title)}</a></li>" for s in sections)
             + "</ol></nav>"]
    if has_views:
        parts.append(bundle_tag())
    for s in sections:
        parts.append(f"<section id='{s.anchor}'><h2>{html.escape(s.title)}</h2>")
        for kind, payload, caption in s.blocks:
            if kind == "text":
                parts.append(f"<p>{html.escape(payload)}</p>")
            elif kind == "note":
                parts.append(f"<p class='note'>{html.escape(payload)}</p>")
            elif kind == "pre":
                parts.append(f"<pre>{html.escape(payload)}</pre>")
            elif kind == "table":
                parts.append(html_table(payload, caption))
            elif kind == "png":
                name, data = payload
                uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
                parts.append(f"<figure><img src='{uri}' alt='{html.escape(caption, quote=True)}'>"
                             f"<figcaption>{html.escape(caption)}</figcaption></figure>")
            elif kind == "view":
                parts.append(payload.html(include_bundle=False))
        parts.append("</section>")
    parts.append(f"<hr><p><small>{html.escape(footer)}</small></p></body></html>")
    return "\n".join(parts)


def to_markdown(title: str, intro: str, sections: list[Section], footer: str, figures: str) -> str:
    """``report.md``: every text that came from the model or the user is escaped as in
    index.html, except in fenced summaries, which Markdown shows as text."""
    lines = [f"# {_md(title)}", "", _md(intro), ""]
    for s in sections:
        lines += [f"## {_md(s.title)}", ""]
        for kind, payload, caption in s.blocks:
            if kind == "text":
                lines += [_md(payload), ""]
            elif kind == "note":
                lines += [f"> {_md(payload)}", ""]
            elif kind == "pre":
                lines += [*_fence(payload), ""]
            elif kind == "table":
                lines += ([f"*{_md(caption)}*", ""] if caption else []) + [_md_table(payload), ""]
            elif kind == "png":
                lines += [f"![{_md(caption)}]({figures}/{payload[0]})", ""]
            elif kind == "view":
                lines += [f"*Interactive view in index.html: {_md(payload.title)}*", ""]
    lines += ["---", _md(footer), ""]
    return "\n".join(lines)
