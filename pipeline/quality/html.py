"""The drift page: one self-contained HTML file (inline SVG and CSS, no script, nothing fetched) of a comparison."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Iterable, Mapping

from pipeline.errors import OutputError
from pipeline.io.stats import STAGES

PREVIOUS_COLOR = "#9aa5b1"
CURRENT_COLOR = "#1f6feb"
UP_COLOR = "#2da44e"
DOWN_COLOR = "#cf222e"
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1060px;color:#1f2328}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 6px}
.sub{color:#57606a;margin:0 0 14px;word-break:break-all}
.verdict{padding:10px 14px;border-radius:6px;font-weight:600;margin:12px 0}
.pass{background:#dafbe1;color:#116329}.fail{background:#ffebe9;color:#a40e26}
.verdict ul{margin:6px 0 0;font-weight:400}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 12px 3px 0;text-align:right}
td:first-child,th:first-child{text-align:left}th{color:#57606a;font-weight:600}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:8px 28px}
svg{font:12px system-ui,sans-serif;overflow:visible}.axis{stroke:#8c959f}.lbl{fill:#57606a}
.key span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:-1px}
"""


def write_html(result: Mapping[str, Any], path: str) -> None:
    """Write :func:`render_html` of ``result`` to ``path`` (a local file).

    Raises:
        OutputError: the file cannot be written.
    """
    try:
        Path(path).write_text(render_html(result), encoding="utf-8")
    except OSError as err:
        raise OutputError(f"cannot write --html {path!r}: {err.strerror or err}; give a writable file path") from None


def render_html(result: Mapping[str, Any]) -> str:
    """The page of a :func:`pipeline.quality.statistics.compare_outputs` result."""
    if result.get("against") is None:
        body = f"<h1>Quality gate</h1><p class='sub'>{_e(result.get('dest'))}</p>" \
               f"<div class='verdict pass'>{_e(result.get('message', 'nothing to compare with'))}: passes</div>"
        return _page("Quality gate", body)
    cur, prev = result["current"], result["previous"]
    t = result["thresholds"]
    verdict = ("<div class='verdict pass'>Gate passed: no threshold crossed</div>" if result["passed"] else
               "<div class='verdict fail'>Gate FAILED: drift<ul>" +
               "".join(f"<li>{_e(b['message'])}</li>" for b in result["breaches"]) + "</ul></div>")
    if result.get("too_few_rows"):
        verdict += f"<p class='sub'>Fewer than {t['min_rows']} rows on one side: reported, not gated.</p>"
    numbers = [
        ("rows", prev["quality"]["rows"], cur["quality"]["rows"], ""),
        ("carried rows", prev["quality"]["carried"], cur["quality"]["carried"], ""),
        ("confidence PSI", "", f"{result['psi']:.4f}", f"max {t['psi_max']}"),
        ("label JS divergence (bits)", "", f"{result['js_divergence']:.4f}", f"max {t['js_max']}"),
        ("mean top-1 confidence", *_pair(result.get("confidence_mean"), "{:.3f}"), ""),
        ("mean top-1 − top-2 margin", *_pair(result.get("margin_mean"), "{:.3f}"), ""),
        (f"share below {cur['quality']['below_floor']['floor']}", *_pair(result.get("below_floor_share"), "{:.1%}"), ""),
    ]
    table = "<table><tr><th></th><th>previous</th><th>current</th><th></th></tr>" + "".join(
        f"<tr><td>{_e(n)}</td><td>{_e(_fmt(p))}</td><td>{_e(_fmt(c))}</td><td class='lbl'>{_e(x)}</td></tr>"
        for n, p, c, x in numbers) + "</table>"
    key = (f"<div class='key'><span style='background:{PREVIOUS_COLOR}'></span>previous "
           f"<span style='background:{CURRENT_COLOR}'></span>current</div>")
    body = "".join([
        "<h1>Quality gate: drift against the previous output</h1>",
        f"<p class='sub'>current <b>{_e(result['dest'])}</b><br>previous <b>{_e(result['against'])}</b></p>",
        verdict, table,
        "<div class='grid'><div>",
        "<h2>Top-1 confidence (share of ok rows per bin)</h2>", key,
        overlaid_histogram("confidence", prev["quality"]["confidence"], cur["quality"]["confidence"]),
        "</div><div>",
        "<h2>Top-1 − top-2 margin</h2>", key,
        overlaid_histogram("margin", prev["quality"]["margin"], cur["quality"]["margin"]),
        "</div></div>",
        "<h2>Biggest label shifts (share of ok rows; counts previous → current)</h2>",
        label_shifts_chart(result.get("label_shifts") or []),
        "<div class='grid'><div>",
        "<h2>Error rate by kind</h2>", key, error_chart(result.get("error_rates") or {}),
        "</div><div>",
        "<h2>Run: throughput and stage times</h2>", key, run_chart(prev.get("run"), cur.get("run")),
        "</div></div>",
    ])
    return _page("Quality gate: " + ("passed" if result["passed"] else "DRIFT"), body)


