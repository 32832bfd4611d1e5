"""Mixture-of-experts MLPs for :func:`massive_lens.trace_origin`: neurons are (expert, neuron).

transformers 5 stores the routed experts of a block as one module (``use_experts_implementation``:
``gate_up_proj`` or ``up_proj``, ``down_proj`` as ``[expert, ...]`` tensors, ``act_fn`` and
``_apply_gate``), called as ``experts(x, top_k_index, top_k_weights)``. Its output at a token
is ``sum_e w_e (a_e @ down_e + b_e)`` over the experts ``e`` the router chose, with weights
``w_e``, so expert ``e``'s neuron ``n`` adds ``w_e * a_e[n] * down_e[n, dim]`` to ``dim``. The
pass records the experts module's inputs (the routing as used, not recomputed) and output; the
neuron activations ``a_e`` are recomputed from the expert's own weights and gate. A shared
expert (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``) is a dense MLP whose
output the block adds, possibly scaled by a gate (``route``): its neuron activations are the
input of its ``down_proj``, recorded by a hook.

The units are exact only if they add up: the routed terms must give the experts module's
output, and routed + shared the MLP's term; :func:`unit_terms` returns None otherwise and the
trace says so.

Super weights are named as the checkpoints name them: ``...experts.{e}.down_proj.weight[dim,
n]`` (``...experts.down_proj[{e}]`` with ``[n, dim]`` where the checkpoint stores the experts
fused and transposed, as GPT-OSS does).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from massive_lens.core.stats import rel_error

SHARED = -1  # the ``expert`` of a shared expert's neurons (and of a dense MLP's)
CHECK_TOL = 1e-3  # relative, for every sum trace_origin checks: routed terms vs the experts module's output,
# neuron terms vs the MLP's term, sources vs the MLP's input (origin.neurons)


@dataclass(frozen=True)
class Experts:
    """A block's experts, as transformers stores them: the routed experts module, its
    parameter path, and the shared expert's ``down_proj`` (None: no shared expert)."""

    module: Any
    path: str
    shared_down: Any = None
    shared_path: str = ""

    @property
    def n_experts(self) -> int:
        return int(self.module.down_proj.shape[0])

    @property
    def width(self) -> int:
        """Neurons per routed expert."""
        down = self.module.down_proj
        return int(down.shape[1] if self.module.is_transposed else down.shape[2])

    def down(self, expert: int) -> Tensor:
        """``[neuron, d_model]`` of one routed expert (float32, CPU)."""
        w = self.module.down_proj[expert].detach().float().cpu()
        return w if self.module.is_transposed else w.T

    def up(self, expert: int) -> tuple[Tensor, Tensor | None]:
        """``gate_up_proj`` (or ``up_proj``) of one expert as ``[d_model, out]`` and its bias."""
        m = self.module
        name = "gate_up_proj" if m.has_gate else "up_proj"
        w = getattr(m, name)[expert].detach().float().cpu()
        bias = getattr(m, name + "_bias")[expert].detach().float().cpu() if m.has_bias else None
        return (w if m.is_transposed else w.T), bias

    def activations(self, x: Tensor, expert: int) -> tuple[Tensor, Tensor]:
        """Pre-activations ``[out]`` (gate then up, or up) and neuron activations ``[width]``
        of one expert at input ``x [d_model]``."""
        w, bias = self.up(expert)
        pre = x @ w + (bias if bias is not None else 0.0)
        m = self.module
        act = m._apply_gate(pre[None])[0] if m.has_gate else m.act_fn(pre)
        return pre, act

    def down_bias(self, expert: int) -> Tensor | None:
        m = self.module
        return m.down_proj_bias[expert].detach().float().cpu() if m.has_bias else None

    def super_name(self, expert: int, neuron: int, dim: int) -> tuple[str, int, int]:
        """Checkpoint name and ``[row, col]`` of routed expert ``expert``'s down weight."""
        if self.module.is_transposed:
            return f"{self.path}.down_proj[{expert}]", neuron, dim
        return f"{self.path}.{expert}.down_proj.weight", dim, neuron

    @cached_property
    def columns(self) -> Tensor | None:
        """``[width, 2]``: the gate and up columns of ``gate_up_proj`` behind each neuron, found
        by probing the expert's own gate (transformers' default splits in halves, GPT-OSS
        interleaves); ``[width, 1]`` without a gate; None when the gate does not pair them."""
        width = self.width
        if not self.module.has_gate:
            return torch.arange(width)[:, None]
        base = torch.full((1, 2 * width), 0.5)
        found = torch.full((width, 2), -1)
        with torch.no_grad():
            ref = self.module._apply_gate(base)
            for start in range(0, 2 * width, 256):  # probe column j: which neuron moves (chunked)
                cols = torch.arange(start, min(start + 256, 2 * width))
                probes = base.repeat(len(cols), 1)
                probes[torch.arange(len(cols)), cols] += 0.25
                moved = (self.module._apply_gate(probes) - ref).abs() > 0  # [cols, width]
                if bool((moved.sum(1) != 1).any()):
                    return None
                for j, n in zip(cols.tolist(), moved.float().argmax(1).tolist(), strict=True):
                    slot = 0 if found[n, 0] < 0 else 1
                    if found[n, slot] >= 0:
                        return None
                    found[n, slot] = j
        return None if bool((found < 0).any()) else found


