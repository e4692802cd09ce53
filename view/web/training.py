"""The web view's pages over training: the adapters served, and the training runs.

    /ui/adapters              adapter versions: the promotion stack, and when each served
    /ui/runs                  training runs, with reward and loss curves

Both take `?policy=NAME` (one of the proxy's policies; another is refused, 404): that
policy's adapters, its runs and its traffic; without it, the default policy's adapters
and every run. Each page links to every policy's (policies.py).

The adapters page reads the adapter registry's `describe()` (ADAPTER_STATE) beside the
completions each adapter served; the runs page reads `training_runs` and draws its
curves (charts.py).
"""

from __future__ import annotations

from aiohttp import web

from overnight.view.answers import COLUMNS as ANSWER_COLUMNS
from overnight.view.answers import HEADERS as ANSWER_HEADERS
from overnight.view.answers import answer_rows
from overnight.view.charts import training_charts
from overnight.view.cycles import cycle_line
from overnight.view.display import RUN_POLICY

from .data import ADAPTER_STATE, query
from .frame import esc, html_page, html_table, num, stamp
from .policies import chosen_policy, policy_links


async def adapters_page(request: web.Request) -> web.Response:
    policy = request.query.get("policy") or None
    state = request.config_dict[ADAPTER_STATE](policy)  # an unknown one: 404
    where, args = ("WHERE c.model_requested = ? ", [policy]) if policy is not None else ("", [])

    def render(con):
        return con.execute(
            "SELECT model_served, count(*), min(started_at), max(started_at), "
            "avg(r.reward) FROM completions c LEFT JOIN rollout_rewards r USING (rollout_id) "
            f"{where}GROUP BY model_served ORDER BY min(started_at)",
            args,
        ).fetchall()

    served = await query(request, render)
    current = state.get("current") or {}
    stack = set(state.get("stack") or [])
    history = html_table(
        ["version", "name", "how", "at", "path", "on the stack"],
        [
            [
                num(a["version"]),
                esc(a["name"]),
                esc(a["reason"]),
                esc(a["promoted_at"]),
                esc(a["path"]),
                "yes" if a["name"] in stack else "",
            ]
            for a in reversed(state.get("adapters") or [])
        ],
        numeric={0},
    )
    # Rollbacks (with the watch's or the operator's reason) and canary decisions.
    events = html_table(
        ["at", "what", "adapter", "then served", "why"],
        [
            [esc(v.get("at")), esc(v.get("action")), esc(v.get("adapter")),
             esc(v.get("serves") or "the base model"), esc(v.get("reason") or "-")]
            for v in reversed(state.get("events") or [])
        ],
    )  # fmt: skip
    canary = state.get("canary")
    canary_line = (
        f'<p id="canary">canary: <strong>{esc(canary["name"])}</strong> serves '
        f"{canary['fraction']:.0%} of the alias's rollouts</p>"
        if canary
        else ""
    )
    handover = state.get("handover") or {}
    if "share" in handover:  # a hosted model beside vLLM (proxy/routes/handover.py)
        canary_line += (
            f'<p id="handover">handover: {handover["share"]:.0%} of the alias\'s rollouts '
            f"served locally, the rest by {esc(handover.get('hosted_model'))} "
            f"({esc(handover.get('upstream'))}), since {esc(handover.get('since'))}</p>"
        )
    usage = html_table(
        ["served by", "completions", "first", "last", "mean reward"],
        [[esc(m), num(n), stamp(a), stamp(b), num(r)] for m, n, a, b, r in served],
        numeric={1, 4},
    )
    links = policy_links("adapters", state.get("policies") or [], state.get("alias"))
    body = (
        f"{links}<p>alias <strong>{esc(state.get('alias'))}</strong> now serves "
        f'<strong id="current">{esc(current.get("name") or "the base model")}</strong>'
        f" (base model {esc(state.get('base_model'))}){_through(state)}</p>{canary_line}"
        f"<h2>Promotions and rollbacks, newest first</h2>{history}"
        f"<h2>Why it changed, newest first</h2>{events}"
        f"<h2>When each served</h2>{usage}"
    )
    return html_page(request, "Adapters", body, policy)


def _through(state: dict) -> str:
    """The hosted API the proxy fronts, where it fronts one (it serves no adapter)."""
    upstream = state.get("upstream")
    return (
        f', through the hosted <strong id="upstream">{esc(upstream)}</strong>' if upstream else ""
    )


async def runs_page(request: web.Request) -> web.Response:
    chosen = chosen_policy(request)  # an unknown one: 404
    policy = chosen.name
    where, args = (f"WHERE {RUN_POLICY} = ? ", [policy]) if policy is not None else ("", [])

    def render(con):
        runs = con.execute(
            "SELECT run_id, started_at, status, len(groups), rollouts, steps, trained_tokens, "
            "reward_mean, promoted_as, max_logprob_gap, error, "
            "json_extract_string(metrics, '$.gate.verdict'), "
            "json_extract_string(metrics, '$.gate.reason'), "
            f"CAST(json_extract(metrics, '$.maintenance.seconds') AS DOUBLE), {RUN_POLICY}, "
            "CAST(json_extract(metrics, '$.gate.forgetting.candidate') AS DOUBLE) "
            f"FROM training_runs {where}ORDER BY started_at DESC",
            args,
        ).fetchall()
        answers = con.execute(
            f"SELECT run_id, {ANSWER_COLUMNS} FROM training_runs {where}ORDER BY started_at DESC",
            args,
        ).fetchall()
        return runs, training_charts(con, policy), answer_rows(answers), cycle_line(con, policy)

    runs, charts, answers, cycles = await query(request, render)
    table = html_table(
        [
            "run",
            "policy",
            "started",
            "status",
            "groups",
            "rollouts",
            "steps",
            "tokens",
            "reward mean",
            "promoted as",
            "logprob gap",
            "error",
            "gate",
            "vLLM asleep (s)",
            "forgetting",
        ],
        [
            [
                esc(r[0]),
                esc(r[14] or "-"),
                stamp(r[1]),
                esc(r[2]),
                *(num(v) for v in r[3:8]),
                esc(r[8] or "-"),
                f"{r[9]:.1e}" if r[9] is not None else "-",
                esc(r[10] or ""),
                f'<span title="{esc(r[12] or "")}">{esc(r[11] or "-")}</span>',
                num(r[13]) if r[13] is not None else "-",  # a colocated night's window
                num(r[15]) if r[15] is not None else "-",  # nats/token from the base model
            ]
            for r in runs
        ],
        numeric={4, 5, 6, 7, 8, 10, 13, 14},
    )
    # The answers' shapes per run: watching for gaming (view/answers.py, docs/signals.md).
    shapes = (
        '<h2 id="answers">Answers: watching for gaming</h2>'
        + html_table(ANSWER_HEADERS, [[esc(c) for c in row] for row in answers])
        if answers
        else ""
    )
    links = policy_links("runs", chosen.names, policy, every=True)
    cycles = f'<p id="cycles">{esc(cycles)}</p>' if cycles else ""  # overnight learn's loop
    page = links + "".join(charts) + cycles + table + shapes
    return html_page(request, "Training runs", page, policy)
