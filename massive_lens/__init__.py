"""massive_lens: find, trace and test massive activations and attention sinks.

The public API, one line per task (every result has ``.to_frame()``, ``.summary()``,
``.plot()`` and ``.save(path)``):

- load: :func:`load_model`, :func:`tiny_model`
- find: :class:`Criterion`, :func:`find_massive`, :func:`layer_profile`, :func:`scan_corpus`
- trace: :func:`trace_origin`
- attention: :func:`sink_attention`, :func:`decompose_attention`, :func:`sink_census`
- intervene and evaluate: :func:`perplexity`, :func:`run_interventions`, :func:`calibrate`
  (the interventions themselves live in :mod:`massive_lens.interventions`)
- what sinks do (the compression valley, the StreamingLLM window, over-mixing, the
  repeated-token circuit): :mod:`massive_lens.effects`
- quantize and train: :func:`measure_outliers` (low bits with rotations and kept sinks:
  :mod:`massive_lens.quant`), :func:`train_model`, :func:`compare_variants`
  (more in :mod:`massive_lens.train`)
- show: :func:`write_report`, :func:`compare_models` (several models on one page; figures
  and views in :mod:`massive_lens.viz`)
- keep: :func:`load` reads back what ``result.save(path)`` wrote, without the model

A tiny random model with a planted massive activation (the BOS token's embedding carries
3,000 in dimension 5, so its residual stream does too):

>>> import torch
>>> from massive_lens import tiny_model, find_massive
>>> model = tiny_model("llama")
>>> with torch.no_grad():
...     model.W_E[model.tokenizer.bos_token_id, 5] = 3000.0
>>> found = find_massive(model, "Hello, world.")
>>> found.dims, found.positions, found.layers
((5,), (0,), (0, 1, 2, 3))
"""

import sys as _sys

try:  # the imports take seconds; a Ctrl-C in them, under the command line, ends with one line like the rest
    from massive_lens import effects as effects  # public subpackages; importing them registers their results
    from massive_lens import quant as quant  # for massive_lens.load
    from massive_lens.attention import decompose_attention, sink_attention, sink_census
    from massive_lens.core.corpora import default_text
    from massive_lens.core.criterion import Criterion
    from massive_lens.core.restore import load
    from massive_lens.detect import find_massive, layer_profile, scan_corpus
    from massive_lens.errors import MassiveLensError
    from massive_lens.handover import exclusion_mask
    from massive_lens.interventions import calibrate, run_interventions
    from massive_lens.metrics import perplexity
    from massive_lens.models.load import load_model
    from massive_lens.models.tiny import tiny_model
    from massive_lens.origin import trace_origin
    from massive_lens.quant import measure_outliers
    from massive_lens.report import compare_models, write_report
    from massive_lens.train import compare_variants, train_model
except KeyboardInterrupt:
    if _sys.argv and _sys.argv[0].endswith("massive-lens"):
        print("massive-lens: interrupted", file=_sys.stderr)
        raise SystemExit(130) from None
    raise

__version__ = "0.1.0"

__all__ = [
    "Criterion",
    "MassiveLensError",
    "calibrate",
    "compare_models",
    "compare_variants",
    "decompose_attention",
    "default_text",
    "exclusion_mask",
    "find_massive",
    "layer_profile",
    "load",
    "load_model",
    "measure_outliers",
    "perplexity",
    "run_interventions",
    "scan_corpus",
    "sink_attention",
    "sink_census",
    "tiny_model",
    "trace_origin",
    "train_model",
    "write_report",
]
