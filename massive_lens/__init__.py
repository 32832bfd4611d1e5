"""massive_lens: find, trace and test massive activations and attention sinks."""

from massive_lens.errors import MassiveLensError
from massive_lens.models import load_model, tiny_model

__version__ = "0.1.0"

__all__ = ["MassiveLensError", "load_model", "tiny_model"]