def _inner(module: Any) -> Any:
    return getattr(module, "_original_component", module)


def find_experts(model: Any, mlp: Any) -> Experts | None:
    """The transformers experts module (and shared expert) inside an MLP bridge, or None."""
    root = _inner(mlp)
    routed = [m for m in root.modules() if hasattr(m, "has_gate") and isinstance(getattr(m, "down_proj", None),
                                                                                 torch.nn.Parameter)
              and m.down_proj.ndim == 3 and not hasattr(m, "original_component")]
    if len(routed) != 1:
        return None
    module = routed[0]
    names = {p.data_ptr(): n.replace("._original_component", "") for n, p in model.original_model.named_parameters()}
    path = names.get(module.down_proj.data_ptr(), "experts.down_proj").rsplit(".down_proj", 1)[0]
    shared_down, shared_path = None, ""
    for name, child in root.named_modules():
        parts = name.replace("._original_component", "").split(".")
        if len(parts) >= 2 and parts[-1] == "down_proj" and parts[-2].startswith("shared_expert"):
            linear = _inner(child)
            if isinstance(linear, torch.nn.Linear):
                shared_down = linear
                shared_path = names.get(linear.weight.data_ptr(), name).removesuffix(".weight")
    return Experts(module, path, shared_down, shared_path)


def record(experts: Experts, rows: Tensor, n_batch: int, seq: int, store: dict[str, Tensor]) -> list[Any]:
    """PyTorch hooks that keep, at the traced ``rows`` of the first sequence, the experts
    module's input, routing and output, and the shared expert's neuron activations and output
    (``store`` keys ``x``, ``index``, ``weights``, ``out``, ``shared_act``, ``shared_out``).
    Returns the handles (the caller removes them)."""

    def at(t: Tensor) -> Tensor:
        t = t.reshape(n_batch, seq, -1) if t.shape[0] == n_batch * seq else t
        return t[0, rows.to(t.device)].detach().float().cpu()

    def before(module: Any, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        floats = [t for t in tensors if t.is_floating_point()]
        index = [t for t in tensors if not t.is_floating_point()]
        if len(floats) == 2 and len(index) == 1:
            store.update(x=at(floats[0]), weights=at(floats[1]), index=at(index[0]).long())

    def after(module: Any, args: Any, out: Any) -> None:
        store["out"] = at(out[0] if isinstance(out, tuple) else out)

    handles = [experts.module.register_forward_pre_hook(before, with_kwargs=True),
               experts.module.register_forward_hook(after)]
    if experts.shared_down is not None:
        def shared(module: Any, args: Any, out: Tensor) -> None:
            store.update(shared_act=at(args[0]), shared_out=at(out))

        handles.append(experts.shared_down.register_forward_hook(shared))
    return handles


@dataclass
class UnitTerms:
    """Every (expert, neuron) of one MoE block at one position and dim: ``contribution``
    (router-weighted), ``post`` (activation), ``pre``/``up`` (pre-activations; NaN where not
    split), ``w_out`` (down weight), ``route`` (router weight; the shared expert's gate), and
    ``bias`` (the down biases' weighted sum at ``dim``)."""

    expert: Tensor
    neuron: Tensor
    contribution: Tensor
    post: Tensor
    pre: Tensor
    up: Tensor
    w_out: Tensor
    route: Tensor
    bias: float


def unit_terms(experts: Experts, data: dict[str, Tensor], i: int, dim: int, mlp_out: Tensor) -> UnitTerms | None:
    """The units at position index ``i`` and ``dim``, or None when they do not reconstruct the
    experts module's output and the MLP's output ``mlp_out [d_model]`` (before any post-norm)."""
    if not {"x", "index", "weights", "out"} <= set(data):
        return None
    x, index, weights = data["x"][i], data["index"][i], data["weights"][i]
    if weights.shape != index.shape:  # router weights over all experts: those chosen
        weights = weights[index]
    parts: dict[str, list[Tensor]] = {k: [] for k in ("expert", "neuron", "c", "post", "pre", "up", "w", "route")}
    routed, bias = torch.zeros_like(mlp_out), 0.0
    width = experts.width
    for e, w in zip(index.tolist(), weights.tolist(), strict=True):
        if not 0 <= e < experts.n_experts:
            continue
        pre, act = experts.activations(x, e)
        down = experts.down(e)
        routed += w * (act @ down)
        b = experts.down_bias(e)
        if b is not None:
            routed += w * b
            bias += w * float(b[dim])
        gate, up = _split(experts, pre, width)
        _add(parts, e, act, gate, up, down[:, dim], w)
    if rel_error(routed, data["out"][i]) > CHECK_TOL:
        return None
    if experts.shared_down is not None and "shared_act" in data:
        shared_out, act = data["shared_out"][i], data["shared_act"][i]
        factor = _shared_factor(mlp_out - routed, shared_out, mlp_out)
        if factor is None:
            return None
        down = experts.shared_down.weight.detach().float().cpu().T  # [neuron, d_model]
        b = experts.shared_down.bias
        bias += factor * float(b[dim]) if b is not None else 0.0
        nan = torch.full_like(act, float("nan"))
        _add(parts, SHARED, act, nan, nan, down[:, dim], factor)
    elif rel_error(routed, mlp_out) > CHECK_TOL:
        return None
    cat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}
    return UnitTerms(cat["expert"].long(), cat["neuron"].long(), cat["c"], cat["post"], cat["pre"], cat["up"],
                     cat["w"], cat["route"], bias)


