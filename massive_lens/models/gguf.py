"""A GGUF file dequantized straight into the model's own tensors, with no second copy of the weights.

transformers' GGUF loader (``from_pretrained(gguf_file=...)``) dequantizes every tensor into a state
dict, then copies it into a freshly allocated model: the weights twice at the peak, plus the
dequantizer's temporaries (2.2x the weights on a 262k-vocabulary model). :func:`dequantized_model`
builds the model with empty weights (accelerate's ``init_empty_weights``; buffers are real), then
dequantizes each tensor a block of rows at a time into one float32 array that becomes the parameter
itself, through transformers' own GGUF name map and tensor processors (the Llama q/k permutation,
Gemma's norms...), reading the file (never memory-mapping it) once its metadata parse is freed. The
peak is the weights, one tensor's processing, and the tokenizer.

Any tensor the file has and the model does not, a parameter the file does not fill (other than one
tied to a filled one), or a shape that differs, returns None: the caller then uses transformers'
loader, which handles what this does not (an architecture whose tensors are stacked or split).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import init_empty_weights
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, dequantize
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    read_field,
)

log = logging.getLogger(__name__)

ROWS_BYTES = 32 * 2**20  # float32 bytes dequantized at a time (a block of rows)


def dequantized_model(path: Path, config: Any) -> Any | None:
    """The causal LM of ``config`` with the float32 weights of the GGUF file ``path``, or None where
    this loader cannot place every tensor (see the module docstring)."""
    config._name_or_path = str(path.parent)  # as from_pretrained(folder, gguf_file=...) names it
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reader = GGUFReader(path)
    arch = read_field(reader, "general.architecture")[0]
    # what each tensor is and where its bytes lie; then the reader goes, with its parse of the metadata
    # (a large vocabulary's tokens make it as large as half the weights) and its map of the file
    tensors = [(t.name, t.tensor_type, int(t.data_offset), t.data.dtype, tuple(t.data.shape)) for t in reader.tensors]
    del reader
    gc.collect()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    extra: dict[str, Any] = {"tensors": {}, "config": config.to_dict()}
    with open(path, "rb") as file:
        for name, kind, offset, dtype, shape in tensors:
            weights = processor.process(weights=_dequantize(file, kind, offset, dtype, shape), name=name,
                                        tensor_key_mapping=names, parsed_parameters=extra)
            if extra["tensors"] or weights.name not in names:  # a processor that stacks or splits tensors
                log.info("GGUF tensor %s has no one-to-one parameter; using transformers' loader", name)
                return None
            if not _place(model, names[weights.name], weights.weights):
                return None
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        log.info("the GGUF file leaves %s unset; using transformers' loader", missing[:3])
        return None
    return model.eval()


def _dequantize(file: Any, kind: GGMLQuantizationType, offset: int, dtype: np.dtype, shape: tuple[int, ...]
                ) -> np.ndarray:
    """One GGUF tensor (stored as ``shape`` items of ``dtype`` at ``offset``, rows first) as a float32
    array of its own, read from the file and dequantized ``ROWS_BYTES`` of output at a time into it
    (read, not memory-mapped: the file's pages are never counted in the process's memory)."""
    if len(shape) < 2:  # a vector: at once
        file.seek(offset)
        raw = np.frombuffer(file.read(int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype=dtype).reshape(shape)
        return np.array(dequantize(raw, kind), dtype=np.float32, copy=True)
    rows, row_bytes = shape[0], int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    block, size = GGML_QUANT_SIZES[kind]
    step = max(1, ROWS_BYTES // (row_bytes // size * block * 4))  # rows whose float32 output fits ROWS_BYTES
    out = None
    for a in range(0, rows, step):
        n = min(step, rows - a)
        file.seek(offset + a * row_bytes)
        part = dequantize(np.frombuffer(file.read(n * row_bytes), dtype=dtype).reshape(n, *shape[1:]), kind)
        if out is None:
            out = np.empty((rows, *part.shape[1:]), dtype=np.float32)
        out[a: a + n] = part
    return out


def _place(model: Any, name: str, weights: np.ndarray) -> bool:
    """Make ``weights`` (no copy where it is contiguous float32) the parameter ``name``; False for a
    parameter the model lacks or a shape that differs."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    old = getattr(module, leaf, None)
    value = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))
    if not isinstance(old, torch.nn.Parameter) or tuple(old.shape) != tuple(value.shape):
        log.info("GGUF tensor for %s has shape %s, the model's %s", name, tuple(value.shape),
                 None if old is None else tuple(old.shape))
        return False
    setattr(module, leaf, torch.nn.Parameter(value, requires_grad=old.requires_grad))
    return True
