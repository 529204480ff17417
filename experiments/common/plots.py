"""PNG plots of a run, rendered to bytes so the caller can write them atomically.

matplotlib's object API (Figure + savefig) needs no pyplot state and no display: it renders with Agg.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.patheffects import withStroke
from matplotlib.ticker import MaxNLocator, PercentFormatter


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



# -- specdec-analyze: one figure compares every analysed run (one series per run label) ------------


def lines_png(
    series: dict[str, tuple[list[float], list[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    integer_x: bool = False,
) -> bytes:
    """One line with markers per series (label -> (x, y))."""
    figure = Figure(figsize=(7.2, 4.4), layout="constrained")
    axes = figure.add_subplot()
    for label, (x, y) in series.items():
        axes.plot(x, y, marker="o", label=label)
    _decorate(axes, title, xlabel, ylabel, has_data=any(x for x, _ in series.values()))
    if ylim is not None:
        axes.set_ylim(*ylim)
    if integer_x:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(figure)


def scatter_png(series: dict[str, tuple[list[float], list[float]]], title: str, xlabel: str, ylabel: str) -> bytes:
    """Points per series (label -> (x, y)), no lines: for per-prompt values."""
    figure = Figure(figsize=(7.2, 4.4), layout="constrained")
    axes = figure.add_subplot()
    for label, (x, y) in series.items():
        axes.scatter(x, y, alpha=0.7, label=label)
    _decorate(axes, title, xlabel, ylabel, has_data=any(x for x, _ in series.values()))
    return _png(figure)


# each series gets its own (colour, marker) pair: 10 colours against 7 markers repeat only after 70
# series, where matplotlib's default cycle repeats colours after 10
_COLOURS = [f"tab:{name}" for name in ("blue", "orange", "green", "red", "purple", "brown", "pink", "gray", "olive", "cyan")]
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def series_style(index: int) -> dict[str, str]:
    return {"color": _COLOURS[index % len(_COLOURS)], "marker": _MARKERS[index % len(_MARKERS)]}


Point = tuple[float, list[float] | None, float, list[float] | None]  # x, its [low, high], y, its [low, high]


def _error(values: list[float], intervals: list[list[float] | None]) -> list[list[float]]:
    """matplotlib's asymmetric error bars [[below...], [above...]]; 0 where there is no interval."""
    return [[v - i[0] if i else 0.0 for v, i in zip(values, intervals)],
            [i[1] - v if i else 0.0 for v, i in zip(values, intervals)]]


def interval_scatter_png(series: dict[str, list[Point]], title: str, xlabel: str, ylabel: str,
                         reference_y: tuple[float, str] | None = None) -> bytes:
    """Points with their intervals as error bars on both axes, a distinct colour and marker per
    series (label -> points)."""
    figure = Figure(figsize=(7.6, 4.8), layout="constrained")
    axes = figure.add_subplot()
    for index, (label, points) in enumerate(series.items()):
        x, x_int, y, y_int = (list(column) for column in zip(*points))
        style = series_style(index)
        axes.errorbar(x, y, xerr=_error(x, x_int), yerr=_error(y, y_int), linestyle="none", capsize=2,
                      elinewidth=0.8, markersize=6, label=label, color=style["color"], marker=style["marker"])
    if reference_y is not None:
        axes.axhline(reference_y[0], color="black", linestyle=":", label=reference_y[1])
    _decorate(axes, title, xlabel, ylabel, has_data=any(series.values()))
    return _png(figure)


