"""The one exception massive_lens raises for bad input or an unusable model.

Every message says what was wrong (which model, layer, hook or shape) and what to do
instead, so a researcher in a notebook can fix the call without reading our source.
"""


class MassiveLensError(ValueError):
    """Raised for bad input, unsupported models and missing optional packages.

    >>> raise MassiveLensError("empty text: pass at least one token")
    Traceback (most recent call last):
    ...
    massive_lens.errors.MassiveLensError: empty text: pass at least one token
    """
