"""massive_lens: find, trace and test massive activations and attention sinks.

The public API, one line per task (every result has ``.to_frame()``, ``.summary()``,
``.plot()``):

- load: :func:`load_model`, :func:`tiny_model`
- find: :class:`Criterion`, :func:`find_massive`, :func:`layer_profile`, :func:`scan_corpus`
- trace: :func:`trace_origin`
- attention: :func:`sink_attention`, :func:`decompose_attention`
- intervene and evaluate: :func:`perplexity`, :func:`run_interventions` (the interventions
  themselves live in ``massive_lens.interventions``)
- train and quantize: :func:`compare_variants`, :func:`train_model`, :func:`measure_outliers`
- show: :func:`write_report`

>>> from massive_lens import tiny_model, find_massive
>>> find_massive(tiny_model("llama"), "Hello.").layers
[]
"""

from massive_lens.attention import decompose_attention, sink_attention
from massive_lens.detect import Criterion, find_massive, layer_profile, scan_corpus
from massive_lens.errors import MassiveLensError
from massive_lens.evaluate import perplexity, run_interventions
from massive_lens.models import load_model, tiny_model
from massive_lens.origin import trace_origin
from massive_lens.quantize import measure_outliers
from massive_lens.report import write_report
from massive_lens.train import compare_variants, train_model

__version__ = "0.1.0"

__all__ = [
    "Criterion",
    "MassiveLensError",
    "compare_variants",
    "decompose_attention",
    "find_massive",
    "layer_profile",
    "load_model",
    "measure_outliers",
    "perplexity",
    "run_interventions",
    "scan_corpus",
    "sink_attention",
    "tiny_model",
    "trace_origin",
    "train_model",
    "write_report",
]
