"""Comparing models on one page (``compare_models``, ``massive-lens report --model A --model B``),
on tiny models: a llama with a planted massive activation beside a plain qwen2."""

from __future__ import annotations

import re

import pytest
from helpers import plant_massive, untouched

from massive_lens import MassiveLensError, tiny_model
from massive_lens.cli import main
from massive_lens.models import byte_tokenizer
from massive_lens.report import compare_models

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The comparison page of a planted tiny llama (MLP 1, neuron 5 writes 600 into dim 7 at
    BOS) and a plain tiny qwen2, both checked to be left untouched."""
    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    plant_massive(llama, layer=1, neuron=5, dim=7, value=600.0, trigger=llama.tokenizer.bos_token_id, trigger_dim=3)
    out = tmp_path_factory.mktemp("compare")
    with untouched(llama), untouched(qwen):
        page = compare_models([llama, qwen], out_dir=out, quick=True, progress=False)
    return page, (out / "report.md").read_text()


def _row(markdown: str, label: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split(" | ")][1:]


def test_one_column_per_model(compared):
    page, md = compared
    assert "|  | tiny-llama | tiny-qwen2 |" in md
    assert _row(md, "architecture") == ["LlamaForCausalLM", "Qwen2ForCausalLM"]
    assert _row(md, "first token") == ["BOS", "the text's own"]


def test_massive_activations_side_by_side(compared):
    _, md = compared
    assert _row(md, "their dims, largest first") == ["7", "none"]
    assert _row(md, "token-specific massive (position, dim) pairs in the text")[1] == "0"
    assert ", layer " in _row(md, r"largest \|value\| (x median), at layer")[0]
    assert _row(md, "outlier dimensions (massive at most tokens of a layer), listed apart") == ["none", "none"]
    kinds = _row(md, "token kinds (pairs)")
    assert kinds[0].startswith("bos") and kinds[1] == "none"
    assert _row(md, "layers where massive (any scope)")[0].startswith("1-")
    assert "dim 7 at bos: 100%" in _row(md, "over the corpus: dim at token kind, share of sequences")[0]


def test_origin_side_by_side(compared):
    _, md = compared
    entry = _row(md, "traced entry")
    assert entry[0].startswith("dim 7 at") and "not massive" in entry[1]
    assert _row(md, "births")[0].startswith("mlp 1: +600")
    assert _row(md, "birth neurons (share of their MLP's write)")[0].startswith("MLP 1: 5 (")
    assert "model.layers.1.mlp.down_proj.weight[7, 5]" in _row(md, "candidate super weights")[0]


def test_interventions_side_by_side(compared):
    _, md = compared
    zero = _row(md, "zero")
    assert zero[0].startswith("x") and zero[1] == "-"  # qwen2's calibration text has nothing massive
    assert all(cell.startswith("x") for cell in _row(md, "sink_term_mean"))
    assert "tiny-qwen2: No massive activations in the calibration text" in md
    assert "zero_every" in md and "every-layer row was not needed" in md  # what each setting does, and the '-'


def test_rebuilt_rows_are_marked_in_the_ratio_cells():
    import pandas as pd

    from massive_lens.report.compare_cells import REBUILT_MARK, setting_ratio

    frame = pd.DataFrame(dict(setting=["zero", "mean"], ratio=[1.106, 1.0], ratio_low=[1.05, 0.99],
                              ratio_high=[1.2, 1.01], rebuilt=[True, False]))
    assert setting_ratio(frame, "zero").endswith(REBUILT_MARK) and REBUILT_MARK not in setting_ratio(frame, "mean")


def test_profiles_overlaid_and_page_self_contained(compared):
    page, md = compared
    figures = sorted((page.parent / "figures").glob("*.png"))
    assert len(figures) == 1 and figures[0].name in md
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 1
    assert re.findall("(?:src|href)=.?https?:", html) == []


def test_needs_two_models():
    with pytest.raises(MassiveLensError, match="two or more"):
        compare_models([tiny_model("llama")], progress=False)
    with pytest.raises(MassiveLensError, match="two or more"):
        compare_models("default", progress=False)
    with pytest.raises(MassiveLensError, match="non-empty"):
        compare_models([tiny_model("llama"), tiny_model("gpt2")], text=" ", progress=False)


def test_cli_report_with_two_models(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    folders = [tmp_path / "llama-one", tmp_path / "gpt2-two"]
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, max_position_embeddings=128,
                                 bos_token_id=tok.bos_token_id)).save_pretrained(folders[0])
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=3, n_head=2, n_positions=128,
                               bos_token_id=tok.bos_token_id)).save_pretrained(folders[1])
    for folder in folders:
        tok.save_pretrained(folder)
    out = tmp_path / "both"
    assert main(["report", "--model", str(folders[0]), "--model", str(folders[1]), "--quick", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert md.startswith("# massive_lens comparison: llama-one vs gpt2-two")  # folder names, never paths
    assert _row(md, "layers") == ["2", "3"]


def test_a_cell_is_empty_only_where_its_analysis_did_not_run_and_says_why():
    from massive_lens.report.compare import ModelResults
    from massive_lens.report.compare_cells import MISSING, side_by_side

    ran = ModelResults("ran", {}, 2, notes=[])
    ran.found = type("Found", (), {"layers": (0, 1)})()
    failed = ModelResults("failed", {}, 2, notes=[("find_massive", "failed: find_massive did not run: too long")])
    rows = [("layers where massive", "found", lambda r: f"{min(r.found.layers)}-{max(r.found.layers)}"),
            ("corpus", "scan", lambda r: r.scan.n_tokens), ("layers", None, lambda r: r.n_layers)]
    frame = side_by_side([ran, failed], rows)
    assert frame["ran"].tolist() == ["0-1", f"{MISSING} (scan_corpus did not run)", "2"]
    assert frame["failed"].tolist() == [f"{MISSING} (find_massive did not run; see the note below)",
                                        f"{MISSING} (scan_corpus did not run)", "2"]


@pytest.mark.parametrize("bug", [lambda r: r.found.no_such_field, lambda r: r.found.layers[5],
                                 lambda r: {"a": 1}["b"]])
def test_a_bug_in_a_cell_raises_instead_of_leaving_it_empty(bug):
    from massive_lens.report.compare import ModelResults
    from massive_lens.report.compare_cells import side_by_side

    r = ModelResults("ran", {}, 2)
    r.found = type("Found", (), {"layers": (0, 1)})()
    with pytest.raises((AttributeError, IndexError, KeyError)):
        side_by_side([r], [("row", "found", bug)])
