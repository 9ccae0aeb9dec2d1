"""Frontier report: the Pareto front over (output throughput per GPU, or in total on a CPU,
per-user speed, quality), PNG plots with the front highlighted and dominated points faded in
their setting's colour, and one self-contained HTML."""

from __future__ import annotations

import base64
import html
import json
import math
import os
from typing import Any

# Dominated points: drawn in their setting's colour at this opacity.
DOMINATED_ALPHA = 0.3


def on_gpus(sweep: dict[str, Any]) -> bool:
    """Whether the sweep's servers ran on GPUs (throughput is then per GPU; on a CPU, the
    server's total: its processes share the cores, so "per device" would mean nothing)."""
    return sweep.get("device", "cuda") == "cuda"


def throughput_label(sweep: dict[str, Any]) -> str:
    return "per GPU" if on_gpus(sweep) else "total"


def point_metrics(state: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured point with the axes of the front."""
    sweep = state["sweep"]
    pct = sweep.get("percentile", "median")
    gpus = max(sweep.get("num_gpus", 1), 1) if on_gpus(sweep) else 1
    rows = []
    for p in state["points"]:
        if "summary" not in p:
            continue
        s = p["summary"]
        tpot = s["tpot_ms"][pct]
        q = state["quality"].get(p["quality_key"], {})
        rows.append({
            "setting": p["setting"] or "(base flags)", "concurrency": p["concurrency"],
            "command": p["command"],
            "throughput_per_gpu": s["output_throughput"] / gpus,
            "user_tok_s": 1000.0 / tpot if tpot and not math.isnan(tpot) else 0.0,
            "ttft_ms": s["ttft_ms"][pct], "tpot_ms": tpot,
            "kl": q.get("kl_mean"), "top1": q.get("top1_agreement"),
            "goodput": s.get("goodput", {}).get("request_goodput"),
        })
    return rows


def _objectives(r: dict[str, Any]) -> tuple[float, ...]:
    """Bigger is better on every axis; quality (-KL) only when it was measured."""
    obj = (r["throughput_per_gpu"], r["user_tok_s"])
    return obj + ((-r["kl"],) if r["kl"] is not None else ())


def pareto_front(rows: list[dict[str, Any]]) -> list[bool]:
    """Whether each row is on the front: no other row is at least as good on every objective
    and better on one."""
    objs = [_objectives(r) for r in rows]

    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return len(a) == len(b) and all(x >= y for x, y in zip(a, b, strict=True)) and a != b

    return [not any(dominates(o, x) for o in objs) for x in objs]


def _plot(rows: list[dict[str, Any]], front: list[bool], x: str, y: str, xlabel: str,
          ylabel: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=90)
    settings = sorted({r["setting"] for r in rows})
    colors = plt.get_cmap("tab10")
    for r, on in zip(rows, front, strict=True):
        if r[x] is None or r[y] is None:
            continue
        c = colors(settings.index(r["setting"]) % 10)
        if on:
            ax.scatter(r[x], r[y], color=c, s=60, zorder=3, edgecolor="black")
            ax.annotate(f"c={r['concurrency']}", (r[x], r[y]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        else:  # its setting's colour, faded: the legend still says whose point it is
            ax.scatter(r[x], r[y], color=c, alpha=DOMINATED_ALPHA, s=30, zorder=2)
    pts = sorted((r[x], r[y]) for r, on in zip(rows, front, strict=True)
                 if on and r[x] is not None and r[y] is not None)
    if len(pts) > 1:
        ax.plot(*zip(*pts, strict=True), color="black", lw=0.8, ls="--", zorder=1)
    for i, s in enumerate(settings):
        ax.scatter([], [], color=colors(i % 10), edgecolor="black", label=s[:60])
    ax.scatter([], [], color="grey", alpha=DOMINATED_ALPHA, label="dominated (faded)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(state: dict[str, Any], out_dir: str) -> list[str]:
    """frontier.png (+ frontier-ttft.png, frontier-quality.png) and report.html in out_dir."""
    rows = point_metrics(state)
    front = pareto_front(rows)
    sweep = state["sweep"]
    pct = sweep.get("percentile", "median")
    per = throughput_label(sweep)
    plots = [("frontier.png", "user_tok_s", f"per-user speed (tok/s, 1000 / TPOT {pct})"),
             ("frontier-ttft.png", "ttft_ms", f"TTFT {pct} (ms)")]
    if any(r["kl"] is not None for r in rows):
        plots.append(("frontier-quality.png", "kl", "KL divergence vs reference (nats/token)"))
    paths = []
    for name, y, ylabel in plots:
        path = os.path.join(out_dir, name)
        _plot(rows, front, "throughput_per_gpu", y, f"output throughput {per} (tok/s)",
              ylabel, path, f"{sweep['workload']['name']} workload: front in color")
        paths.append(path)
    on_front = [r for r, on in zip(rows, front, strict=True) if on]
    print("Pareto front (serve command @ client concurrency):")
    for r in sorted(on_front, key=lambda r: -r["throughput_per_gpu"]):
        print(f"  {r['throughput_per_gpu']:8.1f} tok/s {per}  {r['user_tok_s']:7.1f} tok/s/user"
              f"  TTFT {r['ttft_ms']:7.0f} ms  @ c={r['concurrency']}:  {r['command']}")
    html_path = os.path.join(out_dir, "report.html")
    with open(html_path, "w") as f:
        f.write(_html(state, rows, front, [p for p in paths]))
    return [*paths, html_path]


def _settings_table(sweep: dict[str, Any]) -> str:
    """The sweep's settings as a two-column table (a nested setting, one row per field)."""
    rows: list[tuple[str, str]] = [
        ("grid", " ".join(sweep["grid"]) or "(none)"),
        ("base flags", sweep["base_flags"] or "(none)"),
        ("device", f"{sweep.get('device', 'cuda')}"
                   + (f" x {sweep.get('num_gpus', 1)}" if on_gpus(sweep) else "")),
        ("client concurrency", ", ".join(str(c) for c in sweep["levels"])),
    ]
    for group in ("workload", "load"):
        rows += [(f"{group}: {k}", json.dumps(v) if isinstance(v, dict | list) else str(v))
                 for k, v in sweep[group].items() if v is not None]
    if sweep.get("slos_ms"):
        rows.append(("goodput objectives (ms)", json.dumps(sweep["slos_ms"])))
    rows.append(("quality reference", sweep["reference_flags"]))
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                    for k, v in rows)
    return f'<table class="settings">{cells}</table>'


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _quality_note(sweep: dict[str, Any]) -> str:
    """One line when quality was not measured (dummy weights, --no-quality); else nothing."""
    status = sweep.get("quality", "measured")
    return "" if status == "measured" else f"<p>Quality: {html.escape(status)}.</p>"


