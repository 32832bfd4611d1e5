"""MassiveLM: a small, readable decoder-only transformer with TransformerLens hook names.

The whole model fits in this file and :mod:`massive_lens.train.layers` (its config and
layers), nanoGPT style, so you can see every place a massive
activation could be born: the embedding, each attention layer (whose softmax variant is
pluggable, see :mod:`massive_lens.train.variants`), and each MLP. It is built on
TransformerLens's ``HookedRootModule``/``HookPoint``, so ``run_with_cache`` and
``run_with_hooks`` work and every massive_lens analysis runs on it unchanged.

Two styles: ``"llama"`` (default; RMSNorm pre-norm, rotary positions, SwiGLU MLP, no
biases) and ``"gpt2"`` (LayerNorm, learned positions, GELU MLP, biases). Weights are
stored in TransformerLens's layouts (``attn.W_Q`` is ``[n_heads, d_model, d_head]``,
``mlp.W_out`` is ``[d_mlp, d_model]``), so weight edits such as zeroing a super weight
work as they do on a TransformerLens model.

>>> model = MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2, n_ctx=16))
>>> logits, cache = model.run_with_cache("Hello. World")
>>> tuple(cache["blocks.1.attn.hook_pattern"].shape), tuple(logits.shape)
((1, 2, 13, 13), (1, 13, 259))
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import HookedRootModule

from massive_lens.core.tokens import byte_tokenizer
from massive_lens.errors import MassiveLensError
from massive_lens.train.layers import Block, MassiveLMConfig, Norm, hook_point

SINK_TOKEN = "<|sink|>"


class MassiveLM(HookedRootModule):
    """A decoder-only LM with TransformerLens hook names and a pluggable attention variant.

    ``tokenizer`` defaults to massive_lens's offline byte-level tokenizer.
    """

    def __init__(self, cfg: MassiveLMConfig | None = None, tokenizer: Any = None):
        super().__init__()
        self.cfg = cfg = cfg or MassiveLMConfig()
        if tokenizer is None:
            tokenizer = byte_tokenizer()
        if len(tokenizer) > cfg.d_vocab:
            raise MassiveLensError(
                f"the tokenizer has {len(tokenizer)} tokens but d_vocab={cfg.d_vocab}; "
                f"set MassiveLMConfig(d_vocab={len(tokenizer)})"
            )
        self.tokenizer = tokenizer
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        self.W_pos = None if cfg.llama else nn.Parameter(torch.empty(cfg.n_ctx + 1, cfg.d_model))
        sink = cfg.attention.name == "sink_token"
        self.sink_embed = nn.Parameter(torch.empty(cfg.d_model)) if sink else None
        self.hook_embed, self.hook_pos_embed = hook_point(cfg), hook_point(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_final = Norm(cfg)
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))
        self._init_weights()
        self.setup()

    def _init_weights(self) -> None:
        std, out_std = self.cfg.init_range, self.cfg.init_range / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("W_O", "W_out")):
                nn.init.normal_(p, std=out_std)
            elif name.split(".")[-1] in ("W_E", "W_pos", "W_U", "W_Q", "W_K", "W_V", "W_in", "W_gate", "sink_embed"):
                nn.init.normal_(p, std=std)

    @property
    def sink_id(self) -> int | None:
        """Token id of the learnable sink (``d_vocab``, outside the vocabulary), if any."""
        return self.cfg.d_vocab if self.sink_embed is not None else None

    def with_sink(self, tokens: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos_plus"]:
        """Prepend the sink token when the model has one and ``tokens`` lack it.

        Args:
            tokens: token ids ``[batch, pos]``.

        Returns:
            ``[batch, pos + 1]`` ids starting with :attr:`sink_id` for a ``sink_token``
            model whose ``tokens`` do not all start with it; else ``tokens`` unchanged.
        """
        if self.sink_id is None or (tokens.shape[1] and bool((tokens[:, 0] == self.sink_id).all())):
            return tokens
        return torch.cat([tokens.new_full((tokens.shape[0], 1), self.sink_id), tokens], 1)

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"] | str | list[str],
        return_type: str | None = "logits",
        attention_mask: Tensor | None = None,
        stop_at_layer: int | None = None,
    ) -> Any:
        """Logits ``[batch, pos, d_vocab]``, the mean next-token loss, both, or ``None``.

        With ``stop_at_layer=l`` returns the residual stream entering block ``l``.

        Args:
            tokens: token ids ``[batch, pos]``, or a string or list of strings (tokenized
                with :meth:`to_tokens`). A ``sink_token`` model prepends its sink.
            return_type: ``"logits"`` (default), ``"loss"`` (mean next-token cross-entropy
                over non-pad targets), ``"both"`` (``(logits, loss)``) or None.
            attention_mask: ``[batch, pos]``, 1 for real tokens and 0 for padding; padded
                keys get no attention and padded targets no loss (None: all real).
            stop_at_layer: stop before block ``stop_at_layer`` and return the residual stream
                there, whatever ``return_type`` (None: run every block).

        Returns:
            The logits, the loss, both, the residual stream, or None, as chosen above
            (with a sink, ``pos`` includes it).

        Raises:
            MassiveLensError: for an unknown ``return_type`` or more than ``n_ctx`` tokens.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise MassiveLensError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        if isinstance(tokens, (str, list)):
            tokens = self.to_tokens(tokens)
        n_in = tokens.shape[1]
        tokens = self.with_sink(tokens.to(self.W_E.device))
        if attention_mask is not None and tokens.shape[1] > n_in:
            attention_mask = F.pad(attention_mask, (1, 0), value=1)
        if tokens.shape[1] > self.cfg.n_ctx + (self.sink_id is not None):
            raise MassiveLensError(f"{tokens.shape[1]} tokens exceed n_ctx={self.cfg.n_ctx}; truncate the input")
        x = self.W_E[tokens.clamp(max=self.cfg.d_vocab - 1)]
        if self.sink_embed is not None:
            x = torch.where((tokens == self.sink_id)[..., None], self.sink_embed.to(x.dtype), x)
        x = self.hook_embed(x)
        if self.W_pos is not None:
            x = x + self.hook_pos_embed(self.W_pos[: tokens.shape[1]][None].expand_as(x))
        for block in self.blocks[:stop_at_layer]:
            x = block(x, attention_mask)
        if stop_at_layer is not None:
            return x
        logits = self.ln_final(x) @ self.W_U + self.b_U
        if return_type in ("logits", None):
            return logits if return_type else None
        loss = lm_loss(logits, tokens, attention_mask)
        return loss if return_type == "loss" else (logits, loss)

    # --- tokenization (TransformerLens-style) ---------------------------------------
    def to_tokens(
        self, text: str | list[str], prepend_bos: bool | None = None, truncate: bool = True
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize (right-padded), prepending BOS by default and the sink token if any.

        Args:
            text: a string or a list of strings.
            prepend_bos: start each row with BOS (EOS if the tokenizer has none); None:
                ``cfg.default_prepend_bos``.
            truncate: keep only the first ``n_ctx`` ids of each row (default).

        Returns:
            Token ids ``[batch, pos]`` on the model's device, padded with the pad id (EOS if
            there is none).

        >>> model = MassiveLM(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))
        >>> model.to_tokens(["Hi", "Hi."]).shape, model.to_str_tokens("Hi")
        (torch.Size([2, 4]), ['<|bos|>', 'H', 'i'])
        """
        texts = [text] if isinstance(text, str) else list(text)
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos:
            ids = [[bos, *row] for row in ids]
        if self.sink_id is not None:
            ids = [[self.sink_id, *row] for row in ids]
        if truncate:
            ids = [row[: self.cfg.n_ctx] for row in ids]
        width = max(len(row) for row in ids)
        out = torch.tensor([row + [pad] * (width - len(row)) for row in ids], dtype=torch.long)
        return out.to(self.W_E.device)

    def to_str_tokens(
        self, text: str | Tensor, prepend_bos: bool | None = None
    ) -> list[str]:
        """One string per token (the sink shows as ``<|sink|>``).

        Args:
            text: a string (tokenized with :meth:`to_tokens`) or token ids (every id, in
                order, whatever the shape).
            prepend_bos: for a string, as in :meth:`to_tokens`; ignored for token ids.

        Returns:
            The decoded token strings.
        """
        ids = self.to_tokens(text, prepend_bos)[0] if isinstance(text, str) else text
        return [
            SINK_TOKEN if i == self.sink_id else self.tokenizer.decode([i])
            for i in ids.flatten().tolist()
        ]

    def to_string(self, tokens: Tensor) -> str:
        """Decode token ids to text.

        Args:
            tokens: token ids, any shape (read in order).

        Returns:
            The token strings of :meth:`to_str_tokens`, joined.
        """
        return "".join(self.to_str_tokens(tokens))

    def quantization_sites(self, include_head: bool = False) -> list[tuple[nn.Module, nn.Parameter, tuple[int, ...]]]:
        """Every linear map as (module whose first input is its input, weight, the weight's input
        axes), for :func:`massive_lens.quant.fake_quantized`.

        Args:
            include_head: also list the unembedding ``W_U`` (default False).

        Returns:
            A list of ``(module, weight, input_axes)`` tuples, block by block.

        Raises:
            MassiveLensError: if the model was built with ``hook_points=False``.
        """
        sites: list[tuple[nn.Module, nn.Parameter, tuple[int, ...]]] = []
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            attn_in, mlp_in = block.input_sites()
            sites += [(attn_in, w, (1,)) for w in (attn.W_Q, attn.W_K, attn.W_V)]
            sites.append((attn.hook_z, attn.W_O, (0, 1)))
            sites += [(mlp_in, w, (0,)) for w in (mlp.W_in, mlp.W_gate) if w is not None]
            sites.append((mlp.hook_post, mlp.W_out, (0,)))
            if getattr(attn.variant, "W_G", None) is not None:
                sites.append((attn_in, attn.variant.W_G, (0,)))
        if include_head:
            sites.append((self.ln_final.hook_normalized, self.W_U, (0,)))
        if any(isinstance(m, nn.Identity) for m, _, _ in sites):
            raise MassiveLensError("fake_quantized needs a MassiveLM built with hook_points=True")
        return sites

    def to(self, *args: Any, **kwargs: Any) -> MassiveLM:  # keep cfg.device/dtype current
        """Move or cast the model as ``nn.Module.to`` does, and update ``cfg.device``/``cfg.dtype``.

        Args:
            *args: as for ``torch.nn.Module.to`` (a device, a dtype or a tensor).
            **kwargs: as for ``torch.nn.Module.to`` (``device=``, ``dtype=``, ``non_blocking=``).

        Returns:
            The model itself.
        """
        out = super().to(*args, **kwargs)
        self.cfg.device, self.cfg.dtype = str(self.W_E.device), self.W_E.dtype
        return out


def lm_loss(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Tensor | None = None,
) -> Float[Tensor, ""]:
    """Mean next-token cross-entropy (padding positions excluded)."""
    flat = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none"
    )
    if attention_mask is None:
        return flat.mean()
    keep = attention_mask[:, 1:].flatten().to(flat.dtype)
    return (flat * keep).sum() / keep.sum().clamp(min=1)
