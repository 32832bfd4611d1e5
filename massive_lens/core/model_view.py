"""One adapter over the kinds of model massive_lens accepts.

A TransformerBridge (TransformerLens 3.x and 4.x), a HookedTransformer (TransformerLens 3.x,
whose few differing hook names :mod:`massive_lens.core.hooked` maps), or a model trained
by ``massive_lens.train`` all speak the TransformerLens hook vocabulary
(``blocks.{l}.hook_resid_post``, ``blocks.{l}.mlp.hook_post``, ...) and expose
TransformerLens-style weights (``blocks[l].mlp.W_out``). This module is the one place that
knows how to describe them (layers, hooks, blocks), tokenize for them and classify tokens
(``bos``, ``first``, ``delimiter``, ``other``), so analyses never special-case a model kind;
running them with temporary hooks is :class:`~massive_lens.core.hook_runner.HookRunner`'s,
which the view inherits.
A vision transformer (ViT, DeiT) reads images instead: :meth:`ModelView.tokenize` turns
``pixel_values`` into a :class:`Batch` and its positions are ``cls``, ``register`` and
``patch`` (:mod:`massive_lens.core.images`), so the same analyses run on images.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from massive_lens.core.hook_runner import HookRunner
from massive_lens.core.hooked import hook_aliases, warn_if_processed
from massive_lens.core.images import ImageLayout, check_not_images, image_batch, image_layout, not_text
from massive_lens.core.model_name import readable_name
from massive_lens.core.tokens import TOKEN_KINDS, Batch, check_token_ids, text_ids, token_kinds
from massive_lens.errors import MassiveLensError

__all__ = ["ModelView"]


class ModelView(HookRunner):
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
