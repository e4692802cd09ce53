"""The training report: one self-contained HTML page with inline SVG charts.

No plotting library and nothing fetched at view time: the page opens from disk, in
any browser, on a machine with no network. Written after every run to
`{data}/reports/training.html`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from overnight.config import LOGPROB_GAP_WARNING
from overnight.storage import open_db
from overnight.view.answers import COLUMNS as ANSWER_COLUMNS
from overnight.view.answers import HEADERS as ANSWER_HEADERS
from overnight.view.answers import answer_rows
from overnight.view.charts import training_charts
from overnight.view.cycles import cycle_line
from overnight.view.display import RUN_POLICY, stale_gap


def _gap_cell(gap: float | None) -> str:
    """The run's logprob gap, marked when large enough to matter (overnight.config)."""
    if gap is None:
        return "<td>-</td>"
    if gap > LOGPROB_GAP_WARNING:
        return f'<td class="warn" title="above {LOGPROB_GAP_WARNING}">{gap:.4g} !</td>'
    return f"<td>{gap:.4g}</td>"


def _gate_cell(gate: dict | None) -> str:
    """The promotion gate's verdict (trainer/gate/verdict.py), its reason on hover."""
    if not gate:
        return "<td>-</td>"
    word = html.escape(gate.get("verdict", "-"))
    mark = ' class="warn"' if word == "refused" else ""
    return f'<td{mark} title="{html.escape(gate.get("reason", ""))}">{word}</td>'


def _gate_section(runs: list[tuple]) -> str:
    """The newest gated run: its verdict in words and its side-by-side examples."""
    gated = [(r[0], r[-1]) for r in runs if r[-1] and r[-1].get("examples") is not None]
    if not gated:
        return ""
    run_id, gate = gated[-1]
    rows = "".join(
        f"<tr><td>{html.escape(e['prompt'])}</td><td>{html.escape(e['candidate'])}</td>"
        f"<td>{e['candidate_score']:.3g}</td><td>{html.escape(e['served'])}</td>"
        f"<td>{e['served_score']:.3g}</td></tr>"
        for e in gate["examples"]
    )
    return (
        f"<h2>Promotion gate of {html.escape(run_id)}: {html.escape(gate['verdict'])}</h2>"
        f"<p>{html.escape(gate['reason'])}</p><table><tr><th>prompt</th><th>candidate</th>"
        f"<th>score</th><th>served</th><th>score</th></tr>{rows}</table>"
    )


def _answers_section(rows: list[list[str]]) -> str:
    """The answers' shapes per run (gaming: docs/signals.md), newest first."""
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ANSWER_HEADERS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return (
        '<h2 id="answers">Answers: watching for gaming</h2><p>The gate\'s held-out replies of '
        "the candidate, the served adapter and the base model; the served answers of the day "
        "before the night against the day before that.</p>"
        f"<table><tr>{head}</tr>{body}</table>"
    )


def write_report(data_dir: Path, policy: str | None = None) -> Path:
    """reports/training.html: every run, each with its policy; with `policy`, that
    policy's own page, reports/training-POLICY.html: its runs, its traffic's charts."""
    where, args = (f"WHERE {RUN_POLICY} = ?", [policy]) if policy is not None else ("", [])
    con = open_db(data_dir)
    try:
        runs = con.execute(
            f"SELECT run_id, {RUN_POLICY}, started_at, status || CASE WHEN "
            "json_extract_string(metrics, '$.objective') = 'sft' THEN ' (sft)' ELSE '' END, "
            "len(groups), rollouts, steps, "
            "reward_mean, promoted_as, max_logprob_gap, json_extract(metrics, '$.logprob_gaps'), "
            f"json_extract(metrics, '$.gate') FROM training_runs {where} ORDER BY started_at",
            args,
        ).fetchall()
        # (..., gap, stale gap, gate): the stale gap from the run's gaps by age.
        runs = [(*r[:-2], stale_gap(r[-2]), json.loads(r[-1]) if r[-1] else None) for r in runs]
        charts = training_charts(con, policy)
        cycles = cycle_line(con, policy)
        answers = answer_rows(
            con.execute(
                f"SELECT run_id, {ANSWER_COLUMNS} FROM training_runs {where} "
                "ORDER BY started_at DESC",
                args,
            ).fetchall()
        )
    finally:
        con.close()
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape('-' if v is None else f'{v:.4g}' if isinstance(v, float) else str(v))}</td>"
            for v in r[:-3]
        )
        + _gap_cell(r[-3])
        + (f"<td>{r[-2]:.4g}</td>" if r[-2] is not None else "<td>-</td>")
        + _gate_cell(r[-1])
        + "</tr>"
        for r in reversed(runs)
    )
    large = [r[0] for r in runs if r[-3] is not None and r[-3] > LOGPROB_GAP_WARNING]
    warning = (
        f'<p class="warn">Logprob gap above {LOGPROB_GAP_WARNING} nats before the first update, '
        f"on records the starting adapter sampled itself, in {html.escape(', '.join(large))}: "
        "serving and training disagree (serve in the trainer's dtype, with --logprobs-mode "
        "processed_logprobs).</p>"
        if large
        else ""
    )
    if any(r[-2] is not None for r in runs):
        warning += (
            "<p>Stale gap: the same gap on records sampled by earlier adapters, a promotion "
            "or more old: drift, not a serving mismatch; trained with their importance ratios "
            "(--max-staleness 0 leaves them out).</p>"
        )
    title = f" of the policy {html.escape(policy)}" if policy is not None else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>overnight training</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;max-width:1200px}}figure{{display:inline-block;margin:1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ddd;padding:4px 8px;text-align:right}}
.warn{{color:#b00}}</style></head>
<body><h1>overnight: training runs{title}</h1>{"".join(charts)}
<h2>Runs</h2>{f'<p id="cycles">{html.escape(cycles)}</p>' if cycles else ""}<table><tr><th>run</th><th>policy</th><th>started</th><th>status</th><th>groups</th><th>rollouts</th>
<th>steps</th><th>reward mean</th><th>promoted as</th><th>logprob gap</th><th>stale gap</th><th>gate</th></tr>{rows}</table>
{warning}{_gate_section(runs)}{_answers_section(answers)}
</body></html>"""
    name = "training.html" if policy is None else f"training-{policy}.html"
    out = Path(data_dir) / "reports" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
