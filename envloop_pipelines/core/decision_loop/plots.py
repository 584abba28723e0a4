"""Small plots for the Dagster UI, as Markdown with an embedded PNG."""

from __future__ import annotations

import base64
import io
from typing import Sequence

import numpy as np


def _png_markdown(fig, title: str) -> str:  # noqa: ANN001 - a matplotlib Figure
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return f"![{title}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})"


def reliability_diagram(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = 15,
                        title: str = "reliability") -> str:
    """Accuracy against confidence in equal-width bins (the ECE's bins), with the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conf = np.asarray(confidences, dtype=float)
    corr = np.asarray(correct, dtype=float)
    edges = np.linspace(0, 1, n_bins + 1)
    idx = np.clip(np.digitize(conf, edges[1:-1], right=True), 0, n_bins - 1)
    centers, accs, counts = [], [], []
    for b in range(n_bins):
        mask = idx == b
        if mask.any():
            centers.append(conf[mask].mean())
            accs.append(corr[mask].mean())
            counts.append(int(mask.sum()))
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.plot([0, 1], [0, 1], "--", color="grey", linewidth=1)
    ax.scatter(centers, accs, s=[10 + 2 * c for c in counts])
    ax.plot(centers, accs)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    return _png_markdown(fig, title)


def metric_by_round(rounds: Sequence[str], series: dict[str, Sequence[float]], title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for name, values in series.items():
        ax.plot(list(rounds), list(values), marker="o", label=name)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _png_markdown(fig, title)
