"""Figures and interactive views.

- drawing from tables (pure, no model): :func:`profile_axes`, :func:`waterfall_axes`,
  :func:`sink_mass_axes`, :func:`sink_content_axes`, :func:`intervention_bars`,
  :func:`landscape_axes`, :func:`overlay_profiles`, :func:`save_figure`;
- figures that run a model on one text: :func:`activation_landscape`, :func:`attention_maps`;
- the patch grid of a vision transformer: :func:`patch_map` (one image), :func:`patch_grid_axes`;
- interactive circuitsvis views, offline: :func:`attention_view`, :func:`magnitude_view`,
  :func:`page`, :class:`View`.

>>> from massive_lens import tiny_model
>>> activation_landscape(tiny_model("llama"), "Hello. World", layer=1).get_xlabel()
'hidden dimension'
"""

from massive_lens.core.charts import (
    curve_axes,
    intervention_bars,
    loss_axes,
    overlay_profiles,
    profile_axes,
    sink_content_axes,
    sink_mass_axes,
    waterfall_axes,
)
from massive_lens.core.render import save_figure
from massive_lens.viz.figures import activation_landscape, attention_maps, capture_one
from massive_lens.viz.landscape import landscape_axes
from massive_lens.viz.patches import patch_grid_axes, patch_map
from massive_lens.viz.views import View, attention_view, magnitude_view, page

__all__ = [
    "View", "activation_landscape", "attention_maps", "attention_view", "capture_one", "curve_axes",
    "intervention_bars", "landscape_axes", "loss_axes", "magnitude_view", "overlay_profiles", "page",
    "patch_grid_axes", "patch_map",
    "profile_axes", "save_figure", "sink_content_axes", "sink_mass_axes", "waterfall_axes",
]