def _shared_factor(rest: Tensor, shared_out: Tensor, mlp_out: Tensor) -> float | None:
    """The shared expert's gate: ``rest = factor * shared_out``, fitted on the dims where the
    MLP's output is not massive (there ``mlp_out - routed`` loses the shared part to float
    rounding) and checked on every dim; None when it does not hold."""
    size = mlp_out.abs()
    calm = size <= 100 * size.median().clamp(min=1e-12)
    if int(calm.sum()) < 2:
        calm = torch.ones_like(calm)
    a, r = shared_out[calm].double(), rest[calm].double()
    factor = float(a @ r / (a @ a).clamp(min=1e-30))
    fits = rel_error(factor * shared_out[calm], rest[calm]) <= CHECK_TOL
    return factor if fits and float((factor * shared_out - rest).abs().max()) <= CHECK_TOL * float(size.max()) else None


def _split(experts: Experts, pre: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(gate, up) pre-activations per neuron (just the pre-activation without a gate; NaN where
    the gate's columns cannot be paired)."""
    cols = experts.columns
    if cols is None:
        nan = torch.full((width,), float("nan"))
        return nan, nan
    if cols.shape[1] == 1:
        return pre, torch.full_like(pre, float("nan"))
    return pre[cols[:, 0]], pre[cols[:, 1]]


def _add(parts: dict[str, list[Tensor]], expert: int, act: Tensor, gate: Tensor, up: Tensor, w: Tensor,
         route: float) -> None:
    n = len(act)
    parts["expert"].append(torch.full((n,), expert))
    parts["neuron"].append(torch.arange(n))
    parts["c"].append(route * act * w)
    parts["post"].append(act)
    parts["pre"].append(gate)
    parts["up"].append(up)
    parts["w"].append(w)
    parts["route"].append(torch.full((n,), route))


def input_columns(experts: Experts, units: list[tuple[int, int]]) -> list[tuple[str, Tensor, Tensor]] | None:
    """For "why this token": per pre-activation kind, ``[d_model, n]`` columns and ``[n]``
    biases of the routed units (None: the gate's columns cannot be paired, or a shared
    expert's unit is asked for)."""
    pairs = experts.columns
    if pairs is None or any(e == SHARED for e, _ in units):
        return None
    kinds = ["gate", "up"] if pairs.shape[1] == 2 else ["pre"]
    out = []
    for k, label in enumerate(kinds):
        cols, biases = [], []
        for e, n in units:
            w, bias = experts.up(e)
            j = int(pairs[n, k])
            cols.append(w[:, j])
            biases.append(bias[j] if bias is not None else torch.zeros(()))
        out.append((label, torch.stack(cols, 1), torch.stack(biases)))
    return out
