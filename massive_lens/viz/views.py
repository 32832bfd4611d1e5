"""Interactive views (circuitsvis), rendered offline.

circuitsvis draws attention patterns and coloured tokens with a React bundle. Its default
notebook display first probes the network (``urlopen("http://google.com")``) and, when
online, loads the bundle from a CDN; its string form always points at the CDN. A report
opened on a plane, or a notebook on a cluster without internet, then shows nothing.

The views here never touch the network: they embed the JavaScript bundle that ships
*inside* the circuitsvis package (``circuitsvis/dist/cdn/iife.js``, about 1.3 MB) and call
its ``CircuitsVis.render`` directly. A :class:`View` shows itself in Jupyter and Colab
(``_repr_html_``, bundle included), and :func:`page` puts several views on one HTML page
with the bundle included once (what the report does).

- :func:`attention_view`: every head of one layer (circuitsvis ``AttentionHeads``);
- :func:`magnitude_view`: the tokens of a text coloured by the size of their largest
  residual activation (log10), or by their value in one dimension (``ColoredTokens``).

>>> from massive_lens import tiny_model
>>> view = attention_view(tiny_model("llama"), "Hi there.", layer=0)
>>> "unpkg.com" in view._repr_html_(), "CircuitsVis.render" in view._repr_html_()
(False, True)
"""

from __future__ import annotations

import functools
import html as html_lib
import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import circuitsvis
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.checks import as_int
from massive_lens.errors import MassiveLensError
from massive_lens.viz.figures import capture_one


@functools.cache
def bundle() -> str:
    """The circuitsvis JavaScript bundle shipped in the installed package (read once)."""
    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    if not path.is_file():
        raise MassiveLensError(
            f"circuitsvis {getattr(circuitsvis, '__version__', '?')} has no bundled script at {path}; "
            "reinstall it with `pip install --force-reinstall circuitsvis>=1.43`"
        )
    # A literal "</script>" inside inline code would end the script element early.
    return path.read_text(encoding="utf-8").replace("</script>", "<\\/script>")


def bundle_tag() -> str:
    """``<script>`` element defining the global ``CircuitsVis`` (once per page)."""
    return f"<script>{bundle()}</script>"


@dataclass(frozen=True)
class View:
    """One circuitsvis element (``component``) with its ``props``, and a caption."""

    component: str
    props: dict[str, Any]
    title: str = ""

    def html(self, include_bundle: bool = True) -> str:
        """A ``<div>`` and the script that renders into it (bundle optional).

        Args:
            include_bundle: embed the circuitsvis script too (default; about 1.3 MB). Pass
                False when the page already has it once (see :func:`page`).

        Returns:
            The HTML fragment.
        """
        div = f"cv-{uuid.uuid4().hex[:12]}"
        props = json.dumps(self.props, allow_nan=False).replace("</", "<\\/")
        caption = f"<p class='view-title'>{html_lib.escape(self.title)}</p>" if self.title else ""
        script = f"<script>CircuitsVis.render({json.dumps(div)}, CircuitsVis.{self.component}, {props});</script>"
        return (f"<div class='ml-view'>{caption}<div id='{div}' style='margin: 10px 0;'></div>"
                f"{bundle_tag() if include_bundle else ''}{script}</div>")

    def _repr_html_(self) -> str:
        return self.html(include_bundle=True)

    def save(self, path: str | Path) -> Path:
        """Write a self-contained HTML page with this view.

        Args:
            path: the file to write (overwritten if it exists).

        Returns:
            ``path`` as a ``Path``.
        """
        out = Path(path)
        out.write_text(page([self], title=self.title or self.component), encoding="utf-8")
        return out


def page(views: list[View], title: str = "massive_lens views") -> str:
    """A standalone HTML page with the bundle embedded once and every view rendered.

    Args:
        views: the :class:`View` objects, in page order.
        title: the page title (default ``"massive_lens views"``).

    Returns:
        The HTML document.

    Raises:
        MassiveLensError: if the installed circuitsvis has no bundled script.

    >>> "<script>" in page([View("ColoredTokens", {"tokens": ["a"], "values": [1.0]})])
    True
    """
    body = "\n".join(v.html(include_bundle=False) for v in views)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html_lib.escape(title)}</title>"
            f"</head><body>{bundle_tag()}\n{body}</body></html>")


def attention_view(model: Any, text: str, layer: int, *, heads: list[int] | None = None) -> View:
    """Every head's attention pattern of ``layer`` on ``text`` (click a head to enlarge it).

    Args:
        model: a TransformerLens-style model.
        text: one string.
        layer: the layer whose ``attn.hook_pattern`` is shown.
        heads: the heads to show (None: all).

    Returns:
        A :class:`View` of circuitsvis ``AttentionHeads``.

    Raises:
        MassiveLensError: if ``text`` is empty or too long or ``layer`` is out of range.

    >>> from massive_lens import tiny_model
    >>> view = attention_view(tiny_model("gpt2"), "Hello.", layer=1, heads=[0])
    >>> view.props["attentionHeadNames"] == ["L1H0"]
    True
    """
    pattern, tokens = capture_one(model, text, layer, "attn.hook_pattern")
    chosen = list(range(pattern.shape[0])) if heads is None else \
        [as_int(h, "heads", low=0, high=pattern.shape[0] - 1) for h in heads]
    return View("AttentionHeads", {
        "attention": pattern[chosen].tolist(),
        "tokens": tokens,
        "attentionHeadNames": [f"L{layer}H{h}" for h in chosen],
        "maskUpperTri": True,
    }, title=f"attention of layer {layer} ({len(chosen)} heads): the sink column stands out")


def _magnitudes(resid: Float[Tensor, "pos d_model"], dim: int | None) -> list[float]:
    if dim is not None:
        return resid[:, dim].tolist()
    return [math.log10(max(v, 1e-6)) for v in resid.abs().amax(-1).tolist()]


def magnitude_view(model: Any, text: str, layer: int, *, dim: int | None = None) -> View:
    """Tokens coloured by ``log10`` of their largest ``|residual|`` at ``layer`` (or, with
    ``dim``, by their value in that dimension); hover a token to read the number.

    Args:
        model: a TransformerLens-style model.
        text: one string.
        layer: the layer whose ``resid_post`` is shown.
        dim: a hidden dimension to show the signed value of (None: ``log10`` of each
            token's largest ``|activation|``).

    Returns:
        A :class:`View` of circuitsvis ``ColoredTokens``.

    Raises:
        MassiveLensError: if ``dim`` or ``layer`` is out of range, or ``text`` is empty or
            too long.

    >>> from massive_lens import tiny_model
    >>> view = magnitude_view(tiny_model("llama"), "Hi.", layer=0)
    >>> len(view.props["tokens"]) == len(view.props["values"])
    True
    """
    resid, tokens = capture_one(model, text, layer, "resid_post")
    dim = None if dim is None else as_int(dim, "dim")  # True is no dim 1
    if dim is not None and not 0 <= dim < resid.shape[-1]:
        raise MassiveLensError(f"dim {dim} out of range: d_model is {resid.shape[-1]}")
    values = _magnitudes(resid, dim)
    what = f"value in dim {dim}" if dim is not None else "log10 max |activation|"
    return View("ColoredTokens", {"tokens": tokens, "values": values,
                                  "minValue": min(0.0, min(values)), "maxValue": max(values)},
                title=f"tokens coloured by {what} after layer {layer}")
