"""The parts of :class:`~massive_lens.train.model.MassiveLM`: its config and its layers.

``MassiveLMConfig`` holds the shape and style; ``Norm`` (RMSNorm or LayerNorm), ``Rotary``,
``Attention`` (whose score-to-weight step is the pluggable variant of
:mod:`massive_lens.train.variants`), ``MLP`` (SwiGLU or GELU) and the pre-norm ``Block`` are
the pieces :mod:`massive_lens.train.model` stacks. Every intermediate value passes through a
TransformerLens ``HookPoint`` with the usual name.

>>> block = Block(MassiveLMConfig(n_layers=1, d_model=16, n_heads=2))
>>> tuple(block(torch.zeros(1, 3, 16)).shape)
(1, 3, 16)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from massive_lens.errors import MassiveLensError
from massive_lens.train.variants import VariantConfig, make_variant

NORM_PLACEMENTS = ("pre", "post", "none")


@dataclass
class MassiveLMConfig:
    """Shape and style of a :class:`MassiveLM` (field names follow TransformerLens's cfg).

    ``None`` fields are derived: ``d_head = d_model // n_heads``; ``d_mlp`` is
    ``4 d_model`` for GELU and about ``8/3 d_model`` (rounded to 16) for SwiGLU.
    ``n_key_value_heads`` (default ``n_heads``) below ``n_heads`` gives grouped-query attention:
    ``W_K``/``W_V`` and ``hook_k``/``hook_v`` have that many heads, as in TransformerLens.
    ``hook_points=False`` replaces every HookPoint by a plain identity (for benchmarks).
    ``norm`` places each block's two norms: ``"pre"`` (default, ``x + f(norm(x))``), ``"post"``
    (``norm(x + f(x))``, the original Transformer's placement) or ``"none"`` (``x + f(x)``, no
    norm inside blocks); the final norm before the unembedding stays in all three.
    """

    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_ctx: int = 128
    d_vocab: int = 259
    style: str = "llama"
    attention: VariantConfig | str | dict = field(default_factory=VariantConfig)
    d_head: int | None = None
    d_mlp: int | None = None
    eps: float | int = 1e-5
    rotary_base: float | int = 10000.0
    init_range: float | int = 0.02
    hook_points: bool = True
    default_prepend_bos: bool = True
    n_key_value_heads: int | None = None
    norm: str = "pre"
    model_name: str = "MassiveLM"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if isinstance(self.attention, str):
            self.attention = VariantConfig(self.attention)
        elif isinstance(self.attention, dict):
            self.attention = VariantConfig(**self.attention)
        if self.style not in ("llama", "gpt2"):
            raise MassiveLensError(f"MassiveLM style must be 'llama' or 'gpt2', got {self.style!r}")
        if self.norm not in NORM_PLACEMENTS:
            raise MassiveLensError(f"MassiveLM norm must be one of {', '.join(NORM_PLACEMENTS)}, got {self.norm!r}")
        if self.d_model % self.n_heads and self.d_head is None:
            raise MassiveLensError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change one or pass d_head"
            )
        self.d_head = self.d_head or self.d_model // self.n_heads
        if self.n_key_value_heads is not None and (
            self.n_key_value_heads < 1 or self.n_heads % self.n_key_value_heads
        ):
            raise MassiveLensError(
                f"n_key_value_heads={self.n_key_value_heads} must be a positive divisor of "
                f"n_heads={self.n_heads} (grouped-query attention shares each kv head between "
                "n_heads // n_key_value_heads query heads)"
            )
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model if self.style == "gpt2" else 16 * -(-self.d_model * 8 // 48)

    llama = property(lambda self: self.style == "llama")
    act_fn = property(lambda self: "silu" if self.llama else "gelu")
    normalization_type = property(lambda self: "RMS" if self.llama else "LN")
    positional_embedding_type = property(lambda self: "rotary" if self.llama else "standard")
    gated_mlp = property(lambda self: self.llama)
    d_vocab_out = property(lambda self: self.d_vocab)
    original_architecture = property(lambda self: "MassiveLM")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (for checkpoints and logs)."""
        out = asdict(self)
        out["dtype"] = str(self.dtype).replace("torch.", "")
        return out

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> MassiveLMConfig:
        """The config back from :meth:`to_dict`'s output.

        Args:
            fields: config fields, ``dtype`` as a name such as ``"float32"`` (the default
                when missing); not modified.

        Returns:
            A new ``MassiveLMConfig``.

        Raises:
            MassiveLensError: for values the config rejects.
            TypeError: for an unknown field.
        """
        fields = dict(fields)
        fields["dtype"] = getattr(torch, str(fields.get("dtype", "float32")))
        return cls(**fields)


def hook_point(cfg: MassiveLMConfig) -> nn.Module:
    return HookPoint() if cfg.hook_points else nn.Identity()


class Norm(nn.Module):
    """RMSNorm (llama) or LayerNorm (gpt2); ``hook_scale`` is the divisor ``[batch, pos, 1]``."""

    def __init__(self, cfg: MassiveLMConfig):
        super().__init__()
        self.cfg = cfg
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = None if cfg.llama else nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale, self.hook_normalized = hook_point(cfg), hook_point(cfg)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.b is not None:
            x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.cfg.eps).sqrt())
        out = x / scale * self.w
        return self.hook_normalized(out if self.b is None else out + self.b)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention, as in Hugging Face Llama)."""

    def __init__(self, cfg: MassiveLMConfig):
        super().__init__()
        half = cfg.d_head // 2
        freq = cfg.rotary_base ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.arange(cfg.n_ctx + 1, dtype=torch.float32)[:, None] * freq[None]
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(
        self, x: Float[Tensor, "batch pos head_index d_head"]
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        n = x.shape[1]
        cos, sin = self.cos[:n, None].to(x.dtype), self.sin[:n, None].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    """Multi-head causal attention; the variant decides how scores become weights."""

    def __init__(self, cfg: MassiveLMConfig):
        super().__init__()
        h, m, d = cfg.n_heads, cfg.d_model, cfg.d_head
        kv = cfg.n_key_value_heads or h  # grouped-query attention: a kv head serves h // kv query heads
        self.group = h // kv
        self.W_Q = nn.Parameter(torch.empty(h, m, d))
        self.W_K, self.W_V = (nn.Parameter(torch.empty(kv, m, d)) for _ in range(2))
        self.W_O = nn.Parameter(torch.empty(h, d, m))
        bias = not cfg.llama
        self.b_Q, self.b_K, self.b_V = (
            (nn.Parameter(torch.zeros(n, d)) if bias else None) for n in (h, kv, kv)
        )
        self.b_O = nn.Parameter(torch.zeros(m)) if bias else None
        self.rotary = Rotary(cfg) if cfg.llama else None
        self.variant = make_variant(cfg.attention, h, d, m)
        names = ("q", "k", "v", "z", "rot_q", "rot_k", "attn_scores", "pattern", "slot_pattern", "out")
        for name in names:  # hook_out: the layer output, as TransformerBridge names it
            setattr(self, f"hook_{name}", hook_point(cfg))

    def _project(self, x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
        out = torch.einsum("bpm,hmd->bphd", x, W)
        return out if b is None else out + b

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], key_mask: Tensor | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        q = self.hook_q(self._project(x, self.W_Q, self.b_Q))
        k = self.hook_k(self._project(x, self.W_K, self.b_K))
        v = self.hook_v(self._project(x, self.W_V, self.b_V))
        if self.rotary is not None:
            q, k = self.hook_rot_q(self.rotary(q)), self.hook_rot_k(self.rotary(k))
        if self.group > 1:  # hooks see the kv heads, as in TransformerLens; attention sees them shared
            k, v = k.repeat_interleave(self.group, dim=2), v.repeat_interleave(self.group, dim=2)
        z = self.variant(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), x, self, key_mask)
        out = torch.einsum("bphd,hdm->bpm", self.hook_z(z), self.W_O)
        return self.hook_out(out if self.b_O is None else out + self.b_O)


class MLP(nn.Module):
    """SwiGLU (llama: ``silu(x W_gate) * (x W_in)``) or GELU (gpt2) feed-forward layer."""

    def __init__(self, cfg: MassiveLMConfig):
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp)) if cfg.llama else None
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_in = None if cfg.llama else nn.Parameter(torch.zeros(cfg.d_mlp))
        self.b_out = None if cfg.llama else nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_pre, self.hook_pre_linear, self.hook_post = hook_point(cfg), hook_point(cfg), hook_point(cfg)
        self.hook_out = hook_point(cfg)  # the layer output, as TransformerBridge names it

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.W_gate is not None:
            pre = self.hook_pre(x @ self.W_gate)
            post = self.hook_post(F.silu(pre) * self.hook_pre_linear(x @ self.W_in))
            return self.hook_out(post @ self.W_out)
        post = self.hook_post(F.gelu(self.hook_pre(x @ self.W_in + self.b_in)))
        return self.hook_out(post @ self.W_out + self.b_out)


class Block(nn.Module):
    """Residual block. Pre-norm (default): ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``; post-norm:
    ``ln1(x + attn(x))``, then ``ln2(. + mlp(.))``; ``"none"``: ``x + attn(x)``, then ``+ mlp(.)``."""

    def __init__(self, cfg: MassiveLMConfig):
        super().__init__()
        self.norm = cfg.norm
        self.ln1, self.attn, self.ln2, self.mlp = Norm(cfg), Attention(cfg), Norm(cfg), MLP(cfg)
        if cfg.norm == "none":
            self.ln1, self.ln2 = hook_point(cfg), hook_point(cfg)  # no parameters, no normalisation
        for name in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
            setattr(self, f"hook_{name}", hook_point(cfg))

    def input_sites(self) -> tuple[nn.Module, nn.Module]:
        """The modules whose first input is the attention's and the MLP's input (for fake quantization)."""
        if self.norm == "pre":
            return self.ln1.hook_normalized, self.ln2.hook_normalized
        if self.norm == "post":
            return self.hook_resid_pre, self.ln1.hook_normalized
        return self.hook_resid_pre, self.hook_resid_mid

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], key_mask: Tensor | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        x = self.hook_resid_pre(x)
        if self.norm == "post":
            x = self.hook_resid_mid(self.ln1(x + self.hook_attn_out(self.attn(x, key_mask))))
            return self.hook_resid_post(self.ln2(x + self.hook_mlp_out(self.mlp(x))))
        x = self.hook_resid_mid(x + self.hook_attn_out(self.attn(self.ln1(x), key_mask)))
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))
