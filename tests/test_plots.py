"""The Fisher score plot for any finite scores, including all-zero ones."""

import matplotlib
import pytest

from fora_plugin.plots import plot_fisher_scores


matplotlib.use("Agg")


@pytest.mark.parametrize(
    ("scores", "scale"),
    [
        ([0.0, 0.0, 0.0, 0.0], "linear"),
        ([0.0, 2.0, 0.0, 3.0], "linear"),
        ([1e-3, 1.0, 0.0, 5.0], "log"),
        (None, "linear"),
    ],
)
def test_plot_writes_a_png_with_the_right_scale(tmp_path, monkeypatch, scores, scale):
    import matplotlib.pyplot as plt

    seen = {}
    close = plt.close

    def keep_scale(fig):  # read the axis before the figure is closed
        seen["scale"] = fig.axes[0].get_yscale()
        close(fig)

    monkeypatch.setattr(plt, "close", keep_scale)
    path = plot_fisher_scores(tmp_path / "scores.png", scores, [1, 3], 4)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert seen["scale"] == scale
