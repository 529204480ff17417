"""PNG plots of a run, rendered to bytes so the caller can write them atomically.

matplotlib's object API (Figure + savefig) needs no pyplot state and no display: it renders with Agg.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def per_depth_alpha_png(alpha: list[float], attempts: list[int], title: str) -> bytes:
    """Bar chart of the conditional acceptance rate per draft depth, each bar labelled with how
    often that depth was reached (alpha's denominator: a high bar on few attempts means little)."""
    figure = Figure(figsize=(6.4, 4.0), layout="constrained")
    axes = figure.add_subplot()
    depths = list(range(1, len(alpha) + 1))
    bars = axes.bar(depths, alpha, color="tab:blue", label="accepted / reached")
    axes.bar_label(bars, labels=[f"n={n}" for n in attempts], fontsize=8, padding=2)
    axes.set_xticks(depths)
    axes.set_ylim(0, 1.25)  # headroom for the bar labels and the legend
    axes.set_xlabel("draft depth d")
    axes.set_ylabel("alpha_d = P(accept depth d | reached d-1)")
    axes.set_title(title)
    axes.legend(loc="upper left")
    if not alpha:
        axes.text(0.5, 0.5, "no drafts proposed", ha="center", va="center", transform=axes.transAxes)
    return _png(figure)


def tau_histogram_png(taus: list[float], overall_tau: float, title: str) -> bytes:
    """Histogram over prompts of tau (tokens emitted per target forward), with the run's tau marked."""
    figure = Figure(figsize=(6.4, 4.0), layout="constrained")
    axes = figure.add_subplot()
    axes.hist(taus, bins=min(max(len(taus), 1), 20), color="tab:green", edgecolor="black", label="prompts")
    axes.axvline(overall_tau, color="tab:red", linestyle="--", label=f"all prompts: tau = {overall_tau:.2f}")
    axes.set_xlabel("tau (tokens per target forward)")
    axes.set_ylabel("number of prompts")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title)
    axes.legend(loc="upper right")
    return _png(figure)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()
