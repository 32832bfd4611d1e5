"""Bad inputs never give a silent wrong answer (issue #12).

One table, :data:`CASES`: each row is a call that must fail with a ``MassiveLensError`` whose
message holds the expected words (what was wrong, and what to do). After every row the
model is as found: no hooks left, weights bit-identical, same dtype, device and train/eval
mode. Rows run on a tiny llama (``tiny``) or on a copy of it in float16 whose layer 2
overflows (``overflow``), built once per module. Rows marked ``typed`` pass a value the
annotations already refuse, so the tests' type-checking import hook would stop them first:
they run, as source text, with its checks turned off (``helpers.untyped_errors``, once for all of them).

The table covers the API and the command line (``cli-`` rows run ``massive-lens`` and expect
exit 2 with the message on stderr). Accepted inputs, threads, Ctrl-C in the command line and
the cache manifest are in ``test_bad_inputs_accepted.py``; Ctrl-C during training in
``train/test_interrupt.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from examples import StandInSAE
from helpers import untouched, untyped_errors

import massive_lens
from massive_lens import (
    MassiveLensError,
    decompose_attention,
    find_massive,
    layer_profile,
    load_model,
    measure_outliers,
    perplexity,
    scan_corpus,
    sink_attention,
    tiny_model,
    trace_origin,
)
from massive_lens.attention import sink_census
from massive_lens.attention.kv import sink_kv
from massive_lens.cli import main
from massive_lens.effects import over_mixing, repeated_token_probe, streaming_window
from massive_lens.handover import exclusion_mask, massive_dims, precision_check, read_dims, sae_check
from massive_lens.handover.dims import MAX_BYTES as MAX_DIMS_BYTES
from massive_lens.interventions import (
    ablate_massive,
    calibrate,
    fix_sink_term,
    head_curve,
    patch_sink_from,
    remove_sink_attention,
    run_interventions,
)
from massive_lens.quant import quantize_grid
from massive_lens.report import compare_models, write_report
from massive_lens.train import compare_variants, load_run, train_model

TEXT = "The cat sat on the mat. The dog ran. " * 2
CORPUS = "a b c d e f g h " * 40
FLOAT_IDS = torch.tensor([[256.0, 72.7, 105.2]])  # the example: truncated to ints before


def _intervention(model: Any) -> Any:
    return remove_sink_attention(model, calibration="Some calibration text. " * 8)


def _enter_twice(model: Any) -> None:
    fx = _intervention(model)
    with fx, fx:
        pass


def _hooks_inside_with(model: Any) -> None:
    fx = _intervention(model)
    with fx:
        perplexity(model, CORPUS, seq_len=16, n_seqs=2, hooks=fx, progress=False)


def _hf_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder of bad files: binary text, a folder, a plain file (to write onto or under),
    damaged checkpoints, and a tiny model saved for the command line."""
    from massive_lens.models import byte_tokenizer

    folder = tmp_path_factory.mktemp("bad_inputs")
    (folder / "binary.txt").write_bytes(b"\x00\x01\x02 not text \x00" * 50)
    (folder / "a_folder").mkdir()
    (folder / "a_file").write_text("not a folder")
    (folder / "garbage_run").mkdir()
    (folder / "garbage_run" / "checkpoint.safetensors").write_bytes(b"not a checkpoint" * 8)
    run = train_model("smoke", out_dir=folder / "truncated_run", progress=False, **TRAIN)
    checkpoint = folder / "truncated_run" / "checkpoint.safetensors"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    assert run.steps == TRAIN["steps"]
    _hf_model().save_pretrained(folder / "tiny")
    byte_tokenizer().save_pretrained(folder / "tiny")
    (folder / "not_a_model.gguf").write_bytes(b"not a gguf file at all" * 4)
    (folder / "other.json").write_text('{"schema": "something else"}')
    (folder / "broken.json").write_text("{not json")
    (folder / "partial.json").write_text('{"schema": "massive_lens.massive_dims", "version": 1, "details": [{}]}')
    return folder


TRAIN = dict(steps=1, data=CORPUS, tokenizer="byte", model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16))


