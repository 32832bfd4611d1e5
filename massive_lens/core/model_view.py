"""One adapter over the kinds of model massive_lens accepts.

A TransformerBridge (TransformerLens 3.x and 4.x), a HookedTransformer (TransformerLens 3.x,
whose few differing hook names :mod:`massive_lens.core.hooked` maps), or a model trained
by ``massive_lens.train`` all speak the TransformerLens hook vocabulary
(``blocks.{l}.hook_resid_post``, ``blocks.{l}.mlp.hook_post``, ...) and expose
TransformerLens-style weights (``blocks[l].mlp.W_out``). This module is the one place that
knows how to tokenize for them, run them with temporary hooks, and classify tokens
(``bos``, ``first``, ``delimiter``, ``other``), so analyses never special-case a model kind.
A vision transformer (ViT, DeiT) reads images instead: :meth:`ModelView.tokenize` turns
``pixel_values`` into a :class:`Batch` and its positions are ``cls``, ``register`` and
``patch`` (:mod:`massive_lens.core.images`), so the same analyses run on images.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import PurePath
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from massive_lens.core.hooked import hook_aliases, translate, warn_if_processed
from massive_lens.core.images import ImageLayout, check_not_images, image_batch, image_layout, not_text
from massive_lens.core.tokens import TOKEN_KINDS, Batch, check_token_ids, text_ids, token_kinds
from massive_lens.errors import MassiveLensError

__all__ = ["ModelView", "model_lock", "readable_name"]

_MODEL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> RLock
_MODEL_LOCKS_BY_ID: dict[int, Any] = {}  # models that take no weak reference
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> Any:
    """The one re-entrant lock of ``model``: held while hooks are attached to it and it runs,
    so analyses on one model from several threads run one forward pass at a time and never
    see each other's hooks (the same thread may nest).

    >>> from massive_lens.train.model import MassiveLM, MassiveLMConfig
    >>> m = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))
    >>> model_lock(m) is model_lock(m)
    True
    """
    with _MODEL_LOCKS_GUARD:
        try:
            lock = _MODEL_LOCKS.get(model)
            if lock is None:
                lock = _MODEL_LOCKS[model] = threading.RLock()
        except TypeError:  # not weak-referenceable (or unhashable)
            lock = _MODEL_LOCKS_BY_ID.setdefault(id(model), threading.RLock())
        return lock


class ModelView:
    """Uniform access to a TransformerLens-style model (never holds state of its own).
    ``ModelView(lm)`` on an nnsight model builds a :class:`~massive_lens.core.nnsight_view.NnsightView`."""

    # (test, view class) pairs registered with register_view (massive_lens.models registers the
    # nnsight view); ``ModelView(model)`` builds the first that fits
    variants: list[tuple[Any, type]] = []

    @classmethod
    def register_view(cls, fits: Any, view: type) -> None:
        """Build ``view`` (a subclass) for the models ``fits(model)`` accepts; a view registered
        again replaces its earlier test."""
        cls.variants[:] = [(f, v) for f, v in cls.variants if v is not view] + [(fits, view)]

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> ModelView:
        if cls is ModelView:
            for fits, view in cls.variants:
                if fits(model):
                    return super().__new__(view)
        return super().__new__(cls)

    def __init__(self, model: Any):
        missing = [a for a in ("run_with_hooks", "hooks", "cfg", "hook_dict") if not hasattr(model, a)]
        if missing:
            raise MassiveLensError(
                f"{type(model).__name__} is not a TransformerLens model (missing "
                f"{', '.join(missing)}); load it with massive_lens.load_model(...), which "
                "also wraps Hugging Face models"
            )
        self.model = model
        self.cfg = model.cfg
        self._hook_names: frozenset[str] | None = None
        self._aliases: dict | None = None
        self.image_layout: ImageLayout | None = image_layout(model)  # None: a text model
        warn_if_processed(model, self.name)

    # ------------------------------------------------------------------ facts
    @property
    def name(self) -> str:
        """A name for people: the configured one, a path reduced by :func:`readable_name`."""
        return readable_name(str(getattr(self.cfg, "model_name", None) or type(self.model).__name__))

    @property
    def n_layers(self) -> int:
        return int(self.cfg.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.cfg.d_model)

    @property
    def n_ctx(self) -> int | None:
        return getattr(self.cfg, "n_ctx", None)

    @property
    def tokenizer(self) -> Any:
        self.require_text()
        tok = getattr(self.model, "tokenizer", None)
        if tok is None:
            raise MassiveLensError(
                f"{self.name} has no tokenizer; pass token ids (a LongTensor) instead of text"
            )
        return tok

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def input_device(self) -> torch.device:
        embed = getattr(self.model, "embed", None)
        params = embed.parameters() if embed is not None else self.model.parameters()
        return next(iter(params)).device

    @property
    def hook_names(self) -> frozenset[str]:
        """The model's hook names, read once per view (a bridge rebuilds ``hook_dict`` on
        every access, which cost more than the forward pass in ``trace_origin``)."""
        if self._hook_names is None:
            native = frozenset(self.model.hook_dict)
            self._aliases = hook_aliases(self.model, native)  # a HookedTransformer's names for bridge hooks
            self._hook_names = native | frozenset(self._aliases)
        return self._hook_names

    @staticmethod
    def block_hook(layer: int, hook: str) -> str:
        """The full name of a per-block hook, the one place the naming rule lives:
        ``"resid_post"`` and ``"hook_resid_post"`` give ``blocks.{layer}.hook_resid_post``;
        names under a submodule (``"attn.hook_pattern"``, ``"mlp.hook_post"``, ``"ln1.hook_scale"``)
        are kept as they are. Use :meth:`hook_name` to check the model has it, :meth:`has_hook`
        to ask.

        >>> ModelView.block_hook(3, "resid_pre"), ModelView.block_hook(0, "attn.hook_z")
        ('blocks.3.hook_resid_pre', 'blocks.0.attn.hook_z')
        """
        named = hook.startswith(("hook_", "attn.", "mlp.", "ln"))
        return ModelView.block_param(layer, hook if named else "hook_" + hook)

    @staticmethod
    def block_param(layer: int, name: str) -> str:
        """TransformerLens's full name of a per-block attribute (a parameter such as ``"mlp.W_out"``,
        or a hook :meth:`block_hook` has completed): ``blocks.{layer}.{name}``.

        >>> ModelView.block_param(2, "mlp.W_out")
        'blocks.2.mlp.W_out'
        """
        return f"blocks.{layer}.{name}"

    def has_hook(self, layer: int, hook: str) -> bool:
        """Whether this model has the per-block hook :meth:`block_hook` names (False for a layer
        out of range)."""
        return 0 <= layer < self.n_layers and self.block_hook(layer, hook) in self.hook_names

    def hook_name(self, layer: int, hook: str) -> str:
        """``blocks.{layer}.hook_{hook}`` (see :meth:`block_hook`), checked to exist on this model."""
        if not 0 <= layer < self.n_layers:
            raise MassiveLensError(f"layer {layer} out of range: {self.name} has {self.n_layers}")
        name = self.block_hook(layer, hook)
        if name not in self.hook_names:
            near = sorted(n.split(".", 2)[2] for n in self.hook_names if n.startswith("blocks.0."))
            raise MassiveLensError(f"{self.name} has no hook {name!r}; per-block hooks: {near}")
        return name

    @property
    def blocks(self) -> Any:
        """The model's transformer blocks (``model.blocks``), for analyses that read weights."""
        return self.model.blocks

    def block(self, layer: int) -> Any:
        """Block ``layer``, range-checked (its ``.attn``, ``.mlp`` and norms hold the weights)."""
        if not 0 <= layer < self.n_layers:
            raise MassiveLensError(f"layer {layer} out of range: {self.name} has {self.n_layers}")
        return self.model.blocks[layer]

    def attention_modules(self) -> list[tuple[int, torch.nn.Module]] | None:
        """``(layer, Hugging Face attention module)`` for each attention layer of a view that runs a
        Hugging Face model's own decoder layers (nnsight), for :mod:`massive_lens.core.lse`; None
        here: a TransformerBridge's are found through its attention components there."""
        return None

    def mlp_w_out(self, layer: int) -> Tensor | None:
        """Layer ``layer``'s MLP output weights ``[d_mlp, d_model]`` (TransformerLens's ``W_out``: row
        ``i`` is what neuron ``i`` writes), None where the layer has no per-neuron MLP (no
        ``mlp.hook_post``, or an MLP without ``W_out``, such as a mixture of experts)."""
        if not self.has_hook(layer, "mlp.hook_post"):
            return None
        w = getattr(getattr(self.block(layer), "mlp", None), "W_out", None)
        return w if isinstance(w, Tensor) and w.ndim == 2 else None

    def sandwich_norm(self) -> bool:
        """Whether the blocks norm each attention output before adding it (Gemma 2/3's
        ``ln1_post``)."""
        prefix = self.block_hook(0, "ln1_post.")
        return any(name.startswith(prefix) for name in self.model.hook_dict)

    @property
    def serves_patterns(self) -> bool:
        """Whether this view serves attention patterns and per-head hooks (``attn.hook_pattern``,
        hooks attached to the model; False on nnsight, which edits inside a trace). A recurrent
        model serves them too: it just has none."""
        return True

    def pattern_refusal(self) -> str | None:
        """Why this view cannot serve attention patterns (``attn.hook_pattern``) at all, with what
        to do instead, for an error message; None where it can (:attr:`serves_patterns`)."""
        return None

    def chosen_layers(self, layers: Any, what: str = "layers") -> list[int]:
        """Sorted distinct layers from an int, a sequence of ints or None (all), each checked
        to exist; anything else (a float, a bool, an empty list) is a :class:`MassiveLensError`."""
        items = list(range(self.n_layers)) if layers is None else (
            list(layers) if isinstance(layers, Sequence) and not isinstance(layers, str) else [layers])
        wrong = [x for x in items if isinstance(x, bool) or not isinstance(x, int)]
        if wrong:
            raise MassiveLensError(f"{what} must be an int, a sequence of ints or None (all layers), got {wrong[0]!r}")
        if not items:
            raise MassiveLensError(f"{what} is empty; pass None for all layers")
        for layer in items:
            if not 0 <= layer < self.n_layers:
                raise MassiveLensError(f"layer {layer} out of range: {self.name} has {self.n_layers}")
        return sorted(set(items))

    # ------------------------------------------------------------------ tokens
    def require_text(self) -> None:
        """Error for a vision model: what needs text (a tokenizer, token ids) does not apply."""
        if self.image_layout is not None:
            raise not_text(self.name, getattr(self.cfg, "architecture", None) or type(self.model).__name__)

    def tokenize(self, inputs: str | Sequence[str] | Tensor | Batch, prepend_bos: bool | None = None) -> Batch:
        """Texts, token ids or (for a vision model) ``pixel_values`` to a right-padded batch;
        errors for empty or too long input. A :class:`Batch` is returned as it is."""
        if isinstance(inputs, Batch):
            return inputs
        if self.image_layout is not None:
            return image_batch(inputs, self.image_layout, self.name)
        check_not_images(inputs, self.name)
        if isinstance(inputs, Tensor):
            tokens = inputs[None] if inputs.ndim == 1 else inputs
            if tokens.ndim != 2 or tokens.shape[-1] == 0:
                raise MassiveLensError(f"token ids must be [batch, pos] with pos > 0, got {tuple(inputs.shape)}")
            tokens = self.check_tokens(tokens)
            self.check_length(tokens.shape[-1])
            return self.full_batch(tokens)
        if isinstance(inputs, (bytes, bytearray)):
            raise MassiveLensError("got bytes, not text; decode them first (data.decode('utf-8'))")
        if not isinstance(inputs, Iterable) or isinstance(inputs, Mapping):  # None, a number, a dict: no text
            raise MassiveLensError(f"text must be a string, a list of strings or a token tensor [batch, pos], got "
                                   f"{type(inputs).__name__} {inputs!r:.60}")
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        wrong = next((t for t in texts if not isinstance(t, str)), None)
        if wrong is not None:
            raise MassiveLensError(
                f"texts must be strings, got a {type(wrong).__name__}; pass token ids as a torch tensor "
                "of integers [batch, pos]"
            )
        if not texts or not all(texts):
            raise MassiveLensError("got an empty text (or no texts); pass at least one non-empty string")
        if prepend_bos is not None and not isinstance(prepend_bos, bool):  # "yes", "no", 0 are no answers
            raise MassiveLensError(f"prepend_bos must be True, False or None (the model's default), got "
                                   f"{prepend_bos!r}")
        if prepend_bos is None:
            prepend_bos = bool(getattr(self.cfg, "default_prepend_bos", True))
        tok = self.tokenizer
        has_bos = prepend_bos and tok.bos_token_id is not None
        rows = []
        for text in texts:
            rows.append(([tok.bos_token_id] if has_bos else []) + text_ids(tok, text))
        longest = max(len(r) for r in rows)
        self.check_length(longest)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        tokens = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = True
        return Batch(tokens, mask, has_bos)

    def check_tokens(self, tokens: Any) -> Int[Tensor, "..."]:
        """``tokens`` as a LongTensor, checked by :func:`check_token_ids` against this model's
        vocabulary (a ``MassiveLM``'s sink id counts as valid)."""
        self.require_text()
        vocab = getattr(self.cfg, "d_vocab", None)
        vocab = int(vocab) if isinstance(vocab, int) and vocab > 0 else None
        sink = getattr(self.model, "sink_id", None)
        return check_token_ids(tokens, vocab, self.name, extra=(sink,) if isinstance(sink, int) else ())

    def starts_with_bos(self, tokens: Int[Tensor, "batch pos"]) -> bool:
        """Whether every sequence starts with the tokenizer's BOS id (the one has-BOS check)."""
        tok = getattr(self.model, "tokenizer", None)
        bos = getattr(tok, "bos_token_id", None)
        return bos is not None and tokens.shape[-1] > 0 and bool((tokens[..., 0] == bos).all())

    def full_batch(self, tokens: Int[Tensor, "batch pos"]) -> Batch:
        """Unpadded token ids as a :class:`Batch` (every position real)."""
        return Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), self.starts_with_bos(tokens))

    def check_length(self, length: int) -> None:
        """Error when ``length`` tokens exceed the model's context."""
        self.require_text()
        if self.n_ctx is not None and length > self.n_ctx:
            raise MassiveLensError(
                f"input has {length} tokens but {self.name} has a context of {self.n_ctx}; "
                "shorten the text, or use scan_corpus, which cuts long text into sequences"
            )

    def str_tokens(self, batch: Batch) -> list[list[str]]:
        """Token strings of each sequence (pads dropped); an image's position labels."""
        if batch.pixel_values is not None and self.image_layout is not None:
            return [self.image_layout.labels for _ in range(len(batch.tokens))]
        tok = self.tokenizer
        return [
            [tok.decode([t]) for t in row[: int(n)].tolist()]
            for row, n in zip(batch.tokens, batch.lengths, strict=True)
        ]

    def token_kinds(self, batch: Batch) -> Int[Tensor, "batch pos"]:
        """Index into :data:`~massive_lens.core.tokens.TOKEN_KINDS` for every position (pads get
        ``other``); a model without a tokenizer gets only ``bos``/``first`` and ``other``."""
        if batch.pixel_values is not None and self.image_layout is not None:
            return self.image_layout.kinds().expand_as(batch.tokens).clone()
        try:
            tokenizer = self.tokenizer
        except MassiveLensError:
            kinds = torch.full_like(batch.tokens, TOKEN_KINDS.index("other"))
            kinds[:, 0] = TOKEN_KINDS.index("bos" if batch.has_bos else "first")
            return kinds
        return token_kinds(batch, tokenizer)

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def hooked(self, fwd_hooks: list[tuple[str, Any]]) -> Iterator[None]:
        """Attach hooks for the block; only these hooks are removed afterwards, always.

        The model's :func:`model_lock` is held throughout, so another thread's analysis waits
        instead of running with (or adding) hooks of its own. A hook name the model does not
        have is a :class:`MassiveLensError` (TransformerLens raises a bare ``KeyError``). On a
        ``HookedTransformer`` a bridge hook name is read where it lives there
        (:mod:`massive_lens.core.hooked`). A model in train mode runs in eval mode (no dropout,
        so two identical calls agree) and every module's own mode is put back afterwards.
        """
        missing = [name for name, _ in fwd_hooks if isinstance(name, str) and name not in self.hook_names]
        if missing:
            raise MassiveLensError(f"{self.name} has no hook {missing[0]!r}; see model.hook_dict for the "
                                   "hooks it has")
        with model_lock(self.model), contextlib.ExitStack() as stack:
            inner = getattr(self.model, "original_model", None)  # a bridge keeps its HF model outside modules()
            trees = [self.model, *([inner] if isinstance(inner, torch.nn.Module) else [])]
            training = _training_modules(trees)
            if training:
                stack.callback(lambda: [setattr(m, "training", True) for m in training])
                for m in training:
                    m.training = False
            stack.enter_context(self.model.hooks(fwd_hooks=translate(fwd_hooks, self._aliases or {})))
            yield

    def forward(self, batch: Batch, fwd_hooks: list[tuple[str, Any]], stop_after: str | None = None,
                check_finite: bool = True, must_stop: bool = True) -> Any:
        """One no-grad forward pass with temporary hooks; returns the model's output.

        With ``stop_after`` (a hook name) the pass ends right after that hook fires and
        returns None: analyses that read the residual stream skip the rest (and the
        unembedding, often the costliest matmul of a small model).

        With ``check_finite`` (the default) the activation each hook receives is checked, at
        real (non-pad) positions, for NaN and inf: an overflow is a ``MassiveLensError``
        naming the first hook that saw it, never a quiet NaN in a result. Pass False where a
        non-finite value is itself the answer (the perplexity of an edited model).

        A ``stop_after`` hook that never fires is a ``MassiveLensError``; with ``must_stop=False``
        (a stop chosen only to save time) the pass runs to the end instead.
        """
        if batch.pixel_values is None:
            self.require_text()
        inputs = batch.tokens if batch.pixel_values is None else batch.pixel_values
        kwargs: dict[str, Any] = {}
        all_real = bool(batch.mask.all())
        if not all_real:
            kwargs["attention_mask"] = batch.mask.to(self.input_device).long()
        hooks = list(fwd_hooks)
        seen: list[tuple[str, Tensor]] = []  # (hook name, all finite?) in firing order
        if check_finite:
            mask = None if all_real else batch.mask.to(self.input_device)
            hooks = [(name, _finite_checked(fn, mask, seen)) for name, fn in hooks]
        if stop_after is not None and stop_after.startswith("ln_final."):
            # the final norm can also fire before the blocks (NanoChat normalizes the
            # embeddings with its final norm): stop at the unembedding's input, which fires once, at the end
            stop_after = "unembed.hook_in" if "unembed.hook_in" in self.hook_names else None
        if stop_after is not None:
            hooks.append((stop_after, _stop_forward))
        try:
            out = self.run_hooked(inputs.to(self.input_device), kwargs, hooks)
        except _StopForward:
            out = None
        except MassiveLensError:
            raise
        except Exception as exc:  # a hook that tripped over a NaN: say so, not the symptom
            self._raise_if_nonfinite(seen, exc)
            raise
        self._raise_if_nonfinite(seen)
        if stop_after is not None and out is not None and must_stop:  # ran to the end: the hook never fired
            raise MassiveLensError(f"{self.name}: hook {stop_after!r} exists but never fired in a forward pass "
                                   "(this architecture's bridge does not run it), so nothing can be read there")
        return out

    def run_hooked(self, inputs: Tensor, kwargs: dict[str, Any], hooks: list[tuple[str, Any]]) -> Any:
        """The model on ``inputs`` with ``hooks`` attached (no grad): what :meth:`forward` runs,
        after its checks (a view of another model kind runs it its own way)."""
        with torch.no_grad(), self.hooked(hooks):
            return self.model(inputs, **kwargs)

    def _raise_if_nonfinite(self, seen: list[tuple[str, Tensor]], cause: BaseException | None = None) -> None:
        if not seen:
            return
        ok = torch.stack([flag.to(seen[0][1].device) for _, flag in seen]).cpu()  # one sync per pass
        if bool(ok.all()):
            return
        raise self.overflow_error(seen[int((~ok).nonzero()[0])][0]) from cause

    def overflow_error(self, hook: str) -> MassiveLensError:
        """The error for NaN or inf reached at ``hook``: where, and what to do about it."""
        dtype = self.dtype
        if dtype in (torch.float16, torch.bfloat16):
            fix = ("the model overflowed there; load it with dtype=torch.float32 (or torch.bfloat16, "
                   "which has float32's range)")
        else:
            fix = (f"in {dtype} this is not a rounding issue: check the weights (torch.isfinite) and any "
                   "hooks or edits applied before this point")
        return MassiveLensError(
            f"{self.name} ({dtype}): the activation at {hook} holds NaN or inf, so every result past "
            f"it would be wrong; {fix}"
        )

    def activation(self, batch: Batch, name: str) -> Tensor:
        """The activation at hook ``name`` for ``batch`` (float32, CPU); the pass stops there."""
        seen: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            seen["x"] = x.detach().float().cpu()

        self.forward(batch, [(name, keep)], stop_after=name)
        return seen["x"]

    def check_precision(self, peak: float, where: str) -> None:
        """Warn (with numbers) when a half-precision model carries values near its limits."""
        dtype = self.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return
        info = torch.finfo(dtype)
        if not torch.isfinite(torch.tensor(peak)):
            raise MassiveLensError(
                f"{self.name} in {dtype} overflowed ({where} reached {peak}); load it with "
                "dtype=torch.float32 (or bfloat16, which has float32's range)"
            )
        spacing = info.eps * 2.0 ** math.floor(math.log2(max(peak, 1e-30)))
        if peak > info.max / 4 or spacing >= 1.0:
            warnings.warn(
                f"{self.name} runs in {dtype}: the largest activation ({where}) is {peak:,.1f}; "
                f"at that size {dtype} resolves steps of {float(spacing):g} and overflows at "
                f"{info.max:,.0f}. Values and ratios are approximate; use float32 for exact ones.",
                stacklevel=3,
            )


