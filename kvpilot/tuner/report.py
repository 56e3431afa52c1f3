"""The study report: what was asked (model, workload, SLO, what "value" means), the trials, the
recommendation, and three plots: optimisation history, parameter importances, the TTFT/ITL trade-off.

`.html` is one self-contained page with the plots embedded as PNGs; `.png`, `.pdf` and `.svg` write one
figure with all three panels.  The plots need matplotlib, the `report` extra
(`pip install 'kvpilot[report]'`); without it the HTML page has everything but the plots.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import warnings
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from kvpilot.tuner.core.study import TunerStudy

log = logging.getLogger(__name__)


def _history(ax: Any, st: TunerStudy) -> None:
    xs, ys, best, bx = [], [], [], []
    cur: float | None = None
    maximize = st.goal.direction == "maximize"
    feas = {t.number for t in st.feasible()}
    infeasible_x: list[int] = []
    for t in st.trials():
        if t.state is not TrialState.COMPLETE or t.value is None:
            continue
        if t.number not in feas:
            infeasible_x.append(t.number)
            continue
        xs.append(t.number)
        ys.append(t.value)
        if cur is None or (t.value > cur if maximize else t.value < cur):
            cur = t.value
        best.append(cur)
        bx.append(t.number)
    ax.scatter(xs, ys, s=14, label="trial", color="tab:blue")
    ax.step(bx, best, where="post", color="tab:red", label="best so far")
    if infeasible_x:
        lo = min(ys) if ys else 0.0
        ax.scatter(infeasible_x, [lo] * len(infeasible_x), marker="x", color="grey", label="infeasible")
    ax.set_xlabel("trial")
    ax.set_ylabel("capacity (req/s within SLO)" if maximize else "max(p99 TTFT/SLO, p99 ITL/SLO)")
    ax.set_title("Optimisation history")
    ax.legend(fontsize=7)


def _importances(ax: Any, st: TunerStudy) -> None:
    try:
        import optuna

        # PED-ANOVA ranks what drives LOW target values: flip a maximised objective.
        sign = -1.0 if st.goal.direction == "maximize" else 1.0
        with warnings.catch_warnings():  # it warns about the direction we have just taken care of
            warnings.simplefilter("ignore", UserWarning)
            imp = optuna.importance.get_param_importances(st.study, target=lambda t: sign * (t.value or 0.0))
    except Exception as exc:  # too few trials, or one param constant: say so on the panel
        ax.text(0.5, 0.5, f"importances unavailable:\n{exc}", ha="center", va="center", fontsize=8, wrap=True)
        ax.set_axis_off()
        return
    names = list(imp)[::-1]
    ax.barh(names, [imp[n] for n in names], color="tab:green")
    ax.set_xlabel("importance (PED-ANOVA)")
    ax.set_title("Parameter importances")


def _tradeoff(ax: Any, st: TunerStudy) -> None:
    pts = []
    for t in st.feasible():
        m = st.measurement_of(t)
        if m is None or t.value is None:
            continue
        pts.append((m.ttft_p99, m.itl_p99, t.value, st.engine_of(t).max_num_batched_tokens))
    if not pts:
        ax.text(0.5, 0.5, "no feasible trials", ha="center", va="center")
        ax.set_axis_off()
        return
    sc = ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=[p[2] for p in pts], cmap="viridis", s=22)
    ax.axvline(st.slo.ttft_seconds, color="tab:red", ls="--", lw=1)
    ax.axhline(st.slo.itl_seconds, color="tab:red", ls="--", lw=1)
    ax.set_xlabel("p99 TTFT (s)")
    ax.set_ylabel("p99 ITL (s)")
    ax.set_title("TTFT / ITL trade-off" + (" at capacity" if st.goal.direction == "maximize" else ""))
    ax.figure.colorbar(sc, ax=ax, label="value")


def _png(draw: Any, st: TunerStudy, size: tuple[float, float] = (6.0, 4.0)) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    draw(ax, st)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
SUFFIXES = (".html", *FIGURE_SUFFIXES)
INSTALL_HINT = "pip install 'kvpilot[report]'"


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def check_report_path(path: Path) -> Path:
    """The path, if kvpilot can write a report of its kind; ValueError naming what it can."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{str(path)!r}: the report is written as {', '.join(SUFFIXES)}; "
                         f"got {suffix or 'no suffix'}")
    if suffix in FIGURE_SUFFIXES and not has_matplotlib():
        raise ValueError(f"a {suffix} report is a plot, which needs matplotlib: {INSTALL_HINT} "
                         "(or write .html, which has the tables without it)")
    return path


def write_report(st: TunerStudy, path: Path, title: str, engine_yaml: str, table: str,
                 facts: list[tuple[str, str]] | tuple[()] = ()) -> Path:
    check_report_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in FIGURE_SUFFIXES:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
        for draw, ax in zip((_history, _importances, _tradeoff), axes, strict=True):
            draw(ax, st)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
    if has_matplotlib():
        imgs = [base64.b64encode(_png(d, st)).decode() for d in (_history, _importances, _tradeoff)]
        body = "\n".join(f'<img alt="" src="data:image/png;base64,{b}">' for b in imgs)
    else:
        body = f"<p>Plots need matplotlib: <code>{html.escape(INSTALL_HINT)}</code>.</p>"
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}img{max-width:32%;margin:.3em}"
        "pre{background:#f4f4f4;padding:1em}th{text-align:left;padding-right:1em}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table>{rows}</table>{body}"
        f"<h2>Trials</h2><pre>{html.escape(table)}</pre>"
        f"<h2>Recommended engine</h2><pre>{html.escape(engine_yaml)}</pre></body></html>"
    )
    return path