def _cli(*argv: Any) -> None:
    """Run ``massive-lens ARGV``; a failure (exit 2) becomes the MassiveLensError the table expects,
    with the one line the user saw; any other exit code is returned for the row to fail on."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse refusing a flag's value
            code = exc.code
    if code == 2:
        raise MassiveLensError(err.getvalue())
    raise AssertionError(f"massive-lens {' '.join(map(str, argv))} exited {code}, not 2: {err.getvalue()[-500:]}")


def _damaged_result(folder: Path, how: str) -> Path:
    """A saved find_massive result damaged one way: a manifest nested 100,000 deep, a ``$dtype``
    naming a torch function, a field of the wrong type, a truncated Parquet table, a table that is
    a link to a file outside the folder."""
    out = find_massive(tiny_model("llama"), "Hi there.").save(folder / f"damaged_{how}", overwrite=True)
    manifest = json.loads((out / "manifest.json").read_text())
    if how == "deep":
        (out / "manifest.json").write_text(json.dumps(manifest)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return out
    if how == "dtype":
        manifest["fields"]["model_name"] = {"$dtype": "load"}
    if how == "field":
        manifest["fields"]["entries"] = "not a table"
    if how == "parquet":
        table = next(out.rglob("*.parquet"))
        table.write_bytes(table.read_bytes()[:40])
    if how == "symlink":
        table = next(out.rglob("*.parquet"))
        outside = folder / "outside.parquet"
        outside.write_bytes(table.read_bytes())
        table.unlink()
        table.symlink_to(outside)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _oversized_run(folder: Path) -> Path:
    """A saved TrainRun whose manifest asks for a model of 1,000 layers of width 100,000
    around the weights of a 1-layer, width-16 one (it must be refused before any allocation)."""
    out = train_model("smoke", progress=False, **TRAIN).save(folder / "oversized_run", overwrite=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["fields"]["model"]["config"].update(n_layers=1000, d_model=100_000)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _dims_file(folder: Path, how: str) -> Path:
    """A massive_dims JSON file of the tiny model, then changed one way (issue 37)."""
    path = massive_dims(tiny_model("llama"), CORPUS, seq_len=16, n_seqs=2).to_json(folder / f"dims_{how}.json")
    data = json.loads(path.read_text())
    if how == "disagree":  # "dims" names a dim the details do not keep out
        data["dims"] = sorted(set(data["dims"]) ^ {0})
    if how == "dim-past-d_model":
        data["details"].append(dict(dim=data["d_model"], layers=[0], share=1 / data["n_layers"], scope="token",
                                    max_abs=1e3, kept_out=False))
    if how == "dim-float":
        data["details"].append(dict(dim=1.5, layers=[0], share=1.0, scope="token", max_abs=1e3, kept_out=False))
    if how == "d_model-negative":
        data["d_model"] = -1
    if how == "layer-past-n_layers":
        data["details"].append(dict(dim=0, layers=[data["n_layers"]], share=1.0, scope="token", max_abs=1e3,
                                    kept_out=False))
    if how == "deep":
        path.write_text(json.dumps(data)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return path
    if how == "huge":
        with open(path, "ab") as f:  # a sparse file past the limit: refused by its size, never read
            f.truncate(MAX_DIMS_BYTES + 1)
        return path
    path.write_text(json.dumps(data))
    return path


def _with_cache_at(path: Path) -> None:
    old = os.environ.get("MASSIVE_LENS_CACHE")
    os.environ["MASSIVE_LENS_CACHE"] = str(path)
    try:
        load_model()
    finally:
        if old is None:
            del os.environ["MASSIVE_LENS_CACHE"]
        else:
            os.environ["MASSIVE_LENS_CACHE"] = old


def _sae(d_in: int = 64, hook: str = "blocks.1.hook_resid_post", **changes: Any) -> Any:
    """A stand-in SAE (encode, decode, cfg as sae-lens has them) with ``changes`` to its attributes."""
    sae = StandInSAE(d_in, hook)
    for name, value in changes.items():
        setattr(sae.cfg if name in ("d_in", "hook_name") else sae, name, value)
    return sae


def row(model: str, call: Any, expected: str, name: str, heavy: bool = False) -> Any:
    return pytest.param(model, call, expected, id=name, marks=[pytest.mark.heavy] if heavy else [])


CASES = [
    # --- token ids: one check (core.model_view.check_token_ids) behind every entry point
    row("tiny", lambda m, d: find_massive(m, FLOAT_IDS), "token ids must be integers", "find_massive-float-ids"),
    row("tiny", lambda m, d: find_massive(m, torch.tensor([[256.0, 72.0]])), "never rounded",
        "find_massive-whole-float-ids"),
    row("tiny", lambda m, d: find_massive(m, torch.tensor([[256.0, float("nan")]])), "NaN or inf",
        "find_massive-nan-id"),
    row("tiny", lambda m, d: find_massive(m, torch.tensor([[256, 10**6]])), "must lie in [0, 259)",
        "find_massive-out-of-vocab"),
    row("tiny", lambda m, d: find_massive(m, torch.tensor([[256, -1, 7]])), "must lie in [0, 259)",
        "find_massive-negative-id"),
    row("tiny", lambda m, d: find_massive(m, torch.tensor([[True, False]])), "token ids must be integers",
        "find_massive-bool-ids"),
    row("tiny", lambda m, d: find_massive(m, torch.zeros(1, 0, dtype=torch.long)), "pos > 0",
        "find_massive-empty-ids"),
    row("tiny", lambda m, d: layer_profile(m, FLOAT_IDS), "token ids must be integers", "layer_profile-float-ids"),
    row("tiny", lambda m, d: sink_attention(m, FLOAT_IDS), "token ids must be integers", "sink_attention-float-ids"),
    row("tiny", lambda m, d: decompose_attention(m, torch.tensor([[1, 999]])), "must lie in",
        "decompose_attention-out-of-vocab"),
    row("tiny", lambda m, d: trace_origin(m, FLOAT_IDS, dim=0, pos=0), "token ids must be integers",
        "trace_origin-float-ids"),
    row("tiny", lambda m, d: perplexity(m, torch.rand(2, 16) * 200, progress=False), "token ids must be integers",
        "perplexity-float-ids"),
    row("tiny", lambda m, d: perplexity(m, torch.full((2, 16), float("inf")), progress=False), "NaN or inf",
        "perplexity-inf-ids"),
    row("tiny", lambda m, d: perplexity(m, torch.tensor([[1, 2, 10**6]]), progress=False), "must lie in",
        "perplexity-out-of-vocab"),
    row("tiny", lambda m, d: perplexity(m, torch.tensor([[1, -5, 3]]), progress=False), "must lie in",
        "perplexity-negative-id"),
    row("tiny", lambda m, d: perplexity(m, torch.tensor([1, 2, 3]), progress=False), "[n_seqs, pos]",
        "perplexity-1d-ids"),
    row("tiny", lambda m, d: scan_corpus(m, torch.rand(2, 8) * 200, seq_len=8, progress=False),
        "token ids must be integers", "scan_corpus-float-ids"),
    row("tiny", lambda m, d: scan_corpus(m, torch.full((2, 8), 400), seq_len=8, progress=False), "must lie in",
        "scan_corpus-out-of-vocab"),
    row("tiny", lambda m, d: measure_outliers(m, torch.rand(4, 8) * 200, seq_len=8, n_seqs=2),
        "token ids must be integers", "measure_outliers-float-ids"),
    row("tiny", lambda m, d: calibrate(m, torch.tensor([[1, 2, 3, -4]]), progress=False), "must lie in",
        "calibrate-negative-id"),
    # --- texts
    row("typed", "find_massive(m, b'abc')", "got bytes", "find_massive-bytes"),
    row("typed", "find_massive(m, [1, 2])", "texts must be strings", "find_massive-list-of-ints"),
    row("tiny", lambda m, d: find_massive(m, ""), "empty text", "find_massive-empty-text"),
    row("tiny", lambda m, d: find_massive(m, "bad \ud800 text"), "lone surrogate", "find_massive-lone-surrogate"),
    row("tiny", lambda m, d: scan_corpus(m, "bad \ud800 text " * 50, seq_len=8, progress=False), "lone surrogate",
        "scan_corpus-lone-surrogate"),
    # --- corpus paths: Path objects and file-like words must exist
    row("tiny", lambda m, d: scan_corpus(m, "corpus.csv", progress=False), "no such corpus file",
        "scan_corpus-missing-csv"),
    row("tiny", lambda m, d: scan_corpus(m, d / "missing.txt", progress=False), "no such corpus file",
        "scan_corpus-missing-Path"),
    row("tiny", lambda m, d: perplexity(m, "data/held_out", progress=False), "no such corpus file",
        "perplexity-missing-path-with-separator"),
    row("tiny", lambda m, d: scan_corpus(m, d / "a_folder", progress=False), "is a folder", "scan_corpus-folder"),
    row("tiny", lambda m, d: scan_corpus(m, str(d / "binary.txt"), seq_len=8, progress=False), "is binary",
        "scan_corpus-binary-file"),
    row("typed", "scan_corpus(m, b'some bytes', progress=False)", "the corpus is bytes", "scan_corpus-bytes"),
    # --- sizes and counts (fixed before #12; kept here so they stay fixed)
    row("tiny", lambda m, d: layer_profile(m, []), "got no texts", "layer_profile-no-texts"),
    row("tiny", lambda m, d: scan_corpus(m, seq_len=16, batch_size=-1, progress=False), "batch_size >= 1",
        "scan_corpus-batch_size-negative"),
    row("tiny", lambda m, d: scan_corpus(m, seq_len=16, batch_size=0, progress=False), "batch_size >= 1",
        "scan_corpus-batch_size-zero"),
    row("tiny", lambda m, d: scan_corpus(m, seq_len=16, max_tokens=-8, progress=False), "max_tokens >= 1",
        "scan_corpus-max_tokens-negative"),
    row("tiny", lambda m, d: perplexity(m, CORPUS, seq_len=8, batch_size=-1, progress=False), "batch_size must be",
        "perplexity-batch_size-negative"),
    row("tiny", lambda m, d: perplexity(m, CORPUS, seq_len=8, n_seqs=0, progress=False), "n_seqs must be",
        "perplexity-n_seqs-zero"),
    row("tiny", lambda m, d: layer_profile(m, TEXT, k=0), "must be >= 1", "layer_profile-k-zero"),
    row("typed", "find_massive(m, 'The cat.', layers=1.5)", "layers must be an int", "find_massive-layer-float"),
    row("tiny", lambda m, d: find_massive(m, TEXT, layers=[]), "layers is empty", "find_massive-layers-empty"),
    row("tiny", lambda m, d: find_massive(m, TEXT, layers=99), "out of range", "find_massive-layer-out-of-range"),
    row("tiny", lambda m, d: compare_variants(["softmax"], preset="smoke", seeds=[], progress=False), "seeds is empty",
        "compare_variants-no-seeds"),
    # --- interventions: entering one twice would apply its edit twice
    row("tiny", lambda m, d: _enter_twice(m), "already active", "intervention-with-inside-with"),
    row("tiny", lambda m, d: _hooks_inside_with(m), "would apply its edit twice", "intervention-hooks-inside-with"),
    row("tiny", lambda m, d: _intervention(m).__exit__(None, None, None), "without being entered",
        "intervention-exit-without-enter"),
    # --- load_model never converts a model it is given, and never ignores the arguments silently
    row("tiny", lambda m, d: load_model(m, dtype="float16"), "would be ignored", "load_model-existing-dtype"),
    row("tiny", lambda m, d: load_model(m, device="meta"), "does not move a model", "load_model-existing-device"),
    row("tiny", lambda m, d: load_model(m, device_map="auto"), "already loaded", "load_model-existing-device_map"),
    row("tiny", lambda m, d: load_model(m, dtype="int8"), "unknown dtype", "load_model-int8"),
    row("tiny", lambda m, d: load_model(m, device="gpu7"), "unknown device", "load_model-bad-device"),
    row("tiny", lambda m, d: load_model(_hf_model(), dtype=torch.bfloat16), "would be ignored",
        "load_model-hf-model-dtype"),
    # --- overflow: NaN or inf reached in a hooked activation names the hook and the fix
    row("overflow", lambda m, d: find_massive(m, TEXT), "blocks.2", "find_massive-overflow"),
    row("overflow", lambda m, d: find_massive(m, TEXT, layers=[3]), "holds NaN or inf",
        "find_massive-overflow-one-layer"),
    row("overflow", lambda m, d: layer_profile(m, TEXT), "dtype=torch.float32", "layer_profile-overflow"),
    row("overflow", lambda m, d: sink_attention(m, TEXT), "holds NaN or inf", "sink_attention-overflow"),
    row("overflow", lambda m, d: decompose_attention(m, TEXT), "holds NaN or inf", "decompose_attention-overflow"),
    row("overflow", lambda m, d: trace_origin(m, TEXT, dim=0, pos=0), "holds NaN or inf", "trace_origin-overflow"),
    row("overflow", lambda m, d: trace_origin(m, TEXT), "blocks.2", "trace_origin-overflow-found"),
    row("overflow", lambda m, d: sink_census(m, TEXT), "blocks.2", "sink_census-overflow"),
    row("overflow", lambda m, d: decompose_attention(m, TEXT, sinks=[0]), "holds NaN or inf",
        "decompose_attention-overflow-given"),
    row("overflow", lambda m, d: scan_corpus(m, CORPUS, seq_len=16, max_tokens=64, progress=False),
        "bfloat16", "scan_corpus-overflow"),
    row("overflow", lambda m, d: perplexity(m, CORPUS, seq_len=16, n_seqs=2, progress=False), "NaN or inf logits",
        "perplexity-overflow"),
    row("overflow", lambda m, d: measure_outliers(m, CORPUS, seq_len=16, n_seqs=2), "holds NaN or inf",
        "measure_outliers-overflow"),
    # --- training: non-finite settings, output folders checked before training, damaged checkpoints
    row("tiny", lambda m, d: train_model("smoke", lr=float("nan"), progress=False, **TRAIN), "finite numbers",
        "train_model-lr-nan"),
    row("tiny", lambda m, d: train_model("smoke", lr=float("inf"), progress=False, **TRAIN), "finite numbers",
        "train_model-lr-inf"),
    row("tiny", lambda m, d: train_model("smoke", weight_decay=float("nan"), progress=False, **TRAIN),
        "finite numbers", "train_model-weight_decay-nan"),
    row("tiny", lambda m, d: train_model("smoke", grad_clip=-1.0, progress=False, **TRAIN), "grad_clip > 0",
        "train_model-grad_clip-negative"),
    row("tiny", lambda m, d: train_model("smoke", beta2=1.5, progress=False, **TRAIN), "betas < 1",
        "train_model-beta-above-1"),
    row("tiny", lambda m, d: train_model("smoke", out_dir=d / "a_file", progress=False, **TRAIN),
        "is a file, not a folder", "train_model-out_dir-is-a-file"),
    row("tiny", lambda m, d: train_model("smoke", out_dir=d / "a_file" / "run", progress=False, **TRAIN),
        "lies under the file", "train_model-out_dir-under-a-file"),
    row("tiny", lambda m, d: train_model("smoke", out_dir=d / "garbage_run", progress=False, **TRAIN),
        "not a readable checkpoint", "train_model-resume-garbage-checkpoint"),
    row("tiny", lambda m, d: load_run(d / "garbage_run"), "not a readable checkpoint", "load_run-garbage"),
    row("tiny", lambda m, d: load_run(d / "truncated_run"), "not a readable checkpoint", "load_run-truncated"),
    row("tiny", lambda m, d: load_run(d / "a_folder"), "no checkpoint at", "load_run-no-checkpoint"),
    row("typed", "compare_variants(['softmax'], preset='smoke', seeds=['x'], progress=False)", "whole numbers",
        "compare_variants-seed-not-a-number"),
    row("tiny", lambda m, d: compare_variants(["softmax"], preset="smoke", out_dir=d / "a_file", progress=False),
        "is a file", "compare_variants-out_dir-is-a-file"),
    # --- the report: options, corpus files and the output folder, all before any work
    row("tiny", lambda m, d: write_report(m, out_dir=d / "a_file", quick=True, progress=False),
        "is a file, not a folder", "write_report-out_dir-is-a-file"),
    row("tiny", lambda m, d: write_report(m, out_dir=d / "a_file" / "r", quick=True, progress=False),
        "lies under the file", "write_report-out_dir-under-a-file"),
    row("tiny", lambda m, d: write_report(m, corpus="missing.txt", out_dir=d / "r", progress=False),
        "no such corpus file", "write_report-missing-corpus"),
    row("tiny", lambda m, d: write_report(m, corpus=d / "binary.txt", out_dir=d / "r", progress=False), "is binary",
        "write_report-binary-corpus"),
    row("tiny", lambda m, d: write_report(m, calibration=d / "a_folder", out_dir=d / "r", progress=False),
        "is a folder", "write_report-calibration-folder"),
    row("tiny", lambda m, d: write_report(m, n_seqs=0, out_dir=d / "r", progress=False), ">= 1",
        "write_report-n_seqs-zero"),
    row("tiny", lambda m, d: write_report(m, layer=99, out_dir=d / "r", progress=False), "layer=99 is out of range",
        "write_report-layer-out-of-range"),
    row("tiny", lambda m, d: write_report(m, dim=10**6, out_dir=d / "r", progress=False), "out of range",
        "write_report-dim-out-of-range"),
    row("tiny", lambda m, d: write_report(m, dtype="float16", out_dir=d / "r", progress=False), "would be ignored",
        "write_report-dtype-of-a-loaded-model"),
    row("tiny", lambda m, d: compare_models([m, m], verify=True, out_dir=d / "r", progress=False),
        "one-model report", "compare_models-verify"),
    # --- the offline cache
    row("tiny", lambda m, d: _with_cache_at(d / "a_file"), "not a folder", "MASSIVE_LENS_CACHE-is-a-file"),
    row("tiny", lambda m, d: _with_cache_at(d / "a_file" / "cache"), "under a file",
        "MASSIVE_LENS_CACHE-under-a-file"),
    # --- the command line: one line on stderr and exit 2, before any work
    row("tiny", lambda m, d: _cli("report", "--out", d / "a_file"), "is a file, not a folder", "cli-report-out-file"),
    row("tiny", lambda m, d: _cli("report", "--out", d / "a_file" / "r"), "lies under the file",
        "cli-report-out-under-file"),
    row("tiny", lambda m, d: _cli("report", "--corpus", "missing.txt", "--out", d / "r"), "no such corpus file",
        "cli-report-missing-corpus"),
    row("tiny", lambda m, d: _cli("report", "--seq-len", "1", "--out", d / "r"), "seq_len >= 2",
        "cli-report-seq-len-1"),
    row("tiny", lambda m, d: _cli("report", "--n-seqs", "x"), "invalid int value", "cli-report-n-seqs-not-a-number"),
    row("tiny", lambda m, d: _cli("report", "--model", d / "tiny", "--layer", "7", "--out", d / "r"),
        "layer=7 is out of range", "cli-report-layer-out-of-range"),
    row("tiny", lambda m, d: _cli("report", "--model", d / "tiny", "--model", d / "tiny", "--verify", "--out",
                                  d / "r"), "one-model report", "cli-compare-verify"),
    row("tiny", lambda m, d: _cli("report", "--dtype", "int8", "--model", d / "tiny", "--out", d / "r"),
        "unknown dtype", "cli-report-dtype-int8"),
    row("tiny", lambda m, d: _cli("scan", "--model", d / "tiny", "--csv", d / "missing" / "f.csv"), "does not exist",
        "cli-scan-csv-missing-folder"),
    row("tiny", lambda m, d: _cli("scan", "--model", d / "tiny", "--csv", d / "a_folder"), "is a folder",
        "cli-scan-csv-is-a-folder"),
    row("tiny", lambda m, d: _cli("scan", "--model", d / "tiny", "--batch-size", "0"), "batch_size >= 1",
        "cli-scan-batch-size-zero"),
    row("tiny", lambda m, d: _cli("scan", "--model", d / "tiny", "--corpus", d / "binary.txt"), "is binary",
        "cli-scan-binary-corpus"),
    row("tiny", lambda m, d: _cli("train-compare", "--seeds", "x", "--out", d / "tc"), "whole numbers",
        "cli-train-compare-seeds-x"),
    row("tiny", lambda m, d: _cli("train-compare", "--out", d / "a_file"), "is a file", "cli-train-compare-out-file"),
    row("tiny", lambda m, d: _cli("train", "smoke", d / "a_file"), "is a file", "cli-train-out-file"),
    row("tiny", lambda m, d: _cli("train", "smoke", d / "run", "lr=nan"), "finite numbers", "cli-train-lr-nan"),
    row("tiny", lambda m, d: _cli("tokenize", "default", d / "t.bin", "--tokenizer", "bogus"), "invalid choice",
        "cli-tokenize-unknown-tokenizer"),
    # --- issue 21's should-fix rows: loaders, saved results, small ones
    row("tiny", lambda m, d: load_model(d / "a_folder"), "no config.json", "load_model-folder-without-config"),
    row("tiny", lambda m, d: load_model(d / "absent.GGUF"), "no GGUF file", "load_model-GGUF-suffix-any-case"),
    row("tiny", lambda m, d: load_model(d / "not_a_model.gguf"), "not a GGUF file", "load_model-gguf-not-gguf"),
    row("tiny", lambda m, d: load_model(d / "tiny", device="gpu:zero"), "unknown device", "load_model-bad-device"),
    row("tiny", lambda m, d: load_model(d / "tiny", name=""), "display name", "load_model-empty-name"),
    row("typed", "load_model(m, name=123)", "display name", "load_model-name-not-a-string"),
    row("typed", "decompose_attention(m, 'Hi there.', layers=1.5)", "must be an int",
        "decompose_attention-layers-float"),
    row("tiny", lambda m, d: patch_sink_from(m, "Other text here.", positions=[]), "positions is empty",
        "patch_sink_from-no-positions"),
    row("tiny", lambda m, d: patch_sink_from(m, "Other text here.", layers=[]), "layers is empty",
        "patch_sink_from-no-layers"),
    row("tiny", lambda m, d: fix_sink_term(m, calibration=calibrate(tiny_model("llama", num_hidden_layers=2),
                                                                    "Some calibration text. " * 8, progress=False)),
        "was measured on a model", "fix_sink_term-calibration-of-another-model"),
    row("tiny", lambda m, d: train_model("smoke", progress=False, **{**TRAIN, "data": ""}), "empty string",
        "train_model-data-empty-string"),
    row("tiny", lambda m, d: train_model("smoke", progress=False, **{**TRAIN, "data": "ab\ud800c " * 200}),
        "lone surrogate", "train_model-lone-surrogate"),
    row("tiny", lambda m, d: massive_lens.load(_damaged_result(d, "deep")), "nested too deeply",
        "load-deep-manifest"),
    row("tiny", lambda m, d: massive_lens.load(_damaged_result(d, "dtype")), "not a torch dtype",
        "load-dtype-not-dtype"),
    row("tiny", lambda m, d: massive_lens.load(_damaged_result(d, "field")), "has str for its field",
        "load-field-of-wrong-type"),
    row("tiny", lambda m, d: massive_lens.load(_damaged_result(d, "parquet")), "not a readable Parquet",
        "load-truncated-parquet"),
    row("tiny", lambda m, d: massive_lens.load(_oversized_run(d)), "does not match its stored weights",
        "load-train-run-asking-for-a-larger-model", heavy=True),
    row("tiny", lambda m, d: run_interventions(m, CORPUS, seq_len=16, n_seqs=2, progress=False, calibration=calibrate(
        tiny_model("llama", num_hidden_layers=2), "Some calibration text. " * 8, progress=False)),
        "was measured on a model", "run_interventions-calibration-of-another-model"),
    row("tiny", lambda m, d: scan_corpus(m, CORPUS, k=0, seq_len=16, max_tokens=64, progress=False),
        "largest magnitudes kept per layer", "scan_corpus-k-zero"),
    row("tiny", lambda m, d: compare_models([tiny_model("vit"), m], out_dir=d / "r", quick=True, progress=False),
        "is a vision model", "compare_models-vision-model"),
    row("tiny", lambda m, d: write_report(tiny_model("vit"), out_dir=d / "r", quick=True, progress=False),
        "a vision model reads images", "write_report-vision-model"),
    row("tiny", lambda m, d: _cli("intervene"), "name the evaluation text", "cli-intervene-all-defaults"),
    # --- tiny_model sizes a model cannot have
    row("tiny", lambda m, d: tiny_model("llama", hidden_size=0), "positive integers", "tiny_model-zero-width"),
    row("tiny", lambda m, d: tiny_model("gpt2", num_hidden_layers=-2), "positive integers",
        "tiny_model-negative-layers"),
    row("tiny", lambda m, d: tiny_model("gpt2", n_head=3, n_embd=32), "not a multiple of num_attention_heads",
        "tiny_model-heads-not-dividing-width"),
    row("tiny", lambda m, d: tiny_model("llama", num_key_value_heads=3), "not a multiple of num_key_value_heads",
        "tiny_model-kv-heads-not-dividing"),
    # --- issue 25's hand-over functions: masks, massive dims, the half-precision check, the SAE check
    row("tiny", lambda m, d: exclusion_mask(m, "Hello.", levels=("tertiary",)), "levels must be sink levels",
        "exclusion_mask-unknown-level"),
    row("tiny", lambda m, d: exclusion_mask(m, "Hello.", levels="nope"), "levels must be sink levels",
        "exclusion_mask-level-string"),
    row("tiny", lambda m, d: exclusion_mask(m, "Hello.", outliers="drop"), "outliers must be one of",
        "exclusion_mask-outliers-drop"),
    row("tiny", lambda m, d: exclusion_mask(m, ""), "empty text", "exclusion_mask-empty-text"),
    *[row("tiny", lambda m, d, bad=bad: massive_dims(m, CORPUS, seq_len=16, n_seqs=2, persistence=bad),
          "persistence is the share of layers", f"massive_dims-persistence-{bad}")
      for bad in (0, 1.5, -0.25, float("nan"), True)],
    row("tiny", lambda m, d: read_dims(d / "other.json"), "is not a massive_lens.massive_dims file",
        "read_dims-other-schema"),
    row("tiny", lambda m, d: read_dims(d / "broken.json"), "cannot read", "read_dims-broken-json"),
    row("tiny", lambda m, d: read_dims(d / "missing.json"), "cannot read", "read_dims-missing-file"),
    row("tiny", lambda m, d: read_dims(d / "partial.json"), "missing or malformed field", "read_dims-partial"),
    # --- issue 37: hand-over files trusted too much, saved tables that are links out of their folder
    row("tiny", lambda m, d: read_dims("/dev/zero"), "is not a regular file", "read_dims-a-device"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "huge")), "bytes, more than the", "read_dims-huge-file"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "deep")), "nested too deeply", "read_dims-deep-json"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "disagree")), "are not the dims its \"details\" keep out",
        "read_dims-dims-disagree-with-details"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "dim-past-d_model")), "a detail's dim must be an integer in [0, ",
        "read_dims-dim-past-d_model"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "dim-float")), "a detail's dim must be an integer",
        "read_dims-dim-float"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "d_model-negative")), "d_model must be an integer in [1, ",
        "read_dims-d_model-negative"),
    row("tiny", lambda m, d: read_dims(_dims_file(d, "layer-past-n_layers")), "dim 0's layers must be an integer",
        "read_dims-layer-past-n_layers"),
    row("tiny", lambda m, d: massive_lens.load(_damaged_result(d, "symlink")), "names a file outside its folder",
        "load-table-linked-outside-the-folder"),
    # --- issue 37: silently resolved or misleading
    row("tiny", lambda m, d: quantize_grid(m, CORPUS, settings=["W4A4+hadamard+orthogonal"], seq_len=16, n_seqs=2),
        "+hadamard and +orthogonal both set rotation", "quantize_grid-two-rotations"),
    row("tiny", lambda m, d: quantize_grid(m, CORPUS, settings="W4A4+kvsink+prefix", seq_len=16, n_seqs=2),
        "+kvsink and +prefix both set keep_sinks", "quantize_grid-kvsink-and-prefix"),
    row("tiny", lambda m, d: streaming_window(m, CORPUS, window=8, sinks=(0, 1), seq_len=32, n_seqs=1, census_len=0),
        "census_len is how many tokens per sequence the sink census reads", "streaming_window-census_len-zero"),
    row("overflow", lambda m, d: streaming_window(m, CORPUS, window=8, sinks=(0, 1), seq_len=32, n_seqs=1,
                                                  census=False), "holds NaN or inf", "streaming_window-overflow"),
    row("tiny", lambda m, d: head_curve(m, TEXT * 8, calibration=TEXT[:30], shares=(0.25,), draws=1, seq_len=16,
                                        n_seqs=2), "is evaluation sequence 0", "head_curve-calibration-shorter"),
    # --- issue 37: a calibration of another model (same sizes) refused by model identity, in every consumer
    *[row("tiny", lambda m, d, build=build, family=family: build(m, calibration=calibrate(
        tiny_model(family), "Some calibration text. " * 8, progress=False)),
        "its means and sink dims belong to that model", f"{build.__name__}-calibration-of-{family}")
      for build, family in ((ablate_massive, "qwen2"), (fix_sink_term, "gpt2"), (remove_sink_attention, "gemma3"))],
    # --- issue 37: wrong types, checked where the values are (the typed rows run without the type hook)
    row("typed", "find_massive(m, 'The cat.', criterion='sun')", "criterion must be a massive_lens.Criterion",
        "find_massive-criterion-a-name"),
    row("typed", "find_massive(m, 'The cat.', criterion=3)", "criterion must be a massive_lens.Criterion",
        "find_massive-criterion-a-number"),
    row("typed", "decompose_attention(m, 'The cat sat.', sinks=3)", "a single position goes in a list",
        "decompose_attention-sinks-an-int"),
    row("typed", "sink_kv(m, 'The cat sat.', sinks='bos')", "sinks must be None", "sink_kv-sinks-a-name"),
    row("typed", "exclusion_mask(m, 'The cat sat.', prepend_bos='yes')", "prepend_bos must be True, False or None",
        "exclusion_mask-prepend_bos-yes"),
    row("typed", "over_mixing(m, 'The cat sat on the mat. ' * 8, seq_len=16, n_seqs=2, seed='x')",
        "seed must be an integer", "over_mixing-seed-x"),
    row("typed", "repeated_token_probe(m, 'a', 8, like='0.5')", "like is a share",
        "repeated_token_probe-like-a-string"),
    row("tiny", lambda m, d: sae_check(m, _sae(encode=lambda x: x.tolist()), CORPUS, seq_len=16, n_seqs=2),
        "encode returned a list", "sae_check-encode-returns-a-list"),
    # --- issue 37: the command line
    row("tiny", lambda m, d: _cli("quantize", "--model", d / "tiny", "--settings", "W8A8", "--seq-len", "8",
                                  "--n-seqs", "1", "--out-dir", d / "a_file" / "q"), "lies under the file",
        "cli-quantize-out-dir-unwritable"),
    row("tiny", lambda m, d: _cli("sinks", "--model", d / "tiny", "--text", ""), "--text is empty",
        "cli-sinks-empty-text"),
    row("tiny", lambda m, d: _cli("dims", "--model", d / "tiny", "--json", ""), "is a folder; give a file name",
        "cli-dims-empty-json"),
    pytest.param("tiny", lambda m, d: _cli("scan", "--model", d / "tiny", "--device", "cuda"), "sees no cuda device",
                 id="cli-scan-cuda-on-a-cpu-torch",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")),
    row("tiny", lambda m, d: precision_check(m, CORPUS, seq_len=16, n_seqs=2, dtypes=("float8",)), "float8",
        "precision_check-float8"),
    row("tiny", lambda m, d: precision_check(m, CORPUS, seq_len=16, n_seqs=2, dtypes=("float16", "float16")),
        "each dtype once", "precision_check-dtype-twice"),
    row("tiny", lambda m, d: precision_check(m, CORPUS, seq_len=16, n_seqs=2, dtypes=()), "each dtype once",
        "precision_check-no-dtypes"),
    row("tiny", lambda m, d: precision_check(m, CORPUS, seq_len=16, n_seqs=2, tolerance=-1), "tolerance is",
        "precision_check-tolerance-negative"),
    row("tiny", lambda m, d: precision_check(m, CORPUS, seq_len=16, n_seqs=2, tolerance=float("nan")),
        "tolerance is", "precision_check-tolerance-nan"),
    row("tiny", lambda m, d: precision_check(tiny_model("llama").to(torch.bfloat16, print_details=False), CORPUS,
                                             seq_len=16, n_seqs=2), "measures in float32",
        "precision_check-bfloat16-model"),
    row("tiny", lambda m, d: sae_check(m, m.cfg, CORPUS, seq_len=16, n_seqs=2), "no encode/decode",
        "sae_check-not-an-sae"),
    row("tiny", lambda m, d: sae_check(m, _sae(hook_name=None), CORPUS, seq_len=16, n_seqs=2),
        "sae.cfg.metadata.hook_name", "sae_check-no-hook-name"),
    row("tiny", lambda m, d: sae_check(m, _sae(hook="blocks.7.hook_resid_post"), CORPUS, seq_len=16, n_seqs=2),
        "has no hook 'blocks.7.hook_resid_post', which the SAE reads", "sae_check-hook-missing"),
    row("tiny", lambda m, d: sae_check(m, _sae(d_in=32), CORPUS, seq_len=16, n_seqs=2), "the SAE takes d_in=32",
        "sae_check-d_in-mismatch"),
    row("tiny", lambda m, d: sae_check(m, _sae(d_in="64"), CORPUS, seq_len=16, n_seqs=2), "cfg.d_in",
        "sae_check-d_in-not-an-int"),
    row("tiny", lambda m, d: sae_check(m, _sae(scale=float("nan")), CORPUS, seq_len=16, n_seqs=2),
        "reconstruction of blocks.1.hook_resid_post (sequence 0) holds NaN or inf", "sae_check-nan-reconstruction"),
    row("tiny", lambda m, d: sae_check(m, _sae(decode=lambda z: z), CORPUS, seq_len=16, n_seqs=2), "has shape",
        "sae_check-reconstruction-of-another-shape"),
    # --- the sink tasks' command (issue 48): refused before anything trains or is read
    row("tiny", lambda m, d: _cli("tasks", "run", "--threads", "-1", "--root", d / "r"), "threads must be",
        "cli-tasks-threads-negative"),
    row("tiny", lambda m, d: _cli("tasks", "run", "--root", d / "a_file", "--tasks", "trigger_conditional",
                                  "--seeds", "0"), "cannot use", "cli-tasks-root-is-a-file"),
    row("tiny", lambda m, d: _cli("tasks", "run", "--steps", "0", "--root", d / "r"), "steps=0",
        "cli-tasks-steps-zero"),
    row("tiny", lambda m, d: ((d / "p.md").write_text("<!-- gen:answer -->\n<!-- gen:ends -->\n"),
                                  _cli("tasks", "page", "--root", d / "none", "--page", d / "p.md"))[1],
        "no sink-task runs at",
        "cli-tasks-page-missing-root"),
]


def _as_found(model: Any) -> tuple[Any, ...]:
    param = next(model.parameters())
    return param.dtype, param.device, model.training


@pytest.fixture(scope="module")
def untyped() -> dict[str, list[str]]:
    """What each ``typed`` row raises without the type checks, on a tiny llama of its own: {code: [type, message]}."""
    codes = [p.values[1] for p in CASES if p.values[0] == "typed"]
    names = (compare_variants, decompose_attention, exclusion_mask, find_massive, load_model, over_mixing,
             repeated_token_probe, scan_corpus, sink_kv)
    return untyped_errors(codes, {**{f.__name__: f for f in names}, "m": tiny_model("llama")})


@pytest.mark.parametrize(("model_key", "call", "expected"), CASES)
def test_bad_input_is_a_clear_error(request, files, model_key, call, expected):
    if model_key == "typed":
        kind, message = request.getfixturevalue("untyped")[call]
        assert kind == "MassiveLensError" and expected in message, (kind, message)
        return
    model = request.getfixturevalue("models")[model_key]
    before = _as_found(model)
    with untouched(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # precision warnings of the float16 model
        with pytest.raises(MassiveLensError, match=re.escape(expected)):
            call(model, files)
    assert _as_found(model) == before


def test_the_table_is_long_enough():
    assert len(CASES) >= 80
    assert sum(p.id.startswith("cli-") for p in CASES) >= 15
