"""The bench result as a terminal table, a JSON file and a plot."""

from __future__ import annotations

import json
from pathlib import Path


def label(row: dict, swept: list[str]) -> str:
    c = row["config"]
    parts = [f"{k}={'auto' if c[k] is None else c[k]}" for k in swept] or [c["backend"]]
    return " ".join(parts)


NO_VERDICT = ("not measured", "disturbed")  # rows whose figures are shown as such, never as measurements


def _rate(x: float, judged: bool = True) -> str:
    text = f"{x:,.0f}" if x >= 100 else f"{x:.1f}"
    return f"{text if judged else f'({text})':>9s}"


def table(result: dict) -> str:
    """The figures of every row, then every row's verdict with its caveats (a sweep's rows each have one), the
    advice for the best row, and the best configuration when it stands out from the others' noise."""
    swept = [k for k in result["sweep"] if len(result["sweep"][k]) > 1] or ["backend"]
    head = f"{'configuration':34s} {'loader':>9s} {'model':>9s} {'end2end':>9s} {'headroom':>8s} {'wait':>5s}  verdict"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"{label(r, swept):34s} skipped: {r['skipped'][:80]}")
            continue
        lo, mo, ee = r["loader_only"], r["model_only"], r["end_to_end"]
        ok = r["verdict"] not in NO_VERDICT
        lines.append(f"{label(r, swept):34s} {_rate(lo['img_per_s'], ok)} {_rate(mo['img_per_s'], ok)} "
                     f"{_rate(ee['img_per_s'], ok)} {r['headroom']:7.1f}x "
                     f"{100 * ee['data_wait']:4.0f}%  {r['verdict']}")
    lines.append("(images/s, median of the windows; headroom = loader ÷ model: below 1 the loader cannot keep up; "
                 "(in brackets): figures that carry no verdict)")
    done = [r for r in result["rows"] if "skipped" not in r]
    decoders = sorted({r["decoder"] for r in done if r.get("decoder")})
    if decoders:
        lines.append(f"JPEG decoder: {', '.join(decoders)}")
    for r in done:
        lines += ["", (f"{label(r, swept)}: " if len(done) > 1 else "") + r["verdict_text"]]
        lines += [f"  caveat: {c}" for c in r.get("caveats", [])]
        if "augment_share" in r:
            lines.append(f"  augmentation ({r['config']['augment']}) adds {r['augment_only']['ms_per_batch']:.1f} ms "
                         f"per batch: {r['augment_share']:.0%} of each end-to-end step")
    best = next((r for r in done if r["config"] == result.get("best")), None)
    if best is not None:
        lines += [f"  - {a}" for a in best["advice"]]
        if len(done) > 1:
            lines.append(_best_line(best, done, swept))
    return "\n".join(lines)


def _best_line(best: dict, rows: list[dict], swept: list[str]) -> str:
    e = best["end_to_end"]
    line = f"best configuration: {label(best, swept)} ({e['img_per_s']:,.1f} img/s end to end, windows " \
           f"{e['low']:,.1f}-{e['high']:,.1f})"
    others = [r for r in rows if r is not best and r.get("verdict") not in NO_VERDICT]
    close = [label(r, swept) for r in others if r["end_to_end"]["high"] >= e["low"]]
    if any(len(r["end_to_end"]["windows"]) < 2 for r in (best, *others)):  # no spread to tell noise by
        return line + "; from single windows, whose noise is not measured: a difference of a few percent may be noise"
    if close:  # a difference smaller than the spread of the windows is none
        return (f"best configuration: no difference between {label(best, swept)} ({e['img_per_s']:,.1f} img/s end to "
                f"end, windows {e['low']:,.1f}-{e['high']:,.1f}) and {', '.join(close)}: their windows overlap, the "
                f"gap is within the measurements' noise")
    return line


def write_json(result: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str))


def plot(result: dict, path: str) -> None:
    fig = figure(result)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def figure(result: dict):
    """The three rates per row, with the windows' range. A row without a verdict (not measured, disturbed) is a
    hatched grey band labelled with it: its figures are not drawn as if they were measurements."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in result["rows"] if "skipped" not in r]
    swept = [k for k in result["sweep"] if len(result["sweep"][k]) > 1] or ["backend"]
    judged = [i for i, r in enumerate(rows) if r["verdict"] not in NO_VERDICT]
    kinds = [("loader_only", "loader only", "#4c9"), ("model_only", "model only", "#58c"),
             ("end_to_end", "end to end", "#e84")]
    fig = Figure(figsize=(max(6, 1.6 * len(rows) + 2), 4.2))
    FigureCanvasAgg(fig)  # no pyplot: the caller's matplotlib backend and state stay untouched
    ax = fig.add_subplot()
    for i, (key, name, color) in enumerate(kinds if judged else []):
        vals = [rows[j][key]["img_per_s"] for j in judged]
        err = [[rows[j][key]["img_per_s"] - rows[j][key]["low"] for j in judged],
               [rows[j][key]["high"] - rows[j][key]["img_per_s"] for j in judged]]
        ax.bar(np.array(judged) + (i - 1) * 0.27, vals, 0.27, yerr=err, label=name, color=color)
    if not judged:
        ax.set_yticks([])  # no figure to scale
    allv = [rows[j][k]["img_per_s"] for j in judged for k, _, _ in kinds]
    if allv and max(allv) / max(min(allv), 1e-9) > 20:
        ax.set_yscale("log")  # a 50x gap would flatten the smaller bars to nothing
    for j, r in enumerate(rows):
        if j not in judged:
            ax.axvspan(j - 0.42, j + 0.42, facecolor="0.9", edgecolor="0.6", hatch="//",
                       label="no verdict: figures not drawn" if j == min(set(range(len(rows))) - set(judged)) else None)
            ax.text(j, 0.5, r["verdict"], transform=ax.get_xaxis_transform(), ha="center", va="center",
                    rotation=90, color="0.3")
    names = [label(r, swept) + ("\n(CPU busy)" if r.get("caveats") else "") for r in rows]
    ax.set_xticks(np.arange(len(rows)), names, rotation=15 if len(rows) > 3 else 0,
                  ha="right" if len(rows) > 3 else "center")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel("images / s (median, error bar: window range)")
    c = rows[0]["config"] if rows else {}
    best = next((r for r in rows if result.get("best") is not None and r["config"] == result["best"]), None)
    ax.set_title(f"{c.get('model')} on {c.get('device')}, batch {c.get('batch_size')}, {c.get('image_size')}px, "
                 f"amp {c.get('amp')}: {best['verdict'] if best else 'no verdict'}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    return fig
