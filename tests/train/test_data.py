"""Training data: token files on disk (memmap) train exactly like the text they came from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TRAIN_TEXT
from safetensors import safe_open
from safetensors.torch import save_file

from massive_lens.errors import MassiveLensError
from massive_lens.models import byte_tokenizer
from massive_lens.train.checkpoint import META_KEY
from massive_lens.train.data import read_token_file, sample_batch, token_stream, write_token_file
from massive_lens.train.trainer import train_model

TINY = dict(model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16), batch_size=4, steps=4,
            warmup_steps=2, log_every=1, eval_every=2, eval_batches=1, ckpt_every=4)


def test_a_token_file_holds_the_text_stream_and_trains_identically(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TRAIN_TEXT)
    out = write_token_file(str(corpus), "byte", tmp_path / "tokens.bin", progress=False)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert (meta["dtype"], meta["tokenizer"], meta["n_tokens"]) == ("uint16", "byte", len(TRAIN_TEXT))
    assert not (tmp_path / "tokens.bin.tmp").exists()
    stream = token_stream(str(out), byte_tokenizer())
    assert isinstance(stream, np.memmap)
    assert np.array_equal(stream, token_stream(str(corpus), byte_tokenizer()).numpy())
    from_text = train_model("smoke", progress=False, data=str(corpus), **TINY)
    from_file = train_model("smoke", progress=False, data=str(out), **TINY)
    assert [h["loss"] for h in from_file.history] == [h["loss"] for h in from_text.history]
    assert from_file.val_loss == from_text.val_loss


def test_memmap_and_tensor_streams_give_the_same_batches():
    values = np.arange(500, dtype=np.uint16)
    for bos in (7, None):
        a = sample_batch(values, 3, 9, bos=bos, seed=1, step=2)
        b = sample_batch(torch.arange(500), 3, 9, bos=bos, seed=1, step=2)
        assert a.dtype == b.dtype == torch.long and torch.equal(a, b) and a.shape == (3, 9)
    assert (sample_batch(values, 3, 9, bos=None, seed=1, step=2).diff(dim=1) == 1).all()


def test_bad_token_files_raise(tmp_path):
    with pytest.raises(MassiveLensError, match="no token file"):
        read_token_file(tmp_path / "missing.bin", byte_tokenizer())
    with pytest.raises(MassiveLensError, match=r"\.bin"):
        write_token_file("abc", "byte", tmp_path / "tokens.npy", progress=False)
    out = write_token_file("hello world " * 10, "byte", tmp_path / "t.bin", progress=False)
    small = type("Tok", (), {"__len__": lambda self: 100})()
    with pytest.raises(MassiveLensError, match="tokenizer='byte'"):
        read_token_file(out, small)
    out.write_bytes(out.read_bytes()[:10])  # truncated
    with pytest.raises(MassiveLensError, match="incomplete"):
        read_token_file(out, byte_tokenizer())


def test_prepend_bos_false_trains_on_bare_windows_and_the_model_knows_it(monkeypatch):
    import massive_lens.train.loop as loop  # where the training steps draw their batches

    seen = []
    monkeypatch.setattr(loop, "sample_batch", lambda *a, **k: seen.append(a[3]) or sample_batch(*a, **k))
    bare = train_model("smoke", progress=False, data=TRAIN_TEXT, prepend_bos=False, **TINY)
    assert set(seen) == {None}
    assert bare.model.cfg.default_prepend_bos is False
    bos = bare.model.tokenizer.bos_token_id
    assert bare.model.to_tokens("ab")[0, 0] != bos
    seen.clear()
    with_bos = train_model("smoke", progress=False, data=TRAIN_TEXT, **TINY)
    assert set(seen) == {bos} and with_bos.model.to_tokens("ab")[0, 0] == bos


def test_gpu_presets_read_a_token_file_and_say_how_to_write_it(tmp_path):
    from massive_lens.train.presets import get_preset

    assert get_preset("gpu-small").data == get_preset("gpu-gpt2").data
    assert get_preset("gpu-gpt2").data.endswith(".bin") and not get_preset("gpu-gpt2").prepend_bos
    with pytest.raises(MassiveLensError, match="massive-lens tokenize"):  # fails before building the model
        train_model("gpu-gpt2", progress=False, tokenizer="byte", data=str(tmp_path / "absent.bin"))


def test_a_checkpoint_from_before_prepend_bos_existed_still_resumes(tmp_path):
    cfg = {**TINY, "data": TRAIN_TEXT}
    train_model("smoke", out_dir=tmp_path, progress=False, until_step=2, **cfg)
    path = tmp_path / "checkpoint.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()[META_KEY]), {k: f.get_tensor(k) for k in f.keys()}
    del meta["config"]["prepend_bos"]
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})
    assert train_model("smoke", out_dir=tmp_path, progress=False, **cfg).steps == 4
    with pytest.raises(MassiveLensError, match="another configuration"):  # a real change is still refused
        train_model("smoke", out_dir=tmp_path, progress=False, **{**cfg, "prepend_bos": False})


def test_a_failed_tokenize_leaves_no_partial_file(tmp_path, monkeypatch):
    import massive_lens.train.data as data

    def broken(*args):
        yield torch.arange(10, dtype=torch.int32)
        raise RuntimeError("network dropped")

    monkeypatch.setattr(data, "_token_pieces", broken)
    with pytest.raises(RuntimeError, match="network"):
        write_token_file("abc", "byte", tmp_path / "t.bin", progress=False)
    assert list(tmp_path.iterdir()) == []