def readable_name(name: str) -> str:
    """A model's name for people: a hub id stays as it is; a local path (a folder saved with
    ``save_pretrained``, a file, a hub cache snapshot) becomes the name it stands for.

    >>> readable_name("gpt2"), readable_name("Qwen/Qwen2.5-0.5B")
    ('gpt2', 'Qwen/Qwen2.5-0.5B')
    >>> readable_name("/home/me/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/4f2c1e/")
    'Qwen/Qwen2.5-0.5B'
    >>> readable_name("/data/checkpoints/my-model-v2"), readable_name("./runs/model.gguf")
    ('my-model-v2', 'model')
    """
    text = str(name).strip().rstrip("/\\")
    parts = PurePath(text).parts
    hub = [p for p in parts if p.startswith("models--")]  # the hub cache: models--ORG--NAME/snapshots/HASH
    if hub:
        return hub[-1].removeprefix("models--").replace("--", "/")
    is_path = (text.startswith(("/", "~", ".", "\\")) or PurePath(text).is_absolute() or len(parts) > 2
               or os.path.exists(text))
    if not is_path or not parts:
        return text
    stem = PurePath(text).name
    return stem.removesuffix(".gguf") if stem.endswith(".gguf") else stem


def _training_modules(trees: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every module in train mode under ``trees``, each once (a plain walk of ``_modules``: several
    times faster than ``Module.modules()`` on a bridge's thousands of modules)."""
    seen: set[int] = set()
    stack, out = list(trees), []
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        if module.training:
            out.append(module)
        stack.extend(module._modules.values())
    return out


def _finite_checked(fn: Any, mask: Any, seen: list[tuple[str, Tensor]]) -> Any:
    """``fn`` as a hook that first records whether its activation is finite at real positions
    (attention scores may hold -inf by design: there only NaN and +inf count)."""

    padded = mask is not None and not bool(mask.all())

    def hook_fn(x: Any, hook: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point():
            name = str(getattr(hook, "name", "?"))
            part = x
            if padded and x.ndim >= 2 and tuple(x.shape[:2]) == tuple(mask.shape):
                part = x[mask]
            elif padded and x.ndim == 4 and x.shape[0] == mask.shape[0] and x.shape[2] == mask.shape[1]:
                part = x.transpose(1, 2)[mask]  # [batch, head, query, key]: real queries
            if name.endswith("attn_scores"):
                ok = ~(torch.isnan(part).any() | torch.isposinf(part).any())
            else:  # one reduction: a NaN or an inf anywhere makes the float32 sum non-finite
                ok = torch.isfinite(part.sum(dtype=torch.float32))
            seen.append((name, ok))
        return fn(x, hook=hook)

    return hook_fn


class _StopForward(Exception):
    """Raised by the last hook an analysis needs, to end the forward pass early."""


def _stop_forward(activation: Tensor, hook: Any) -> None:
    raise _StopForward
