"""Readable companions of a simulation report: loss and sync figures and a markdown summary.

`write_report_figures` puts `<stem>.loss.png`, `<stem>.sync.png` and `<stem>.md` beside the report
JSON; `compare_reports` draws several reports' loss curves on one figure for the experiments.
Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so no display is needed and
no global backend state is touched. A report with no evals or no rounds still gets its files,
with a note in the empty panels.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from urllib.parse import quote

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

# Event kinds a reader looks for first; others (start, ready, done, exit, skip...) are listed after.
NOTABLE_EVENTS = ("kill", "leave", "join", "timeout", "resync", "caught_up", "reject")
# Churn actions' marks on the sync figure: (colour, line style); styles differ so coinciding marks show.
CHURN_MARKS = {"kill": ("red", "-"), "leave": ("orange", "--"), "join": ("green", ":")}

# (report key in evals, axis label, tick formatter) for the three loss panels.
_LOSS_AXES = (("tokens", "tokens trained (all peers)", lambda: EngFormatter()),
              ("bytes", "bytes sent (all peers)", lambda: EngFormatter(unit="B")),
              ("t", "wall time (s)", None))


def write_report_figures(report: dict, json_path: Path) -> list[Path]:
    """Writes the loss figure, the sync figure and the markdown summary beside `json_path`."""
    json_path = Path(json_path)
    stem = json_path.with_suffix("")
    loss_png, sync_png, summary_md = (Path(f"{stem}.loss.png"), Path(f"{stem}.sync.png"), Path(f"{stem}.md"))
    _save(_loss_figure({_title(report): report}), loss_png)
    _save(_sync_figure(report), sync_png)
    summary_md.write_text(summary_markdown(report, [loss_png.name, sync_png.name]))
    return [loss_png, sync_png, summary_md]


def compare_reports(reports: dict[str, dict], out_png: Path, title: str | None = None) -> Path:
    """Held-out loss vs tokens, vs bytes and vs wall time, one line per labelled report."""
    figure = _loss_figure(reports)
    if title:
        figure.suptitle(title)
    _save(figure, Path(out_png))
    return Path(out_png)


# ---- figures ----------------------------------------------------------------------------------


def _loss_figure(reports: dict[str, dict]) -> Figure:
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    axes = figure.subplots(1, 3, sharey=True)
    for label, report in reports.items():
        evals = report.get("evals") or []
        final = _final_point(report)
        for ax, (key, _, _) in zip(axes, _LOSS_AXES):
            line, = ax.plot([e[key] for e in evals], [e["loss"] for e in evals], marker=".", label=label)
            if final is not None:
                ax.plot([final[key]], [final["loss"]], marker="*", markersize=12, linestyle="none",
                        color=line.get_color())
    has_data = any(r.get("evals") or _final_point(r) for r in reports.values())
    if _spans_decades([r.get("bytes_sent") or 0 for r in reports.values()]):
        axes[1].set_xscale("log", nonpositive="mask")  # else a low-communication run is squashed against 0
    for ax, (_, xlabel, formatter) in zip(axes, _LOSS_AXES):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if formatter is not None:
            ax.xaxis.set_major_formatter(formatter())
        if not has_data:
            _note(ax, "no held-out evaluations")
    axes[0].set_ylabel("held-out loss")
    axes[0].set_title("vs tokens")
    axes[1].set_title("vs bytes sent" + (" (log scale)" if axes[1].get_xscale() == "log" else ""))
    axes[2].set_title("vs wall time")
    if has_data:
        axes[0].legend(title="★ final (after the last sync)", fontsize="small")
    if len(reports) == 1:
        figure.suptitle(f"Held-out loss: {next(iter(reports))}")
    return figure


def _sync_figure(report: dict) -> Figure:
    rounds = report.get("rounds") or []
    figure = Figure(figsize=(12, 6.5), layout="constrained")
    sync_ax, members_ax = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    xs = [r["round"] for r in rounds]
    marker = "." if len(rounds) <= 100 else None
    syncs = [r["sync_s"] for r in rounds]
    sync_ax.plot(xs, syncs, marker=marker, linewidth=0.8, label="sync (slowest peer)")
    if syncs:
        sync_ax.axhline(statistics.median(syncs), color="gray", linestyle=":",
                        label=f"median {statistics.median(syncs):.3f} s")
    bounds = [(r["round"], r["link_bound_s"]) for r in rounds if r.get("link_bound_s") is not None]
    if bounds:
        sync_ax.plot(*zip(*bounds), linestyle="--", linewidth=0.8, label="link bound (bytes / upload rate)")
    participants = [_count(r.get("participants")) for r in rounds]
    members_ax.step(xs, participants, where="mid", linewidth=4, alpha=0.35, label="participants")
    members_ax.step(xs, [_count(r.get("contributors")) for r in rounds], where="mid", label="contributors")
    for kind, round_ in _churn_marks(report):
        for ax in (sync_ax, members_ax):
            color, style = CHURN_MARKS[kind]
            ax.axvline(round_, color=color, linestyle=style, alpha=0.7, linewidth=1.2)
    sync_ax.set_ylabel("sync time (s)")
    top = max(syncs + [b for _, b in bounds], default=0)
    sync_ax.set_ylim(0, top * 1.25 if top > 0 else None)  # headroom for the legend above the spikes
    members_ax.set_ylabel("peers")
    members_ax.set_xlabel("round")
    members_ax.set_ylim(0, max(participants, default=1) + 0.5)
    members_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    members_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax, where in ((sync_ax, "upper right"), (members_ax, "lower right")):
        ax.grid(alpha=0.3)
        if rounds:
            ax.legend(fontsize="small", loc=where, ncols=3)
        else:
            _note(ax, "no rounds")
    figure.suptitle(f"Per-round sync: {_title(report)}"
                    + (" (churn: kill red, leave orange dashed, join green dotted)" if _churn_marks(report) else ""))
    return figure


def _final_point(report: dict) -> dict | None:
    """The final global model's loss, placed at the run's totals (it is measured after the last sync)."""
    if report.get("final_loss") is None:
        return None
    return {"tokens": report.get("tokens", 0), "bytes": report.get("bytes_sent", 0),
            "t": report.get("wall_s", 0.0), "loss": report["final_loss"]}


def _churn_marks(report: dict) -> list[tuple[str, int]]:
    """(kind, round) of each churn action; an event without a round is placed at the last round begun by its time."""
    rounds = report.get("rounds") or []
    marks = []
    for event in report.get("events") or []:
        if event.get("by") != "churn" or event.get("kind") not in CHURN_MARKS:
            continue
        round_ = event.get("round")
        if round_ is None:
            begun = [r["round"] for r in rounds if r["t"] <= event["t"]]
            round_ = begun[-1] if begun else (rounds[0]["round"] if rounds else 0)
        marks.append((event["kind"], round_))
    return marks


def _spans_decades(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) > 1 and max(positive) > 20 * min(positive)


def _count(members) -> int:
    return len(members) if isinstance(members, (list, tuple, set)) else int(members or 0)


def _note(ax, text: str) -> None:
    """Marks an empty panel; its placeholder ticks (around 0, some negative) would only mislead."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")


