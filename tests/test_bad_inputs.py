"""Bad inputs never give a silent wrong answer (issue #12).

One table, :data:`CASES`: each row is a call that must fail with a ``MassiveLensError`` whose
message holds the expected words (what was wrong, and what to do). After every row the
model is as found: no hooks left, weights bit-identical, same dtype, device and train/eval
mode. Rows run on a tiny llama (``tiny``) or on a copy of it in float16 whose layer 2
overflows (``overflow``), built once per module. Rows marked ``typed`` pass a value the
annotations already refuse, so the tests' type-checking import hook would stop them first:
they run, as source text, in a fresh interpreter without it (once for all of them).

Beside the table: the corpus-path rule's accepted cases, two threads on one model, and the
command line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import untouched

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
from massive_lens.cli import main
from massive_lens.core.corpora import iter_texts
from massive_lens.interventions import calibrate, remove_sink_attention
from massive_lens.train import compare_variants

TEXT = "The cat sat on the mat. The dog ran. " * 2
CORPUS = "a b c d e f g h " * 40
FLOAT_IDS = torch.tensor([[256.0, 72.7, 105.2]])  # the example: truncated to ints before


def _overflowing() -> Any:
    """A tiny llama in float16 whose layer-2 MLP overflows (inf, then NaN) on any text."""
    model = tiny_model("llama").to(torch.float16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layers.2." in name and ("up_proj" in name or "gate_proj" in name):
                param.fill_(100.0)
    return model


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
def models() -> dict[str, Any]:
    return {"tiny": tiny_model("llama"), "overflow": _overflowing()}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad_inputs")
    (folder / "binary.txt").write_bytes(b"\x00\x01\x02 not text \x00" * 50)
    (folder / "a_folder").mkdir()
    return folder


def row(model: str, call: Any, expected: str, name: str) -> Any:
    return pytest.param(model, call, expected, id=name)


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
    row("tiny", lambda m, d: compare_variants(["softmax"], "smoke", seeds=[], progress=False), "seeds is empty",
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
    row("overflow", lambda m, d: scan_corpus(m, CORPUS, seq_len=16, max_tokens=64, progress=False),
        "bfloat16", "scan_corpus-overflow"),
    row("overflow", lambda m, d: perplexity(m, CORPUS, seq_len=16, n_seqs=2, progress=False), "NaN or inf logits",
        "perplexity-overflow"),
    row("overflow", lambda m, d: measure_outliers(m, CORPUS, seq_len=16, n_seqs=2), "holds NaN or inf",
        "measure_outliers-overflow"),
]


def _as_found(model: Any) -> tuple[Any, ...]:
    param = next(model.parameters())
    return param.dtype, param.device, model.training


_UNTYPED = """
import json, sys, warnings
warnings.simplefilter("ignore")
from massive_lens import MassiveLensError, find_massive, scan_corpus, tiny_model
m = tiny_model("llama")
out = {}
for code in json.loads(sys.argv[1]):
    try:
        eval(code)
        out[code] = ["no error", ""]
    except Exception as exc:
        out[code] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def untyped() -> dict[str, list[str]]:
    """What each ``typed`` row raises without the type-checking hook: {code: [type, message]}."""
    codes = [p.values[1] for p in CASES if p.values[0] == "typed"]
    done = subprocess.run([sys.executable, "-c", _UNTYPED, json.dumps(codes)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    assert len(CASES) >= 50


# --------------------------------------------------------------------------- accepted inputs


def test_corpus_path_rule(tmp_path, monkeypatch):
    """Existing paths are files; a list item, text with spaces, or a number is text."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("file contents\n")
    assert list(iter_texts("notes.txt")) == ["file contents\n"]
    assert list(iter_texts(tmp_path / "notes.txt")) == ["file contents\n"]
    assert list(iter_texts(["missing.csv"])) == ["missing.csv"]  # list items are always text
    assert list(iter_texts("see data/file.txt for more")) == ["see data/file.txt for more"]
    assert list(iter_texts("3.14")) == ["3.14"]


def test_an_intervention_is_reusable_one_with_at_a_time(models):
    model = models["tiny"]
    tokens = torch.tensor([[256, 72, 105, 33]])
    fx = _intervention(model)
    with untouched(model):
        with fx:
            first = model(tokens)
        with fx:
            again = model(tokens)
        assert not fx.active
        via_hooks = perplexity(model, CORPUS, seq_len=16, n_seqs=2, hooks=fx, progress=False)
    assert torch.equal(first, again) and via_hooks.loss > 0


def test_load_model_passes_a_model_through_when_arguments_match(models):
    model = models["tiny"]
    assert load_model(model) is model
    assert load_model(model, dtype="float32", device="cpu") is model


def test_load_model_says_it_takes_over_a_hugging_face_model():
    from massive_lens.models import byte_tokenizer

    hf = _hf_model().train()
    with pytest.warns(UserWarning, match="takes over the LlamaForCausalLM"):
        bridge = load_model(hf, tokenizer=byte_tokenizer())
    assert not hf.training and not bridge.training  # what the warning says happened


def test_whole_number_ids_of_any_integer_dtype_are_accepted(models):
    model = models["tiny"]
    as_long = find_massive(model, torch.tensor([[256, 72, 105]])).profile
    as_int32 = find_massive(model, torch.tensor([[256, 72, 105]], dtype=torch.int32)).profile
    assert as_long.equals(as_int32)


def test_fewer_sequences_than_asked_is_said(models):
    with pytest.warns(UserWarning, match="only 1 of the 5 sequences"):
        result = perplexity(models["tiny"], "abc def ghi", seq_len=8, n_seqs=5, progress=False)
    assert len(result.per_seq) == 1


# --------------------------------------------------------------------------- threads


def test_two_threads_on_one_model_get_the_serial_answers(models):
    """find_massive and perplexity at once on one model: each thread's hooks stay its own."""
    model = models["tiny"]
    expected_find = find_massive(model, TEXT).profile
    expected_ppl = perplexity(model, CORPUS, seq_len=16, n_seqs=4, progress=False).per_seq
    problems: list[str] = []
    start = threading.Barrier(2)

    def finds() -> None:
        start.wait()
        for _ in range(15):
            try:
                if not find_massive(model, TEXT).profile.equals(expected_find):
                    problems.append("find_massive differs")
            except Exception as exc:  # noqa: BLE001 - any crash is a failure to report
                problems.append(repr(exc))

    def perplexities() -> None:
        start.wait()
        for _ in range(15):
            try:
                if not torch.equal(perplexity(model, CORPUS, seq_len=16, n_seqs=4, progress=False).per_seq,
                                   expected_ppl):
                    problems.append("perplexity differs")
            except Exception as exc:  # noqa: BLE001
                problems.append(repr(exc))

    with untouched(model):
        threads = [threading.Thread(target=finds), threading.Thread(target=perplexities)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not problems, problems[:3]


# --------------------------------------------------------------------------- command line


def test_cli_unknown_tokenizer_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenize", "default", str(tmp_path / "tokens.bin"), "--tokenizer", "bogus"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "tokens.bin").exists()


def test_cli_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    import massive_lens.cli as cli

    def interrupted(args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "scan", (interrupted, cli.COMMANDS["scan"][1]))
    assert main(["scan"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "massive-lens scan: interrupted" and "Traceback" not in err


# --------------------------------------------------------------------------- the offline cache


@pytest.mark.parametrize("manifest", ["[]", '{"version": 1}', '{"version": 1, "files": []}',
                                      '{"version": 1, "files": {"model.safetensors": {}}}',
                                      '{"version": 1, "files": {"model.safetensors": 3}}', '"text"'])
def test_an_odd_cache_manifest_means_a_rebuild_not_a_crash(tmp_path, manifest):
    from massive_lens.models import byte_tokenizer
    from massive_lens.offline import cache_is_valid, write_cache

    folder = tmp_path / "cache"
    write_cache(folder, _hf_model(), byte_tokenizer())
    assert cache_is_valid(folder)
    (folder / "manifest.json").write_text(manifest)
    assert cache_is_valid(folder) is False
