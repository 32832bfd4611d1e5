"""Loading models: the offline default, hub ids, local folders, GGUF files, and tiny test models.

- :mod:`~massive_lens.models.load`: :func:`load_model` and :func:`wrap_hf_model`;
- :mod:`~massive_lens.models.backends`: the TransformerBridge / HookedTransformer / nnsight choice
  (:func:`trace_options`: what every nnsight trace is passed, e.g. ``remote=True``);
- :mod:`~massive_lens.models.offline`: the two offline real models, GGUF files and the cache;
- :mod:`~massive_lens.models.tiny`: :func:`tiny_model` and its families.

>>> tiny_model("llama", num_hidden_layers=2).cfg.n_layers
2
"""

from massive_lens.core.nnsight_model import trace_options
from massive_lens.core.tokens import byte_tokenizer
from massive_lens.models.load import DEFAULT_MODEL, load_model, wrap_hf_model
from massive_lens.models.tiny import FAMILIES, VISION_FAMILIES, tiny_model

__all__ = ["DEFAULT_MODEL", "FAMILIES", "VISION_FAMILIES", "byte_tokenizer", "load_model", "tiny_model",
           "trace_options", "wrap_hf_model"]