def overlaid_histogram(name: str, previous: Mapping[str, Any], current: Mapping[str, Any],
                       width: int = 500, height: int = 220) -> str:
    """Two histograms over the same bins: previous as filled bars, current as outlined bars on top."""
    edges = list(current["edges"])
    p, c = _norm(previous["counts"]), _norm(current["counts"])
    top = max(max(p, default=0), max(c, default=0)) or 1.0
    left, bottom, plot_w, plot_h = 40, height - 24, width - 50, height - 40
    n = len(edges) - 1
    bw = plot_w / n
    parts = [f"<line class='axis' x1='{left}' y1='{bottom}' x2='{left + plot_w}' y2='{bottom}'/>",
             f"<line class='axis' x1='{left}' y1='{bottom}' x2='{left}' y2='{bottom - plot_h}'/>"]
    for frac in (0.5, 1.0):
        y = bottom - plot_h * frac
        parts.append(f"<text class='lbl' x='{left - 4}' y='{y + 4:.1f}' text-anchor='end'>{top * frac:.0%}</text>")
    for i in range(n):
        x = left + i * bw
        hp, hc = plot_h * p[i] / top, plot_h * c[i] / top
        parts.append(f"<rect class='bar prev' x='{x + 1:.1f}' y='{bottom - hp:.1f}' width='{bw - 2:.1f}' "
                     f"height='{hp:.1f}' fill='{PREVIOUS_COLOR}'><title>{edges[i]:.2f}–{edges[i + 1]:.2f}: "
                     f"previous {p[i]:.1%}</title></rect>")
        parts.append(f"<rect class='bar cur' x='{x + 1:.1f}' y='{bottom - hc:.1f}' width='{bw - 2:.1f}' "
                     f"height='{hc:.1f}' fill='{CURRENT_COLOR}' fill-opacity='0.35' stroke='{CURRENT_COLOR}' "
                     f"stroke-width='1.5'><title>{edges[i]:.2f}–{edges[i + 1]:.2f}: current {c[i]:.1%}</title></rect>")
    for i in range(0, n + 1, 4):
        parts.append(f"<text class='lbl' x='{left + i * bw:.1f}' y='{bottom + 15}' text-anchor='middle'>"
                     f"{edges[i]:.1f}</text>")
    return _svg(name, width, height, parts, f"{name} histogram, previous and current")


def label_shifts_chart(shifts: list[Mapping[str, Any]], width: int = 1000) -> str:
    """A diverging bar per label: its share's change, with previous and current counts."""
    if not shifts:
        return "<p class='sub'>No labels on either side.</p>"
    row_h, label_w, count_w = 22, 300, 170
    mid_w = width - label_w - count_w
    center = label_w + mid_w / 2
    most = max(abs(s["change"]) for s in shifts) or 1.0
    height = row_h * len(shifts) + 10
    parts = [f"<line class='axis' x1='{center}' y1='0' x2='{center}' y2='{height - 6}'/>"]
    for i, s in enumerate(shifts):
        y = i * row_h + 4
        w = (mid_w / 2 - 10) * abs(s["change"]) / most
        x = center if s["change"] >= 0 else center - w
        color = UP_COLOR if s["change"] >= 0 else DOWN_COLOR
        parts.append(f"<text x='{label_w - 8}' y='{y + 13}' text-anchor='end'>{_e(_short(s['label'], 40))}</text>")
        parts.append(f"<rect class='bar shift' x='{x:.1f}' y='{y}' width='{max(w, 1):.1f}' height='{row_h - 6}' "
                     f"fill='{color}'><title>{_e(s['label'])}: {s['previous_share']:.1%} → {s['current_share']:.1%}"
                     f"</title></rect>")
        parts.append(f"<text class='lbl' x='{width - count_w + 8}' y='{y + 13}'>{s['change']:+.1%}  "
                     f"({s['previous']:,} → {s['current']:,})</text>")
    return _svg("label-shifts", width, height, parts, "largest changes of label share")


