"""Pictures a person looks at instead of reading numbers: Fisher scores over depth.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


__all__ = ["plot_fisher_scores", "pyplot"]


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend: files only, as no training machine has a display. Imported at the
    first picture, so that matplotlib is needed only by the commands that draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fisher_scores(
    path: str | Path,
    scores: Sequence[float] | None,
    chosen: Sequence[int],
    num_layers: int,
    *,
    title: str = "",
) -> Path:
    """A bar chart of per-layer Fisher scores with the chosen layers highlighted, saved as a PNG."""
    plt = pyplot()

    chosen_set = set(chosen)
    heights = list(scores) if scores is not None else [1.0] * num_layers
    colors = ["#d62728" if i in chosen_set else "#9e9e9e" for i in range(num_layers)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * num_layers + 2), 3.6), dpi=120)
    ax.bar(range(num_layers), heights, color=colors)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("Fisher score  (mean Σ‖∇θ‖²)" if scores is not None else "(no scores: layers given or controls)")
    ax.set_xticks(range(num_layers))
    ax.tick_params(axis="x", labelsize=7)
    positive = [h for h in heights if h > 0]
    # A log axis only when the scores span decades (and there is something positive to put on it).
    if scores is not None and positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    ax.set_title(title or f"FoRA layer selection: {len(chosen_set)} of {num_layers} layers (red = adapted)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
