"""The residual dims to keep out of a steering or abliteration direction.

A refusal or steering direction is a difference of mean activations. A dim that carries a
massive value (thousands, where the rest are near 1) dominates any such difference and any
projection onto it, so abliteration tools (heretic) zero those dims of the direction first.
Their rule is the massive criterion (``|x| > 100`` and ``> 1000x`` the median) holding in at
least a quarter of the layers. :func:`massive_dims` applies the library's
:class:`~massive_lens.Criterion` over a corpus with that persistence rule as an argument. It
counts both scopes of entry. Token-specific massive activations and outlier dimensions both
distort a mean difference, so every row says which scope it has.

The result is written as a small JSON file (:meth:`MassiveDims.to_json`) that another tool
reads with the standard library alone (``json.load``). The schema, version 1:

.. code-block:: text

    {"schema": "massive_lens.massive_dims", "version": 1,
     "model": str, "d_model": int, "n_layers": int, "hook": "resid_post",
     "rule": {"abs_threshold": float, "ratio_threshold": float, "median_over": str,
              "persistence": float},        # the share of layers a dim must be massive in
     "corpus": {"n_seqs": int, "seq_len": int},
     "dims": [int, ...],                    # the dims to keep out, ascending
     "details": [{"dim": int, "layers": [int, ...], "share": float,   # share = len(layers) / n_layers
                  "scope": "token" | "outlier_dim" | "token+outlier_dim",
                  "max_abs": float, "kept_out": bool}, ...]}

>>> import json, tempfile, os
>>> from massive_lens import tiny_model
>>> found = massive_dims(tiny_model("llama"), "Some text to read. " * 20, seq_len=16, n_seqs=2)
>>> path = found.to_json(os.path.join(tempfile.mkdtemp(), "dims.json"))
>>> json.load(open(path))["dims"] == list(found.dims)
True
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from jaxtyping import Float
from torch import Tensor

from massive_lens.core.corpora import Corpus, sequences
from massive_lens.core.criterion import Criterion, as_criterion
from massive_lens.core.fmt import num, pct
from massive_lens.core.model_view import ModelView
from massive_lens.core.render import ensure_axes
from massive_lens.core.results import Result
from massive_lens.core.store import read_json
from massive_lens.detect.find import find_massive
from massive_lens.detect.scope import layer_span
from massive_lens.errors import MassiveLensError

SCHEMA, VERSION = "massive_lens.massive_dims", 1
MAX_BYTES = 64 << 20  # the largest dims file read: one detail per dim of a model is far less
SCOPES = ("token", "outlier_dim", "token+outlier_dim")
REWRITE = "write it again with massive_dims(...).to_json(path)"
HERETIC_PERSISTENCE = 0.25  # heretic's rule: massive in >= 25% of the layers
DIM_COLUMNS = ["dim", "n_layers", "share", "first_layer", "last_layer", "scope", "max_abs", "kept_out"]


@dataclass(frozen=True, kw_only=True)
class MassiveDims(Result):
    """Dims that are massive somewhere in a corpus, and those to keep out of a direction.

    ``by_layer``: one row per (``dim``, ``layer``) where the dim is massive, with ``max_abs``
    and ``scope`` there. ``to_frame()``: one row per dim: ``dim``, ``n_layers``, ``share``
    (of the model's layers), ``first_layer``, ``last_layer``, ``scope``, ``max_abs``,
    ``kept_out`` (``share >= persistence``). ``.dims``: the dims kept out.
    """

    by_layer: pd.DataFrame
    model_name: str
    d_model: int
    n_layers: int
    hook: str
    criterion: Criterion
    persistence: float
    n_seqs: int
    seq_len: int

    @property
    def dims(self) -> tuple[int, ...]:
        """The dims to keep out, ascending."""
        f = self.to_frame()
        return tuple(sorted(int(d) for d in f.loc[f["kept_out"], "dim"]))

    def layers_of(self, dim: int) -> list[int]:
        """The layers where ``dim`` is massive.

        Args:
            dim: a residual dim.

        Returns:
            Sorted layers (empty if the dim is massive nowhere).
        """
        return sorted(int(x) for x in self.by_layer.loc[self.by_layer["dim"] == dim, "layer"].unique())

    def keep_out(self, direction: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """A copy of ``direction`` with the kept-out dims set to zero.

        Args:
            direction: a steering or refusal direction (or a stack of them), ``d_model`` last.

        Returns:
            A new tensor; ``direction`` is left as it was.

        Raises:
            MassiveLensError: if the last axis is not ``d_model`` long.
        """
        if direction.shape[-1] != self.d_model:
            raise MassiveLensError(f"the direction's last axis has {direction.shape[-1]} entries but "
                                   f"{self.model_name} has d_model = {self.d_model}")
        out = direction.clone()
        out[..., list(self.dims)] = 0
        return out

    def to_frame(self) -> pd.DataFrame:
        if self.by_layer.empty:
            return pd.DataFrame(columns=DIM_COLUMNS)
        g = self.by_layer.groupby("dim")
        frame = pd.DataFrame({
            "dim": list(g.groups), "n_layers": g["layer"].nunique().values,
            "first_layer": g["layer"].min().values, "last_layer": g["layer"].max().values,
            "scope": g["scope"].agg(lambda s: "+".join(x for x in ("token", "outlier_dim") if x in set(s))).values,
            "max_abs": g["max_abs"].max().values})
        frame.insert(2, "share", frame["n_layers"] / self.n_layers)
        frame["kept_out"] = frame["share"] >= self.persistence
        return frame[DIM_COLUMNS].sort_values(["kept_out", "max_abs"], ascending=False).reset_index(drop=True)

    def summary(self) -> str:
        f = self.to_frame()
        c = self.criterion
        head = (f"{self.model_name}, {self.n_seqs} x {self.seq_len} tokens, |x| > {c.abs_threshold:g} and > "
                f"{c.ratio_threshold:g}x median in >= {pct(self.persistence)} of {self.n_layers} layers: ")
        if f.empty:
            return head + "no dim is massive anywhere; nothing to keep out"
        kept = f[f["kept_out"]]
        lines = [head + (f"keep out {len(kept)} dim(s) {list(self.dims)}" if len(kept) else "keep out nothing")
                 + f" ({len(f) - len(kept)} more massive in fewer layers)"]
        for r in f.head(8).itertuples():
            lines.append(f"  dim {r.dim} ({r.scope}): massive in {r.n_layers} layers ({pct(r.share)}, "
                         f"{layer_span(self.layers_of(r.dim))}), largest |x| {num(r.max_abs)}"
                         f"{'' if r.kept_out else ', kept in'}")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Per dim, the share of layers where it is massive, with the persistence rule as a line."""
        ax = ensure_axes(ax, (7, 4), layout=None)
        f = self.to_frame()
        ax.bar([str(d) for d in f["dim"]], f["share"], color=["C3" if k else "C0" for k in f["kept_out"]])
        ax.axhline(self.persistence, color="k", linestyle="--", label=f"persistence {self.persistence:g}")
        ax.set(xlabel="dim", ylabel="share of layers massive", ylim=(0, 1.05),
               title=f"{self.model_name}: dims to keep out (red)")
        ax.legend()
        return ax

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the dims as JSON (the schema in the module docstring), readable with ``json.load``.

        Args:
            path: the ``.json`` file to write (replaced if it exists; missing folders are created).

        Returns:
            The path written.

        Raises:
            MassiveLensError: if ``path`` is a folder or lies under a file.
        """
        c = self.criterion
        details = [{"dim": int(r.dim), "layers": self.layers_of(int(r.dim)), "share": float(r.share),
                    "scope": r.scope, "max_abs": float(r.max_abs), "kept_out": bool(r.kept_out)}
                   for r in self.to_frame().itertuples()]
        data = {"schema": SCHEMA, "version": VERSION, "model": self.model_name, "d_model": self.d_model,
                "n_layers": self.n_layers, "hook": self.hook,
                "rule": {"abs_threshold": float(c.abs_threshold), "ratio_threshold": float(c.ratio_threshold),
                         "median_over": c.median_over, "persistence": float(self.persistence)},
                "corpus": {"n_seqs": self.n_seqs, "seq_len": self.seq_len}, "dims": list(self.dims),
                "details": details}
        path = Path(path)
        if path.is_dir():
            raise MassiveLensError(f"{path} is a folder; name a .json file to write")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise MassiveLensError(f"cannot write {path}: a part of {path.parent} is a file, not a folder") from exc
        except OSError as exc:
            raise MassiveLensError(f"cannot write {path}: {exc.strerror or exc}; choose a folder you can "
                                   "write") from None
        try:
            path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        except OSError as exc:  # /proc, a read-only folder, a full disk
            raise MassiveLensError(f"cannot write {path}: {exc.strerror or exc}; choose a folder you can "
                                   "write") from None
        return path


def read_dims(path: str | os.PathLike) -> MassiveDims:
    """A :class:`MassiveDims` back from :meth:`MassiveDims.to_json`'s file, checked.

    Args:
        path: the JSON file (at most :data:`MAX_BYTES`).

    Returns:
        The :class:`MassiveDims` it describes (``by_layer`` holds each dim's largest ``|x|``
        over all its layers, since the file keeps one value per dim).

    Raises:
        MassiveLensError: if the file is missing, not a regular file, too large, not JSON (or
            nested too deeply), not this schema and version, has a field of the wrong type or
            range (a dim outside ``[0, d_model)``, a layer outside ``[0, n_layers)``, a
            ``d_model`` that is not a positive integer, ...), or a ``"dims"`` list other than
            the dims its ``"details"`` keep out (another tool reads ``"dims"``).
    """
    path = Path(path)
    data = read_json(path, max_bytes=MAX_BYTES, what="massive dims JSON", fix=REWRITE)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        raise MassiveLensError(f"{path} is not a {SCHEMA} file of version {VERSION}; write it with "
                               "massive_dims(...).to_json(path)")
    try:
        found = _from_data(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MassiveLensError(f"{path} is a {SCHEMA} file with a missing or malformed field ({exc!r}); "
                               f"{REWRITE}") from exc
    if data.get("dims") != list(found.dims):
        raise MassiveLensError(f"{path}: its \"dims\" {_short(data.get('dims'))} are not the dims its "
                               f"\"details\" keep out {list(found.dims)}; tools that read one or the other would "
                               f"keep out different dims: {REWRITE}")
    return found


def _count(value: Any, name: str, low: int, high: int | float = math.inf) -> int:
    """``value`` when it is an integer in ``[low, high)`` (bool is no integer here)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}), got {_short(value)}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _from_data(data: dict[str, Any]) -> MassiveDims:
    d_model = _count(data["d_model"], "d_model", 1)
    n_layers = _count(data["n_layers"], "n_layers", 1)
    rows = []
    for d in data["details"]:
        dim = _count(d["dim"], "a detail's dim", 0, d_model)
        if d["scope"] not in SCOPES:
            raise ValueError(f"dim {dim}'s scope must be one of {SCOPES}, got {_short(d['scope'])}")
        rows += [(dim, _count(layer, f"dim {dim}'s layers", 0, n_layers), scope, _number(d["max_abs"], "max_abs"))
                 for layer in d["layers"] for scope in d["scope"].split("+")]
    rule, corpus = data["rule"], data["corpus"]
    persistence = _number(rule["persistence"], "rule.persistence")
    if not 0 < persistence <= 1:
        raise ValueError(f"rule.persistence must be in (0, 1], got {persistence}")
    by_layer = pd.DataFrame(rows, columns=["dim", "layer", "scope", "max_abs"])
    if not isinstance(data["model"], str) or not isinstance(data["hook"], str):
        raise TypeError("model and hook must be strings")
    criterion = Criterion(_number(rule["abs_threshold"], "rule.abs_threshold"),
                          _number(rule["ratio_threshold"], "rule.ratio_threshold"), rule["median_over"])
    return MassiveDims(by_layer=by_layer, model_name=data["model"], d_model=d_model, n_layers=n_layers,
                       hook=data["hook"], criterion=criterion,
                       persistence=persistence, n_seqs=_count(corpus["n_seqs"], "corpus.n_seqs", 1),
                       seq_len=_count(corpus["seq_len"], "corpus.seq_len", 1))


