"""MT-Bench judgments turned into what a person reads: per-model means, pairwise counts, a Markdown table, a plot.

The means and counts follow FastChat's ``show_result.py``: an unparsable rating (-1) is left out of the means and
counted beside them; a pairwise verdict that changes with the order is a tie.

May import: plots, mt_bench.questions, mt_bench.judge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..plots import pyplot
from .judge import UNPARSABLE
from .questions import CATEGORIES


__all__ = ["format_score", "pairwise_summary", "plot_categories", "results_markdown", "single_summary"]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _in_order(categories: Iterable[str]) -> list[str]:
    """MT-Bench's categories in its paper's order, then any others (a user's questions) sorted."""
    present = set(categories)
    return [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))


def single_summary(
    records: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]], judge: str
) -> dict[str, dict[str, Any]]:
    """Per model: mean, turn-1 and turn-2 means and each category's mean over parsable scores (FastChat's
    ``show_result.py`` drops -1), with the count of unparsable judgments beside them and the judge named."""
    category = {q["question_id"]: q["category"] for q in questions}
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    summary = {}
    for model, rows in by_model.items():
        scored = [r for r in rows if r["score"] != UNPARSABLE]
        present = _in_order(category[r["question_id"]] for r in rows)
        summary[model] = {
            "judge": judge,
            "score": _mean([r["score"] for r in scored]),
            "turn_1": _mean([r["score"] for r in scored if r["turn"] == 1]),
            "turn_2": _mean([r["score"] for r in scored if r["turn"] == 2]),
            "categories": {c: _mean([r["score"] for r in scored if category[r["question_id"]] == c]) for c in present},
            "judgments": len(rows),
            "unparsable": len(rows) - len(scored),
            "unparsable_judgments": sorted([r["question_id"], r["turn"]] for r in rows if r["score"] == UNPARSABLE),
        }
    return summary


def pairwise_summary(records: Sequence[dict[str, Any]], judge: str) -> dict[str, Any]:
    """Win/tie/loss of model_1 against model_2, as FastChat's ``show_result.py`` counts them: a judgment with an
    unparsable verdict is dropped (and counted), a tie or an order-dependent verdict is a tie."""
    win = tie = loss = errors = 0
    for r in records:
        if "error" in (r["g1_winner"], r["g2_winner"]):
            errors += 1
        elif r["g1_winner"] == "tie" or r["g1_winner"] != r["g2_winner"]:
            tie += 1
        elif r["g1_winner"] == "model_1":
            win += 1
        else:
            loss += 1
    first = records[0] if records else {}
    return {
        "judge": judge,
        "model_1": first.get("model_1"),
        "model_2": first.get("model_2"),
        "win": win,
        "tie": tie,
        "loss": loss,
        "error": errors,
        "win_rate": win / (win + tie + loss) if win + tie + loss else None,
    }


def format_score(value: float | None) -> str:
    """A mean as the tables print it: two decimals, ``-`` when there is none."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def results_markdown(summary: dict[str, dict[str, Any]], pairwise: Sequence[dict[str, Any]] = ()) -> str:
    """The score table (one row per model, the judge in every row) and the pairwise counts."""
    categories = _in_order(c for s in summary.values() for c in s["categories"])
    head = ["model", "judge", "MT-Bench", "turn 1", "turn 2", *categories, "judgments", "unparsable (-1)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for model, s in summary.items():
        cells = [model, s["judge"], format_score(s["score"]), format_score(s["turn_1"]), format_score(s["turn_2"])]
        cells += [format_score(s["categories"].get(c)) for c in categories]
        cells += [str(s["judgments"]), str(s["unparsable"])]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    if pairwise:
        rows = ["| model_1 | model_2 | judge | win | tie | loss | unparsable |", "|---|---|---|---:|---:|---:|---:|"]
        for p in pairwise:
            rows.append(
                f"| {p['model_1']} | {p['model_2']} | {p['judge']} | {p['win']} | {p['tie']} | {p['loss']} | "
                f"{p['error']} |"
            )
        text += "\n\nPairwise (both orders; an order-dependent verdict is a tie):\n\n" + "\n".join(rows)
    judges = sorted({s["judge"] for s in summary.values()})
    return (
        text + f"\n\nScores are 1-10 from judge {', '.join(judges)}; scores from different judges are not comparable."
    )


def plot_categories(path: str | Path, summary: dict[str, dict[str, Any]]) -> Path:
    """Per-category scores of one or more models side by side (grouped bars), the judge in the title."""
    plt = pyplot()

    categories = _in_order(c for s in summary.values() for c in s["categories"])
    models = list(summary)
    width = 0.8 / max(1, len(models))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(categories) + 2), 4), dpi=120)
    for i, model in enumerate(models):
        values = [summary[model]["categories"].get(c) for c in categories]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(categories))]
        score = summary[model]["score"]
        label = f"{model} ({format_score(score)})"
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=label)
        for x, v in zip(xs, values):
            if v is None:
                ax.text(x, 0.1, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylim(0, 10)
    ax.set_ylabel("score (1-10)")
    judges = ", ".join(sorted({s["judge"] for s in summary.values()}))
    ax.set_title(f"MT-Bench by category (judge: {judges})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