def _html(state: dict[str, Any], rows: list[dict[str, Any]], front: list[bool],
          images: list[str]) -> str:
    sweep = state["sweep"]
    per = throughput_label(sweep)
    head = ("<tr><th>front</th><th>setting</th><th>concurrency</th>"
            f"<th>out tok/s {per}</th>"
            "<th>tok/s per user</th><th>TTFT ms</th><th>TPOT ms</th><th>KL</th><th>top-1</th>"
            "<th>goodput req/s</th><th>command</th></tr>")
    body = []
    order = sorted(range(len(rows)), key=lambda i: (not front[i], -rows[i]["throughput_per_gpu"]))
    for i in order:
        r = rows[i]
        style = "" if front[i] else ' style="color:#999"'
        body.append(
            f"<tr{style}><td>{'&#9733;' if front[i] else ''}</td>"
            f"<td>{html.escape(r['setting'])}</td><td>{r['concurrency']}</td>"
            f"<td>{_fmt(r['throughput_per_gpu'])}</td><td>{_fmt(r['user_tok_s'])}</td>"
            f"<td>{_fmt(r['ttft_ms'], 0)}</td><td>{_fmt(r['tpot_ms'])}</td>"
            f"<td>{_fmt(r['kl'], 4)}</td><td>{_fmt(r['top1'], 3)}</td>"
            f"<td>{_fmt(r['goodput'], 2)}</td><td><code>{html.escape(r['command'])}</code></td>"
            "</tr>")
    failed = [p for p in state["points"] if "error" in p]
    imgs = []
    for path in images:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        imgs.append(f'<img alt="{os.path.basename(path)}" src="data:image/png;base64,{data}">')
    fails = "".join(f"<li><code>{html.escape(p['command'])}</code>: {html.escape(p['error'])}"
                    "</li>" for p in failed)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>skyline frontier</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:48%}}
table.settings td,table.settings th{{text-align:left}}</style>
</head><body>
<h1>skyline frontier</h1>
{_settings_table(sweep)}
<p>Front: no other point has at least the output throughput ({per}), the per-user speed
(1000 / TPOT {sweep.get('percentile', 'median')}) and the quality (lower KL vs
<code>{html.escape(sweep['reference_flags'])}</code> on {sweep['calib_tokens']} calibration
tokens), and more of one. Dominated points are faded (grey in the table).</p>
{_quality_note(sweep)}
{''.join(imgs)}
<table>{head}{''.join(body)}</table>
{f'<h2>Failed settings</h2><ul>{fails}</ul>' if fails else ''}
</body></html>
"""