def massive_dims(
    model: Any,
    corpus: Corpus = None,
    *,
    persistence: float | int = HERETIC_PERSISTENCE,
    seq_len: int = 128,
    n_seqs: int = 8,
    criterion: Criterion | None = None,
    hook: str = "resid_post",
) -> MassiveDims:
    """The dims to keep out of a steering or abliteration direction (see the module docstring).

    Args:
        model: a TransformerLens-style model.
        corpus: a text file, a string, strings, ``hf:`` name, a ``[seq, pos]`` token tensor,
            or None for the offline default text.
        persistence: the share of the model's layers a dim must be massive in (at any
            position of any sequence) to be kept out; heretic's rule is 0.25 (the default).
        seq_len: tokens per sequence read from a text corpus.
        n_seqs: sequences read from a text corpus.
        criterion: when an activation is massive (None: ``Criterion()``, heretic's 100 and 1000x).
        hook: the residual hook read (default ``resid_post``).

    Returns:
        A :class:`MassiveDims`: ``.dims``, ``.keep_out(direction)``, ``.to_json(path)``.

    Raises:
        MassiveLensError: if ``persistence`` is not a share in (0, 1], or the corpus cannot be read.

    >>> from massive_lens import tiny_model
    >>> massive_dims(tiny_model("llama"), "Some text. " * 30, seq_len=16, n_seqs=2).dims
    ()
    """
    if isinstance(persistence, bool) or not isinstance(persistence, (int, float)) \
            or not math.isfinite(persistence) or not 0 < persistence <= 1:
        raise MassiveLensError(f"persistence is the share of layers a dim must be massive in, in (0, 1]; got "
                               f"{persistence!r} (heretic uses 0.25)")
    view = ModelView(model)
    tokens = sequences(view, corpus, seq_len, n_seqs)
    criterion = as_criterion(criterion)
    entries = find_massive(model, tokens, criterion=criterion, hook=hook).to_frame()
    entries = entries.assign(max_abs=entries["value"].abs())
    by_layer = (entries.groupby(["dim", "layer", "scope"], as_index=False)["max_abs"].max()
                if len(entries) else pd.DataFrame(columns=["dim", "layer", "scope", "max_abs"]))
    by_layer = by_layer.astype({"dim": "int64", "layer": "int64", "max_abs": "float64"})
    return MassiveDims(by_layer=by_layer.reset_index(drop=True), model_name=view.name, d_model=view.d_model,
                       n_layers=view.n_layers, hook=hook, criterion=criterion, persistence=float(persistence),
                       n_seqs=int(tokens.shape[0]), seq_len=int(tokens.shape[1]))