def error_chart(rates: Mapping[str, Mapping[str, Any]], width: int = 500) -> str:
    """Paired horizontal bars per error kind: previous and current share of rows."""
    if not rates:
        return _svg("errors", width, 30, ["<text class='lbl' x='0' y='18'>no error rows on either side</text>"],
                    "error rates: none")
    return _paired_bars("errors", [(k, r["previous"], r["current"], f"{r['previous']:.1%} → {r['current']:.1%}")
                                   for k, r in rates.items()], width)


def run_chart(previous: Mapping[str, Any] | None, current: Mapping[str, Any] | None, width: int = 500) -> str:
    """Images per second and each stage's seconds, previous against current."""
    if not previous and not current:
        return "<p class='sub'>No _REPORT.json on either side.</p>"
    prev, cur = previous or {}, current or {}
    items = [("images/s", prev.get("images_per_s"), cur.get("images_per_s"))]
    items += [(f"{s} s", (prev.get("stage_seconds") or {}).get(s), (cur.get("stage_seconds") or {}).get(s))
              for s in STAGES]
    items.append(("elapsed s", prev.get("elapsed_s"), cur.get("elapsed_s")))
    rows = [(name, p or 0.0, c or 0.0, f"{_fmt(p)} → {_fmt(c)}") for name, p, c in items
            if p is not None or c is not None]
    return _paired_bars("run", rows, width, per_row_scale=True)


def _paired_bars(name: str, rows: Iterable[tuple[str, float, float, str]], width: int,
                 per_row_scale: bool = False) -> str:
    rows = list(rows)
    label_w, text_w, row_h = 130, 130, 30
    bar_w = width - label_w - text_w
    most = max((max(p, c) for _, p, c, _ in rows), default=0) or 1.0
    parts = []
    for i, (label, p, c, text) in enumerate(rows):
        scale = (max(p, c) or 1.0) if per_row_scale else most
        y = i * row_h + 2
        parts.append(f"<text x='{label_w - 8}' y='{y + 15}' text-anchor='end'>{_e(label)}</text>")
        parts.append(f"<rect class='bar prev' x='{label_w}' y='{y}' width='{bar_w * p / scale:.1f}' height='12' "
                     f"fill='{PREVIOUS_COLOR}'><title>previous {_fmt(p)}</title></rect>")
        parts.append(f"<rect class='bar cur' x='{label_w}' y='{y + 13}' width='{bar_w * c / scale:.1f}' height='12' "
                     f"fill='{CURRENT_COLOR}'><title>current {_fmt(c)}</title></rect>")
        parts.append(f"<text class='lbl' x='{label_w + bar_w + 8}' y='{y + 15}'>{_e(text)}</text>")
    return _svg(name, width, row_h * len(rows) + 4, parts, f"{name}: previous and current")


def _svg(name: str, width: int, height: int, parts: list[str], title: str) -> str:
    return (f"<svg class='chart' data-chart='{name}' role='img' aria-label='{_e(title)}' width='{width}' "
            f"height='{height}' viewBox='0 0 {width} {height}' xmlns='http://www.w3.org/2000/svg'>"
            + "".join(parts) + "</svg>")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><style>{CSS}</style></head>"
            f"<body>{body}</body></html>\n")


def _norm(counts: Iterable[float]) -> list[float]:
    counts = list(counts)
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def _pair(change: Mapping[str, Any] | None, fmt: str) -> tuple[str, str]:
    change = change or {}
    return tuple("-" if change.get(k) is None else fmt.format(change[k]) for k in ("previous", "current"))


def _fmt(value: Any) -> str:
    if value is None or value == "":
        return "-" if value is None else ""
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)
