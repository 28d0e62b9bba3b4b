"""The report's picture: training duration per period, and the images that fail most.
matplotlib is an optional extra (``pip install 'tfimage[plot]'``); nothing else of
tfimage needs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tfimage.agent.core.errors import InputError

WIDTH, HEIGHT, DPI = 1200, 900, 100  # pixels of the PNG


def plot(path: Path, trend_rows: list[dict[str, Any]], failing: list[dict[str, Any]]) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a login node
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(
            "--plot needs matplotlib: pip install 'tfimage[plot]' (or python3-matplotlib)"
        ) from None
    if path.suffix.lower() != ".png":
        raise InputError(f"--plot {path}: give a file name ending in .png")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    try:
        periods = [r["period"] for r in trend_rows]
        top.plot(periods, [r["mean_seconds"] / 60 for r in trend_rows], marker="o", label="mean")
        top.plot(
            periods, [r["median_seconds"] / 60 for r in trend_rows], marker=".", label="median"
        )
        top.set_title("Training duration")
        top.set_ylabel("minutes")
        top.legend()
        top.tick_params(axis="x", labelrotation=45)
        names = [f"{r['image']} ({r['failures']}/{r['jobs']})" for r in failing][::-1]
        bottom.barh(names, [100 * r["failure_rate"] for r in failing][::-1])
        bottom.set_title("Images that fail most (failed/jobs)")
        bottom.set_xlabel("failure rate, %")
        fig.tight_layout()
        try:
            fig.savefig(path, dpi=DPI)
        except OSError as e:
            raise InputError(f"--plot {path}: cannot write: {e.strerror}") from None
    finally:
        plt.close(fig)
    return path
