"""Old names of the quantization modules forwarded to their new homes, with a deprecation warning.

``massive_lens.quantize`` and ``massive_lens.lowbit`` (before issue 38) hold only a ``MOVED``
table and a module ``__getattr__`` that calls :func:`forward`.

>>> import warnings
>>> from massive_lens.quant import settings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     forward("old.place", {"GRID": (settings, "GRID")}, "GRID") is settings.GRID
True
>>> str(caught[0].message)
'old.place.GRID is deprecated: use massive_lens.quant.settings.GRID (quantization lives in massive_lens.quant)'
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any


def forward(module: str, moved: dict[str, tuple[ModuleType, str]], name: str) -> Any:
    """The new object behind ``module.name``, with a ``DeprecationWarning`` naming it.

    Args:
        module: the old module's name.
        moved: old name -> (new module, name there).
        name: the name asked for.

    Returns:
        The object.

    Raises:
        AttributeError: for a name the old module never had.
    """
    if name not in moved:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, new = moved[name]
    warnings.warn(f"{module}.{name} is deprecated: use {home.__name__}.{new} (quantization lives in "
                  "massive_lens.quant)", DeprecationWarning, stacklevel=3)
    return getattr(home, new)
