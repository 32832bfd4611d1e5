"""massive_lens: find, trace and test massive activations and attention sinks.

>>> from massive_lens import tiny_model, find_massive
>>> find_massive(tiny_model("llama"), "Hello.").layers
[]
"""

from massive_lens.detect import Criterion, find_massive, layer_profile, scan_corpus
from massive_lens.errors import MassiveLensError
from massive_lens.models import load_model, tiny_model
from massive_lens.origin import OriginTrace, trace_origin

__version__ = "0.1.0"

__all__ = [
    "Criterion",
    "MassiveLensError",
    "OriginTrace",
    "find_massive",
    "layer_profile",
    "load_model",
    "scan_corpus",
    "tiny_model",
    "trace_origin",
]