def _save(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure).print_png(path)


def _title(report: dict) -> str:
    return f"{report.get('algo', '?')}, {report.get('peers', '?')} peers, seed {report.get('seed', '?')}"


# ---- the markdown summary -----------------------------------------------------------------------


def summary_markdown(report: dict, images: list[str]) -> str:
    """The report's headline figures as markdown; `images` are file names beside the summary."""
    lines = [f"# Simulation report: {_title(report)}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in _headline(report)]
    lines += _events_section(report.get("events") or [])
    links = report.get("links") or {}
    if links:
        lines += ["", "## Links", "", "| peer | link |", "|---|---|"]
        lines += [f"| {peer} | {link or 'unshaped'} |" for peer, link in sorted(links.items())]
    churn = report.get("churn")
    if churn:
        lines += ["", "## Churn", "", f"- spec: `{churn.get('spec')}`"]
        lines += [f"- {key}: {', '.join(churn.get(key) or []) or 'none'}" for key in ("killed", "left", "joined")]
    lines += ["", "## Figures", ""] + [f"![{name}]({quote(name)})" for name in images]
    return "\n".join(lines) + "\n"


def _headline(report: dict) -> list[tuple[str, str]]:
    tokens, sent = report.get("tokens") or 0, report.get("bytes_sent") or 0
    per_token = report.get("bytes_per_token", sent / tokens if tokens else None)
    final = report.get("final_loss")
    spread = report.get("final_loss_spread")
    rows = [("algorithm", str(report.get("algo"))),
            ("peers (stages)", f"{report.get('peers')} ({report.get('stages', 1)})"),
            ("seed", str(report.get("seed"))),
            ("model parameters", f"{report.get('model_params', 0):,}"),
            ("tokens (all peers)", f"{tokens:,}"),
            ("final held-out loss", "n/a" if final is None else
             f"{final:.4f}" + (f" (spread {spread:.4f})" if spread is not None else "")),
            ("bytes sent", f"{_bytes(sent)} ({sent:,} B)"),
            ("bytes per token", "n/a" if per_token is None else f"{per_token:,.1f}")]
    if report.get("control_bytes") is not None:
        rows.append(("control-plane bytes", _bytes(report["control_bytes"])))
    if report.get("wire_bytes") is not None:
        rows.append(("wire bytes (all frames, headers included)", _bytes(report["wire_bytes"])))
    if report.get("checkpoint_bytes"):
        rows.append(("checkpoint bytes (not in bytes sent)", _bytes(report["checkpoint_bytes"])))
    startup = report.get("startup_s")
    rows.append(("wall", f"{report.get('wall_s', 0.0):.1f} s"
                 + (f" (start-up {startup:.1f} s not included)" if startup is not None else "")))
    utilization = report.get("compute_utilization")
    rows.append(("compute utilization", "n/a" if utilization is None else f"{utilization:.2f}"))
    rounds = report.get("rounds") or []
    rows.append(("rounds", str(len(rounds))))
    syncs = [r["sync_s"] for r in rounds]
    if syncs:
        rows.append(("sync per round",
                     f"mean {statistics.fmean(syncs):.3f} s, median {statistics.median(syncs):.3f} s"))
    arrived = [k for r in rounds for k in r.get("arrived_after_steps", [])]
    if arrived:
        rows.append(("overlap: inner steps before the aggregate came",
                     f"mean {statistics.fmean(arrived):.1f}, median {statistics.median(arrived):g}, most {max(arrived)}"
                     f" (over {len(arrived)} peer rounds)"))
    ratios = [r["sync_s"] / r["link_bound_s"] for r in rounds if r.get("link_bound_s")]
    if ratios:
        rows.append(("sync / link bound", f"median {statistics.median(ratios):.2f}"))
    if "failed_peers" in report:
        failed = report["failed_peers"]
        listed = (", ".join(map(str, failed)) or "none") if isinstance(failed, list) else str(failed)
        rows.append(("failed peers", listed))
    if "config_hash" in report:
        rows.append(("config hash", str(report["config_hash"])))
    return rows


def _events_section(events: list[dict]) -> list[str]:
    counts = Counter(e.get("kind") for e in events)
    by_churn = Counter(e.get("kind") for e in events if e.get("by") == "churn")
    lines = ["", "## Events", "", "| kind | events | by churn |", "|---|---|---|"]
    lines += [f"| {kind} | {counts[kind]} | {by_churn[kind]} |" for kind in NOTABLE_EVENTS]
    others = sorted((str(kind), n) for kind, n in counts.items() if kind not in NOTABLE_EVENTS)
    if others:
        lines += ["", "Other events: " + ", ".join(f"{kind} {n}" for kind, n in others)]
    return lines


def _bytes(n: float) -> str:
    return EngFormatter(unit="B", places=2).format_data(n)