def grouped_bars_png(
    groups: list[str],
    series: dict[str, list[float]],
    title: str,
    xlabel: str,
    ylabel: str,
    reference: tuple[float, str] | None = None,
    intervals: dict[str, list[list[float] | None]] | None = None,
) -> bytes:
    """Bars per group on the x axis, one colour per series (label -> one value per group; past 10
    series the colours repeat with hatching); optional error bars (label -> one [low, high] or None
    per group) and a horizontal reference line (value, its legend label), e.g. break-even speedup 1."""
    figure = Figure(figsize=(max(6.4, 1.0 + 0.6 * len(groups) * max(len(series), 1)), 4.6), layout="constrained")
    axes = figure.add_subplot()
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        positions = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        error = _error(values, intervals[label]) if intervals and label in intervals else None
        bars = axes.bar(positions, values, width=width, label=label, color=_COLOURS[k % len(_COLOURS)],
                        hatch=("", "//", "..", "xx")[k // len(_COLOURS) % 4], yerr=error, capsize=2 if error else 0,
                        error_kw={"elinewidth": 0.8})
        axes.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7, padding=1)
    if reference is not None:
        axes.axhline(reference[0], color="black", linestyle=":", label=reference[1])
    crowded = len(groups) > 3  # slant long labels so neighbours do not overlap
    axes.set_xticks(range(len(groups)), groups, rotation=20 if crowded else 0, ha="right" if crowded else "center")
    axes.margins(y=0.15)  # room for the value labels
    _decorate(axes, title, xlabel, ylabel, has_data=bool(groups))
    return _png(figure)


def stacked_shares_png(labels: list[str], parts: dict[str, list[float]], title: str, xlabel: str) -> bytes:
    """One horizontal bar per label split into parts (part name -> share per label, summing to 1),
    each segment of 5% or more labelled with its percentage."""
    figure = Figure(figsize=(7.6, 1.6 + 0.5 * len(labels)), layout="constrained")
    axes = figure.add_subplot()
    left = [0.0] * len(labels)
    for name, shares in parts.items():
        bars = axes.barh(labels, shares, left=left, label=name)
        axes.bar_label(bars, labels=[f"{s:.0%}" if s >= 0.05 else "" for s in shares], label_type="center", fontsize=8)
        left = [a + b for a, b in zip(left, shares)]
    axes.set_xlim(0, 1)
    axes.xaxis.set_major_formatter(PercentFormatter(1.0))
    axes.invert_yaxis()  # first run on top, as in the report's tables
    axes.set_xlabel(xlabel)
    axes.set_title(title)
    figure.legend(loc="outside lower center", ncol=len(parts))  # below the axis label, never over a bar
    return _png(figure)


def heatmap_png(
    rows: list[str], columns: list[str], values: list[list[float | None]], title: str, colorbar_label: str
) -> bytes:
    """Annotated grid of values (rows x columns); None cells stay blank."""
    figure = Figure(figsize=(max(6.0, 2.5 + 1.0 * len(columns)), 1.8 + 0.5 * len(rows)), layout="constrained")
    axes = figure.add_subplot()
    grid = [[float("nan") if v is None else v for v in row] for row in values]
    image = axes.imshow(grid, cmap="viridis", aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            if value is not None:
                axes.text(j, i, f"{value:.2f}", ha="center", va="center", color="white", fontsize=9,
                          path_effects=[withStroke(linewidth=2, foreground="black")])
    axes.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    axes.set_yticks(range(len(rows)), rows)
    axes.set_title(title)
    figure.colorbar(image, ax=axes, label=colorbar_label)
    return _png(figure)


def sweep_png(
    series: dict[str, tuple[list[float], list[float], list[float], list[float]]], title: str, xlabel: str
) -> bytes:
    """Two panels over one swept parameter: tau, and measured (solid) vs predicted (dashed)
    speedup. series: label -> (x, tau, measured speedup, predicted speedup)."""
    figure = Figure(figsize=(11.0, 4.4), layout="constrained")
    tau_axes, speed_axes = figure.subplots(1, 2)
    for label, (x, tau, measured, predicted) in series.items():
        (line,) = tau_axes.plot(x, tau, marker="o", label=label)
        speed_axes.plot(x, measured, marker="o", color=line.get_color(), label=f"{label}: measured")
        speed_axes.plot(x, predicted, marker="x", linestyle="--", color=line.get_color(), label=f"{label}: predicted")
    speed_axes.axhline(1.0, color="black", linestyle=":", label="break-even (plain decoding)")
    _decorate(tau_axes, "tau", xlabel, "tau (tokens per target forward)", has_data=bool(series))
    _decorate(speed_axes, "speedup over plain decoding", xlabel, "speedup (x)", has_data=bool(series))
    figure.suptitle(title)
    return _png(figure)


def _decorate(axes, title: str, xlabel: str, ylabel: str, has_data: bool) -> None:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if has_data:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)

def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()
