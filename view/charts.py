"""SVG line charts, inline in HTML: no plotting library, nothing fetched at view time.

Used by the training report (a file that opens from disk on a machine with no
network) and by the proxy's web view.
"""

from __future__ import annotations

import html
import json

COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"]


def _span(low: float, high: float) -> tuple[float, float]:
    """An axis range; a single value sits in the middle of one around it."""
    if high > low:
        return low, high
    half = abs(low) * 0.1 or 0.5
    return low - half, low + half


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
    x0, x1 = _span(min(xs), max(xs))
    y0, y1 = _span(min(ys), max(ys))
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


def training_charts(con, policy: str | None = None) -> list[str]:
    """Reward over nightly runs, reward by serving adapter, forgetting across promotions,
    the last run's loss; of `policy`'s runs and traffic only, when given."""
    from overnight.view.display import RUN_POLICY

    where, args = (f"WHERE {RUN_POLICY} = ?", [policy]) if policy is not None else ("", [])
    runs = con.execute(
        f"SELECT run_id, reward_mean, metrics FROM training_runs {where} ORDER BY started_at",
        args,
    ).fetchall()
    own = (
        "WHERE group_id IN (SELECT group_id FROM completions WHERE model_requested = ?) "
        if policy is not None
        else ""
    )
    served = con.execute(
        f"SELECT models_served, avg(reward) FROM rollouts {own}GROUP BY models_served "
        "HAVING count(reward) > 0 ORDER BY min(started_at)",
        args,
    ).fetchall()
    nightly = [(i + 1, reward) for i, (_, reward, _) in enumerate(runs) if reward is not None]
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
    forgetting = forgetting_series(runs)
    if forgetting:
        charts.append(
            line_chart(
                "Forgetting against the base model on the reference set (nats per token)",
                forgetting,
                "run (served: what was served during it; candidate: what it trained)",
            )
        )
    if runs:
        steps = json.loads(runs[-1][2] or "{}").get("steps", [])
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
    return charts


def forgetting_series(runs: list[tuple]) -> dict[str, list[tuple[float, float]]]:
    """Each gated night's forgetting (trainer/gate/forgetting.py) by run: the served
    adapter's (the curve across promotions), the candidate's and the budget; {} when no
    run measured it."""
    series: dict[str, list[tuple[float, float]]] = {"served": [], "candidate": [], "budget": []}
    for i, (_, _, metrics) in enumerate(runs):
        measured = (json.loads(metrics or "{}").get("gate") or {}).get("forgetting")
        if measured:
            for name in series:
                series[name].append((i + 1, measured[name]))
    return series if series["candidate"] else {}
