"""The massive-lens command on a small model saved to a local folder (offline)."""

from __future__ import annotations

import pytest

from massive_lens.cli import build_parser, main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from massive_lens.models import byte_tokenizer

    folder = tmp_path_factory.mktemp("tiny")
    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=128, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("report", "scan", "trace", "intervene", "sinks", "mask", "dims", "precision", "train-compare",
                    "tokenize"):
        assert command in out


def test_scan(model_dir, tmp_path, capsys):
    csv = tmp_path / "freq.csv"
    code = main(["scan", "--model", model_dir, "--corpus", "Some text. " * 200, "--seq-len", "32",
                 "--max-tokens", "128", "--ratio-threshold", "5", "--abs-threshold", "0", "--csv", str(csv)])
    out = capsys.readouterr().out
    assert code == 0 and "4 sequences, 128 tokens" in out and csv.exists()


def test_tokenize_writes_a_token_file_training_can_read(tmp_path, capsys):
    from massive_lens.models import byte_tokenizer
    from massive_lens.train.data import token_stream

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be. " * 20)
    out = tmp_path / "tokens.bin"
    assert main(["tokenize", str(corpus), str(out), "--tokenizer", "byte", "--max-chars", "100"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert len(token_stream(str(out), byte_tokenizer())) == 100


def test_trace(model_dir, capsys):
    assert main(["trace", "--model", model_dir, "--text", "Hello there.", "--dim", "3", "--pos", "0"]) == 0
    assert "dim 3" in capsys.readouterr().out


def test_sinks_prints_and_saves_each_analysis(model_dir, tmp_path, capsys):
    from massive_lens import load

    out = tmp_path / "sinks"
    assert main(["sinks", "--model", model_dir, "--corpus", "Some text. " * 200, "--seq-len", "32", "--n-seqs", "2",
                 "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 sequence(s), sink = a head gives it > 0.3" in printed and "sink key norm" in printed
    assert [type(load(out / name)).__name__ for name in ("census", "kv", "dormant")] == \
        ["SinkCensus", "SinkKV", "DormantHeads"]
    assert main(["sinks", "--model", model_dir, "--only", "kv", "--text", "Hello there."]) == 0
    assert "sink key norm" in capsys.readouterr().out
    assert main(["sinks", "--model", model_dir, "--only", "census,keys"]) == 2
    assert "--only takes some of census,kv,dormant" in capsys.readouterr().err


def test_mask_and_dims_hand_over(model_dir, tmp_path, capsys):
    import json

    corpus = ["Some text. " * 200]
    assert main(["mask", "--model", model_dir, "--text", "Hello there. Bye now.", "--levels", "primary,secondary"]) == 0
    out = capsys.readouterr().out
    assert "positions left out" in out and "Sink levels primary, secondary" in out and "Token ids" in out
    assert main(["mask", "--model", model_dir, "--corpus", corpus[0], "--seq-len", "16", "--n-seqs", "2",
                 "--thresholds"]) == 0
    out = capsys.readouterr().out.split("\n\n")  # the mask's summary, then the thresholds'
    assert "positions left out" in out[0] and "resid_post, 2 sequences: " in out[1]
    path = tmp_path / "dims.json"
    assert main(["dims", "--model", model_dir, "--corpus", corpus[0], "--seq-len", "16", "--n-seqs", "2",
                 "--json", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert json.loads(path.read_text())["schema"]
    assert main(["mask", "--model", model_dir, "--text", "Hi.", "--levels", "tertiary"]) == 2
    assert "tertiary" in capsys.readouterr().err


def test_errors_are_reported_not_raised(capsys):
    assert main(["scan", "--model", "/no/such/model.gguf"]) == 2
    assert "no GGUF file" in capsys.readouterr().err


def test_precision(model_dir, capsys):
    code = main(["precision", "--model", model_dir, "--corpus", "Some text. " * 200, "--seq-len", "16",
                 "--n-seqs", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "float16: SAFE" in out and "bfloat16: SAFE" in out and "Confirmed by running" in out
    assert main(["precision", "--model", model_dir, "--dtypes", "float8"]) == 2
    assert "float8" in capsys.readouterr().err
