"""Offline circuitsvis views: the bundled script is embedded, nothing points at a CDN."""

from __future__ import annotations

import json
import math
import re

import pytest
from helpers import plant_massive

from massive_lens import MassiveLensError, tiny_model
from massive_lens import viz as views


def _no_network(html: str) -> None:
    assert "unpkg.com" not in html
    assert not re.findall(r"(?:src|href)=['\"]?https?:", html)
    assert "import " not in html.split("CircuitsVis.render")[-1]


def test_attention_view_embeds_bundle_and_props():
    model = tiny_model("gpt2")
    view = views.attention_view(model, "Hello there.", layer=1)
    html = view._repr_html_()
    _no_network(html)
    assert html.count("var CircuitsVis") == 1 and "CircuitsVis.AttentionHeads" in html
    n = len(view.props["tokens"])
    assert len(view.props["attention"]) == model.cfg.n_heads
    assert all(len(row) == n for head in view.props["attention"] for row in head)
    assert all(math.isclose(sum(row), 1.0, abs_tol=1e-4) for row in view.props["attention"][0])


def test_magnitude_view_log_max_and_one_dim():
    model = tiny_model("llama")
    plant_massive(model, layer=0, neuron=1, dim=9, value=400.0, trigger=256, trigger_dim=2)
    view = views.magnitude_view(model, "Hi.", layer=1)
    assert view.props["values"][0] == max(view.props["values"]) > 2  # log10(~400) at BOS
    by_dim = views.magnitude_view(model, "Hi.", layer=1, dim=9)
    assert by_dim.props["values"][0] == pytest.approx(400.0, rel=0.05)
    with pytest.raises(MassiveLensError, match="dim 99 out of range"):
        views.magnitude_view(model, "Hi.", layer=1, dim=99)


def test_page_embeds_bundle_once_and_saves(tmp_path):
    model = tiny_model("llama")
    vs = [views.attention_view(model, "A b.", layer=0), views.magnitude_view(model, "A b.", layer=0)]
    html = views.page(vs, title="two views")
    _no_network(html)
    assert html.count("var CircuitsVis") == 1 and html.count("CircuitsVis.render(") == 2
    path = vs[0].save(tmp_path / "view.html")
    assert path.read_text().count("var CircuitsVis") == 1


def test_props_cannot_close_the_script_element():
    props = {"tokens": ["</script><b>"], "values": [1.0]}
    html = views.View("ColoredTokens", props).html(include_bundle=False)
    assert html.count("</script>") == 1  # only the element's own end tag
    embedded = html.split("CircuitsVis.ColoredTokens, ", 1)[1].rsplit(");</script>", 1)[0]
    assert json.loads(embedded) == props  # escaped, yet the token reaches the view unchanged


def test_capture_rejects_batches():
    from massive_lens.viz import capture_one

    with pytest.raises(MassiveLensError, match="one text"):
        capture_one(tiny_model("llama"), ["a", "b"], 0, "attn.hook_pattern")
