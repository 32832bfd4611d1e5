"""Every figure renders on tiny models, saves a non-empty PNG (and SVG), and is labelled."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from helpers import plant_massive  # noqa: E402

from massive_lens import (  # noqa: E402
    MassiveLensError,
    find_massive,
    layer_profile,
    scan_corpus,
    tiny_model,
)
from massive_lens import viz as plots  # noqa: E402

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)

TEXT = "The cat sat. The dog ran!\nA bird sang, loudly."


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _saved(fig_or_ax, tmp_path, name="fig"):
    paths = plots.save_figure(fig_or_ax, tmp_path / name)
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert all(p.stat().st_size > 1000 for p in paths)
    return paths


def _labels(ax):
    return ax.get_xlabel(), ax.get_ylabel(), ax.get_title()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_activation_landscape_labels_massive_dims_and_tokens(family, tmp_path):
    model = tiny_model(family)
    if family == "llama":  # a planted massive activation must be labelled
        plant_massive(model, layer=1, neuron=5, dim=7, value=500.0, trigger=256, trigger_dim=3)
    ax = plots.activation_landscape(model, TEXT)
    assert ax.get_xlabel() == "hidden dimension" and ax.get_ylabel() == "token"
    assert "residual units" in ax.get_zlabel() and ax.get_title()
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert any("bos" in t for t in ticks)
    if family == "llama":
        assert "dim 7" in [t.get_text() for t in ax.texts]
    _saved(ax, tmp_path)


def test_landscape_axes_rejects_wrong_shape():
    with pytest.raises(MassiveLensError, match="pos, d_model"):
        plots.landscape_axes([[1.0, 2.0]], ["a", "b"])


def test_landscape_labels_every_massive_token_and_keeps_labels_apart():
    """A massive token off the even grid still gets its (red) tick; no tick crowds another."""
    values = np.ones((97, 16))
    values[[0, 37], 5] = 900.0
    ax = plots.landscape_axes(values, [f"tok{i}" for i in range(97)], label_dims=[5], label_tokens=[0, 37])
    ticks = list(ax.get_yticks())
    assert {0, 37} <= set(ticks) and len(ticks) <= 12
    assert float(np.diff(ticks).min()) >= 5
    red = [t.get_text() for t in ax.get_yticklabels() if t.get_color() == "tab:red"]
    assert red == ["tok0", "tok37"]


def test_overlay_profiles_from_results_and_variant_frames(llama, tmp_path):
    gpt2 = tiny_model("gpt2")
    ax = plots.overlay_profiles({"llama": layer_profile(llama, [TEXT]),
                                 "gpt2": scan_corpus(gpt2, TEXT * 4, seq_len=16, max_tokens=64, progress=False),
                                 "one text": find_massive(llama, TEXT)}, relative_depth=True)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["llama top-1", "llama median"] and "gpt2 top-1" in legend
    assert ax.get_yscale() == "log" and "relative depth" in ax.get_xlabel()
    _saved(ax, tmp_path)
    variants = pd.DataFrame({"variant": ["softmax"] * 2 + ["softmax1"] * 2, "seed": 0, "layer": [0, 1, 0, 1],
                             "max_inf_norm": [5.0, 500.0, 5.0, 6.0], "median": [1.0, 1.0, 1.0, 1.0]})
    ax = plots.overlay_profiles(variants)
    assert "softmax1 top-1" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_attention_maps_outline_sink_columns(tmp_path):
    ax = plots.attention_maps(tiny_model("qwen2"), "Hi there.", layer=1, sinks=[0, 3])
    fig = ax.figure
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert any(a.get_ylabel() == "attention weight" for a in fig.axes)  # the colorbar
    assert titles == ["L1H0", "L1H1", "L1H2", "L1H3"]
    assert len(fig.axes[0].patches) == 2  # one red outline per sink column
    assert fig.get_supxlabel().startswith("key token")
    _saved(fig, tmp_path)


def test_result_plots_render_and_save(llama, tmp_path):
    from massive_lens.attention import decompose_attention, sink_attention
    from massive_lens.origin import trace_origin

    results = {
        "find": find_massive(llama, TEXT),
        "profile": layer_profile(llama, [TEXT, TEXT.upper()]),
        "origin": trace_origin(llama, TEXT, dim=3, pos=0),
        "sinks": sink_attention(llama, TEXT),
        "decomposition": decompose_attention(llama, [TEXT, "Other words here."]),
    }
    n_layers = llama.cfg.n_layers
    for name, result in results.items():
        ax = result.plot()
        xlabel, ylabel, title = _labels(ax)
        assert xlabel.startswith("layer") and ylabel and title.startswith("tiny-llama"), name
        # one point per layer (origin: the embedding, then an attention and an MLP step per layer)
        points = 1 + 2 * n_layers if name == "origin" else n_layers
        assert len(ax.get_lines()[0].get_xdata()) == points, name
        _saved(ax, tmp_path, name)
    lines = {line.get_label(): line for line in results["profile"].plot().get_lines()}
    profile = results["profile"].to_frame()
    assert list(lines) == ["top1", "top2", "top3", "median"]
    assert list(lines["top1"].get_ydata()) == pytest.approx(profile.top1_mean.tolist())


def test_intervention_bars_render(tmp_path):
    frame = pd.DataFrame({"setting": ["original", "zero", "mean"], "ratio": [1.0, 300.0, 1.01],
                          "ratio_low": [1.0, 200.0, 0.99], "ratio_high": [1.0, 400.0, 1.03]})
    ax = plots.intervention_bars(frame, title="interventions")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["original", "zero", "mean"]
    assert "perplexity" in ax.get_ylabel()
    _saved(ax, tmp_path)


def test_save_figure_accepts_axes_arrays(tmp_path):
    import matplotlib.pyplot as plt

    _, axes = plt.subplots(1, 2)
    axes[0].plot([0, 1], [1, 2])
    assert len(_saved(axes, tmp_path)) == 2


def test_intervention_bars_read_as_ratios():
    """Log-scale ratio ticks read x1, x2, ...: never in the 6x10^0 form."""
    frame = pd.DataFrame({"setting": ["original", "mean", "zero"], "ratio": [1.0, 1.05, 6.0],
                          "ratio_low": [1.0, 1.0, 5.0], "ratio_high": [1.0, 1.1, 7.0]})
    ax = plots.intervention_bars(frame)
    ax.figure.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels() if t.get_text()]
    assert labels and all(label.startswith("x") for label in labels), labels
    assert "x6" in labels or "x5" in labels
