"""The training report: one self-contained HTML page with inline SVG charts.

No plotting library and nothing fetched at view time: the page opens from disk, in
any browser, on a machine with no network. Written after every run to
`{data}/reports/training.html`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from overnight.storage import open_db

COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"]


def line_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    x_label: str,
    width: int = 560,
    height: int = 220,
) -> str:
    """An SVG line chart of named (x, y) series, with min/max labels on both axes."""
    points = [p for values in series.values() for p in values]
    if not points:
        return f"<figure><figcaption>{html.escape(title)}: no data yet</figcaption></figure>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    pad = 40

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad + (y - y0) / (y1 - y0) * (2 * pad - height)

    parts = [
        f'<svg width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">',
        f'<rect x="{pad}" y="{pad / 2}" width="{width - 2 * pad}" height="{height - 1.5 * pad}" '
        'fill="none" stroke="#ccc"/>',
    ]
    for i, (name, values) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}"/>'
        )
        parts += [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>' for x, y in values
        ]
        parts.append(
            f'<text x="{width - pad}" y="{14 + 14 * i}" text-anchor="end" fill="{colour}" '
            f'font-size="12">{html.escape(name)}</text>'
        )
    parts += [
        f'<text x="{pad - 4}" y="{sy(y1) + 4:.1f}" text-anchor="end" font-size="11">{y1:.3g}</text>',
        f'<text x="{pad - 4}" y="{sy(y0) + 4:.1f}" text-anchor="end" font-size="11">{y0:.3g}</text>',
        f'<text x="{sx(x0):.1f}" y="{height - pad + 16}" font-size="11">{x0:.3g}</text>',
        f'<text x="{sx(x1):.1f}" y="{height - pad + 16}" text-anchor="end" font-size="11">{x1:.3g}</text>',
        f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle" font-size="11">{html.escape(x_label)}</text>',
        "</svg>",
    ]
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{''.join(parts)}</figure>"


def write_report(data_dir: Path) -> Path:
    con = open_db(data_dir)
    try:
        runs = con.execute(
            "SELECT run_id, started_at, status, len(groups), rollouts, steps, reward_mean, promoted_as, "
            "max_logprob_gap, metrics FROM training_runs ORDER BY started_at"
        ).fetchall()
        served = con.execute(
            "SELECT models_served, avg(reward) FROM rollouts GROUP BY models_served "
            "HAVING count(reward) > 0 ORDER BY min(started_at)"
        ).fetchall()
    finally:
        con.close()
    nightly = [(i + 1, r[6]) for i, r in enumerate(runs) if r[6] is not None]
    charts = [
        line_chart("Mean reward of the traffic each run trained on", {"reward": nightly}, "run")
    ]
    if served:
        charts.append(
            line_chart(
                "Mean reward by the adapter that served the traffic",
                {"reward": [(i + 1, v) for i, (_, v) in enumerate(served)]},
                "adapter, in order: " + ", ".join(str(m) for m, _ in served),
            )
        )
    if runs:
        steps = json.loads(runs[-1][9] or "{}").get("steps", [])
        charts.append(
            line_chart(
                f"Run {runs[-1][0]}: loss and clipped fraction per step",
                {
                    "loss": [(s["step"], s["loss"]) for s in steps],
                    "clipped": [(s["step"], s.get("clipped_fraction", 0.0)) for s in steps],
                },
                "step",
            )
        )
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape('-' if v is None else f'{v:.4g}' if isinstance(v, float) else str(v))}</td>"
            for v in r[:9]
        )
        + "</tr>"
        for r in reversed(runs)
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>overnight training</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;max-width:1200px}}figure{{display:inline-block;margin:1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ddd;padding:4px 8px;text-align:right}}</style></head>
<body><h1>overnight: training runs</h1>{"".join(charts)}
<h2>Runs</h2><table><tr><th>run</th><th>started</th><th>status</th><th>groups</th><th>rollouts</th>
<th>steps</th><th>reward mean</th><th>promoted as</th><th>logprob gap</th></tr>{rows}</table></body></html>"""
    out = Path(data_dir) / "reports" / "training.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
