"""One SVG chart of a ``sfa-rd2h bench`` report, written by hand (no plotting library).

Throughput of every data-plane row (engine reads by size, the pipeline) next to its
baseline's, as paired horizontal bars: the chart a reader checks the data-plane goals on.
"""

from __future__ import annotations

from html import escape
from typing import Any

_W, _LABEL, _ROW, _BAR, _TOP = 760, 230, 34, 12, 56
_PROJECT, _BASELINE = "#3a6ea5", "#b8b8b8"


def _throughput_rows(rep: dict[str, Any]) -> list[tuple[str, float, float]]:
    out = []
    for row in rep["rows"]:
        d = row["detail"]
        nbytes = d.get("bytes")
        if not nbytes or not ("_read_" in row["name"] or row["name"] == "pipeline"):
            continue
        out.append((row["name"], nbytes / row["median_s"] / 1e9,
                    nbytes / row["baseline_s"] / 1e9))
    return out


def render_chart(rep: dict[str, Any]) -> str:
    """The SVG text for ``rep`` (a ``bench --json`` report)."""
    rows = _throughput_rows(rep)
    height = _TOP + _ROW * max(1, len(rows)) + 40
    top = max([max(p, b) for _, p, b in rows] + [1.0])
    scale = (_W - _LABEL - 90) / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{_W}" height="{height}" fill="white"/>',
           '<text x="10" y="20" font-size="14" font-weight="bold">sfa-rd2h bench: data-plane '
           'throughput, project vs baseline (GB/s)</text>',
           f'<rect x="10" y="32" width="12" height="10" fill="{_PROJECT}"/>'
           '<text x="26" y="41">project (engine read between processes / runtime pipeline)'
           '</text>',
           f'<rect x="420" y="32" width="12" height="10" fill="{_BASELINE}"/>'
           '<text x="436" y="41">baseline (in-process copy / one batched read)</text>']
    for i, (name, proj, base) in enumerate(rows):
        y = _TOP + i * _ROW
        out.append(f'<text x="{_LABEL - 8}" y="{y + _BAR + 4}" text-anchor="end">'
                   f'{escape(name)}</text>')
        for k, (value, color) in enumerate(((proj, _PROJECT), (base, _BASELINE))):
            yy = y + k * (_BAR + 2)
            w = max(1.0, value * scale)
            out.append(f'<rect x="{_LABEL}" y="{yy}" width="{w:.1f}" height="{_BAR}" '
                       f'fill="{color}"/>')
            out.append(f'<text x="{_LABEL + w + 4:.1f}" y="{yy + _BAR - 2}">{value:.2f}</text>')
    if not rows:
        out.append(f'<text x="10" y="{_TOP + 14}">no data-plane rows in this report</text>')
    out.append('</svg>')
    return "\n".join(out) + "\n"


def write_chart(rep: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        f.write(render_chart(rep))
