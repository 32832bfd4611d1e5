from __future__ import annotations

import pytest
import torch

import massive_lens.core.tokens as tokens
from massive_lens import MassiveLensError, tiny_model
from massive_lens.core.corpora import default_text, iter_texts, token_batches
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import prefix_ids, text_ids


def test_default_text_is_offline_prose():
    text = default_text()
    assert len(text) > 100_000 and text.count(". ") > 1000


def test_file_streaming_cuts_at_line_ends(tmp_path, monkeypatch):
    import massive_lens.core.corpora as corpora

    monkeypatch.setattr(corpora, "_PIECE_CHARS", 50)
    path = tmp_path / "a.txt"
    lines = [f"line number {i} has words" for i in range(40)]
    path.write_text("\n".join(lines))
    pieces = list(iter_texts(str(path)))
    assert len(pieces) > 5 and "".join(pieces) == path.read_text()
    assert all(p.endswith("\n") for p in pieces[:-1])


def test_token_batches_shapes_and_bos():
    view = ModelView(tiny_model("llama"))
    batches = list(token_batches(view, "word. " * 400, seq_len=16, batch_size=3, max_tokens=16 * 7))
    assert [b.shape[0] for b in batches] == [3, 3, 1]
    assert all(b.shape[1] == 16 for b in batches)
    assert all((b[:, 0] == view.tokenizer.bos_token_id).all() for b in batches)


def test_bad_corpora(tmp_path):
    view = ModelView(tiny_model("llama"))
    with pytest.raises(MassiveLensError, match="no such corpus file"):
        list(iter_texts("missing/file.txt"))
    with pytest.raises(MassiveLensError, match="fewer than"):
        list(token_batches(view, "short", seq_len=64))
    with pytest.raises(MassiveLensError, match="context"):
        list(token_batches(view, None, seq_len=10_000))
    with pytest.raises(MassiveLensError, match="strings"):
        list(iter_texts([1, 2]))


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_prefix_ids_are_the_whole_texts_first_ids(which, default_model):
    tok = (default_model if which == "default" else tiny_model("llama")).tokenizer
    text = default_text()[:200_000]
    whole = text_ids(tok, text)
    for need in (1, 127, 1000, 5_000, 20_011, len(whole) - 3, len(whole) + 10):
        assert prefix_ids(tok, text, need) == whole[:need], need
    assert prefix_ids(tok, text, None) == whole


def test_a_few_sequences_tokenize_only_a_prefix_of_a_long_text(monkeypatch):
    seen = []
    real = tokens.text_ids
    monkeypatch.setattr(tokens, "text_ids", lambda tok, text: seen.append(len(text)) or real(tok, text))
    view = ModelView(tiny_model("llama"))
    got = torch.cat(list(token_batches(view, None, seq_len=64, batch_size=2, max_tokens=64 * 4)))
    assert got.shape == (4, 64) and max(seen) < len(default_text()) / 50
    whole = real(view.tokenizer, default_text())[: 4 * 63]
    assert got[:, 1:].flatten().tolist() == whole
