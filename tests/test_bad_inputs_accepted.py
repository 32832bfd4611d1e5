"""Bad inputs, the other side (issue #12): what is accepted and how (the corpus-path rule,
interventions reused one ``with`` at a time, models passed through, fewer sequences than
asked said with a warning), two threads on one model, the command line's Ctrl-C, and a
cache manifest of the wrong shape. The table of refused inputs is ``test_bad_inputs.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from helpers import untouched

from massive_lens import find_massive, load_model, perplexity
from massive_lens.cli import main
from massive_lens.core.corpora import iter_texts
from massive_lens.interventions import remove_sink_attention
from massive_lens.quant import quantize_grid

TEXT = "The cat sat on the mat. The dog ran. " * 2
CORPUS = "a b c d e f g h " * 40


def _intervention(model: Any) -> Any:
    return remove_sink_attention(model, calibration="Some calibration text. " * 8)


def _hf_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2))


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


def test_one_low_bit_setting_name_alone_is_one_setting(models):
    """Issue 37: ``settings="W4A4"`` was read letter by letter ("bad low-bit setting 'W'")."""
    model = models["tiny"]
    with untouched(model):
        grid = quantize_grid(model, CORPUS, settings="W4A4", seq_len=16, n_seqs=2)
    assert grid.to_frame()["setting"].tolist() == ["W4A4"]


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
    from massive_lens.models.cache import cache_is_valid, write_cache

    folder = tmp_path / "cache"
    write_cache(folder, _hf_model(), byte_tokenizer())
    assert cache_is_valid(folder)
    (folder / "manifest.json").write_text(manifest)
    assert cache_is_valid(folder) is False
