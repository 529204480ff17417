"""How figures and tables read in every report: the console, report.md and the leaderboard."""

from __future__ import annotations


def with_interval(value: float, interval: list[float] | None, unit: str = "", digits: int = 3,
                  missing: str = " (no interval: one unit)") -> str:
    """A figure with its [low, high] interval, as every table shows it."""
    if interval is None:
        return f"{value:.{digits}f}{unit}{missing}"
    return f"{value:.{digits}f}{unit} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
