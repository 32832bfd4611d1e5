from __future__ import annotations

import pytest

from massive_lens import MassiveLensError, tiny_model
from massive_lens.core.corpora import default_text, iter_texts, token_batches
from massive_lens.core.model_view import ModelView


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
