"""Which settings of a low-bit grid can run on a model, decided before they run.

A setting may not fit a model: a residual rotation needs pre-norm blocks whose norms are
RMSNorms (not a LayerNorm, not a post-sublayer norm), KV-cache quantization needs separate key
and value projections. :func:`runnable` sorts the settings into those that can run and those
that cannot (with the reason), first from the model's structure (no pass), then, for each
rotation kind, from one pass that checks the rotated model reproduces the model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from massive_lens.core.model_view import ModelView
from massive_lens.errors import MassiveLensError
from massive_lens.quant.settings import Setting
from massive_lens.quant.simulate import Bits
from massive_lens.quant.sites import Site, plain, rotation_sites, structured_sites

NO_ROTATION = "use rotation=None"  # the advice of the rotation checks (quantize's argument)


def sites_for(view: ModelView, include_head: bool, rotation: bool, kv: bool,
              cache: dict[bool, list[Site]]) -> list[Site]:
    """The layers a setting quantizes (cached per ``rotation`` in ``cache``), or an error naming
    why the setting cannot run on this model (a rotation on a post-norm model, a KV cache without
    separate key and value projections)."""
    if rotation not in cache:
        found = rotation_sites(view.model, include_head) if rotation else structured_sites(view.model, include_head)
        cache[rotation] = found if found is not None else plain(view.model, include_head)
    sites = cache[rotation]
    if kv and not any(s.kv for s in sites):
        raise MassiveLensError(f"{view.name}: KV-cache quantization needs a TransformerBridge whose "
                               "blocks have attn.k and attn.v; use kv=16 for this model")
    return sites


def grid_reason(setting: Setting, exc: MassiveLensError) -> str:
    """Why ``setting`` cannot run, in the grid's words: a rotation's error names quantize's
    ``rotation=None``; the grid takes setting names, so it names the setting without its rotation."""
    text = str(exc).removesuffix(f"; {NO_ROTATION}")
    if setting.rotation and text != str(exc):
        text += f"; {without_rotation(setting)}"
    return text


def without_rotation(setting: Setting) -> str:
    """The grid's advice for a rotation that cannot apply: the same setting without it."""
    return f"leave the rotation out ({replace(setting, rotation=None).name!r})"


def runnable(view: ModelView, run: Any, specs: list[tuple[Setting, Bits]], include_head: bool
             ) -> tuple[list[tuple[Setting, Bits]], list[tuple[str, str]]]:
    """The settings that can run and ``(name, why)`` of those that cannot: first what the model's
    structure tells (no pass: ``run`` None), then, with ``run``, whether each rotation kind
    reproduces the model before quantization (one pass on one sequence per kind)."""
    cache: dict[bool, list[Site]] = {}
    ok, skipped = [], []
    for setting, bits in specs:
        try:
            if run is None:
                sites_for(view, include_head, setting.rotation is not None, bits.kv is not None, cache)
            elif setting.rotation:
                run.rotations(setting.rotation, run.sites(True, bits.kv is not None))
        except MassiveLensError as exc:
            skipped.append((setting.name, grid_reason(setting, exc)))
            continue
        ok.append((setting, bits))
    return ok, skipped


def none_runs(view: ModelView, planned: list, skipped: list[tuple[str, str]]) -> None:
    """An error naming every setting and why, when none can run."""
    if not planned:
        raise MassiveLensError(f"{view.name}: none of the settings can run on this model: "
                               + "; ".join(f"{name}: {why}" for name, why in skipped))
