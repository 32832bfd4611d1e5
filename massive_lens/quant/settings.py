"""A low-bit setting by name: ``W4A4``, ``W4A4KV4``, ``W4A4@tensor+hadamard+kvsink``; the settings tables.

``W<w>A<a>`` weight and activation bits (16: full precision), ``KV<b>`` the key-value cache
(default 16), ``@<granularity>`` (``tensor``, ``channel``, ``token`` or ``group``; default: the
grid's), ``+hadamard`` or ``+orthogonal`` (a rotation of the residual stream), ``+kvsink`` (the
sinks kept in full precision; ``+sinks`` for short) or ``+prefix`` (PrefixQuant's prefix),
``+asym`` (asymmetric grids with a zero point; ``+sym``: symmetric; default: the grid's).

The tables: :data:`GRID`, what :func:`~massive_lens.quant.quantize_grid` runs by default, and
:data:`ROUND_TO_NEAREST`, its plain settings (no KV cache, rotation or kept sinks: the ones
:func:`~massive_lens.quant.lowbit_grid` takes).

>>> Setting.parse("w4a4kv8@tensor+hadamard+sinks").name
'W4A4KV8@tensor+hadamard+kvsink'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from massive_lens.errors import MassiveLensError

GRANULARITIES = ("tensor", "channel", "token", "group")  # one range per tensor, output row or token, or group
ROTATIONS = (None, "orthogonal", "hadamard")
KEEP = (None, "kvsink", "prefix")
GRID = ("W8A8", "W4A16", "W4A4", "W4A4+hadamard", "W4A4+hadamard+kvsink")
ROUND_TO_NEAREST = tuple(name for name in GRID if "+" not in name)  # the plain settings: W8A8, W4A16, W4A4
_NAME = re.compile(r"w(\d+)a(\d+)(?:kv(\d+))?(?:@([a-z]+))?((?:\+[a-z]+)*)")
_ALTERNATIVES = {"rotation": ROTATIONS, "keep_sinks": KEEP, "symmetric": (None, "sym", "asym")}
_FLAGS = {"hadamard": ("rotation", "hadamard"), "orthogonal": ("rotation", "orthogonal"),
          "kvsink": ("keep_sinks", "kvsink"), "sinks": ("keep_sinks", "kvsink"), "prefix": ("keep_sinks", "prefix"),
          "asym": ("symmetric", False), "sym": ("symmetric", True)}


@dataclass(frozen=True)
class Setting:
    """One low-bit setting (bits 16 = full precision; ``granularity`` and ``symmetric`` None: the grid's)."""

    weights: int = 4
    activations: int = 4
    kv: int = 16
    granularity: str | None = None
    rotation: str | None = None
    keep_sinks: str | None = None
    symmetric: bool | None = None

    def __post_init__(self) -> None:
        for what in ("weights", "activations", "kv"):
            bits = getattr(self, what)
            if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
                raise MassiveLensError(f"{what} bits must be an integer from 2 to 16 (16: full precision), "
                                       f"got {bits!r}")
        if self.granularity is not None and self.granularity not in GRANULARITIES:
            raise MassiveLensError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.rotation not in ROTATIONS:
            raise MassiveLensError(f"rotation must be None, 'orthogonal' or 'hadamard', got {self.rotation!r}")
        if self.keep_sinks not in KEEP:
            raise MassiveLensError(f"keep_sinks must be None, 'kvsink' or 'prefix', got {self.keep_sinks!r}")
        if self.symmetric not in (None, True, False):
            raise MassiveLensError(f"symmetric must be None (the grid's), True or False, got {self.symmetric!r}")

    @property
    def name(self) -> str:
        kv = f"KV{self.kv}" if self.kv < 16 else ""
        at = f"@{self.granularity}" if self.granularity else ""
        grid = {None: None, True: "sym", False: "asym"}[self.symmetric]
        flags = "".join(f"+{f}" for f in (self.rotation, self.keep_sinks, grid) if f)
        return f"W{self.weights}A{self.activations}{kv}{at}{flags}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """A setting from its name (module docstring).

        Args:
            text: the name, e.g. ``"W4A4KV4@tensor+hadamard+kvsink"`` (case does not matter).

        Returns:
            The :class:`Setting`.

        Raises:
            MassiveLensError: for a name of another form.
        """
        match = _NAME.fullmatch(text.strip().lower()) if isinstance(text, str) else None
        flags = match.group(5).split("+")[1:] if match else []
        if match is None or any(f not in _FLAGS for f in flags):
            raise MassiveLensError(
                f"bad low-bit setting {text!r}: write W<bits>A<bits>[KV<bits>][@tensor|channel|token|group]"
                "[+hadamard|+orthogonal][+kvsink|+prefix][+asym|+sym], e.g. W4A4, W4A4KV4@tensor+hadamard+kvsink")
        fields = dict(weights=int(match.group(1)), activations=int(match.group(2)),
                      kv=int(match.group(3) or 16), granularity=match.group(4))
        chosen: dict[str, str | bool] = {}
        said: dict[str, str] = {}
        for flag in flags:
            field, value = _FLAGS[flag]
            word = value if isinstance(value, str) else flag
            if chosen.get(field, value) != value:
                raise MassiveLensError(f"bad low-bit setting {text!r}: +{said[field]} and +{word} both set "
                                       f"{field}; a setting has one of {[k for k in _ALTERNATIVES[field] if k]}")
            chosen[field], said[field] = value, word
        return cls(**fields, **chosen)


def parse_settings(settings: str | Setting | Sequence[str | Setting]) -> list[Setting]:
    """Settings from names or :class:`Setting` objects; one name or setting alone is one setting.

    >>> [s.name for s in parse_settings("W4A4")], [s.name for s in parse_settings(["W8A8", Setting(4, 16)])]
    (['W4A4'], ['W8A8', 'W4A16'])

    Raises:
        MassiveLensError: for a name :meth:`Setting.parse` refuses, or something that is not a
            name, a setting or a sequence of them.
    """
    if isinstance(settings, (str, Setting)):
        return [settings if isinstance(settings, Setting) else Setting.parse(settings)]
    if not isinstance(settings, Sequence):
        raise MassiveLensError(f"settings are low-bit setting names (e.g. ['W8A8', 'W4A4+hadamard']) or Setting "
                               f"objects, got {type(settings).__name__}")
    return [s if isinstance(s, Setting) else Setting.parse(s) for s in settings]


def parse_bits(setting: str) -> tuple[int, int]:
    """The weight and activation widths of a plain setting: ``"W4A16"`` -> ``(4, 16)``.

    Args:
        setting: ``W<bits>A<bits>``, widths 2-16 (16: full precision), case ignored.

    Returns:
        ``(weight bits, activation bits)``.

    Raises:
        MassiveLensError: for another form (a KV cache, granularity, rotation or kept sinks
            included: :func:`~massive_lens.quant.quantize_grid` runs those) or a width outside 2-16.

    >>> parse_bits("w4a16")
    (4, 16)
    """
    try:
        parsed = Setting.parse(setting)
    except MassiveLensError as exc:
        raise MassiveLensError(f"bad quantization setting {setting!r}: write W<bits>A<bits> with widths 2-16 "
                               "(16: full precision), e.g. W8A8, W4A16, W4A4") from exc
    if parsed != Setting(parsed.weights, parsed.activations):
        raise MassiveLensError(f"bad quantization setting {setting!r}: this grid takes W<bits>A<bits> only; a KV "
                               "cache, granularity, rotation or kept sinks need massive_lens.quant.quantize_grid")
    return parsed.weights, parsed.activations
