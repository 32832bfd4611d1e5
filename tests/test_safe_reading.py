"""Nothing massive_lens reads from disk can run code, and damaged or incomplete files are refused.

A pickle runs code when it is read. Every file type the package reads (training checkpoints,
saved results, model folders, GGUF files, token files) is replaced here by a pickle whose
loading would create a sentinel file; each read must fail with a clear error and the sentinel
must never appear. A source scan keeps ``pickle``, ``eval``, ``yaml.load`` and
``torch.load(weights_only=False)`` out of the package.
"""

from __future__ import annotations

import ast
import json
import pathlib
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import syntax
import torch
from helpers import DIM, TRAIN_TEXT, plant_story
from safetensors.torch import load_file, save_file

import massive_lens
from massive_lens import MassiveLensError, find_massive, load_model, tiny_model
from massive_lens.models import byte_tokenizer
from massive_lens.models.tiny import tiny_config
from massive_lens.origin import trace_origin
from massive_lens.train import load_run, train_model
from massive_lens.train.checkpoint import CKPT, LEGACY, convert_checkpoint
from massive_lens.train.data import read_token_file, write_token_file

PACKAGE = Path(massive_lens.__file__).parent
TRAIN = dict(model=dict(n_layers=1, d_model=16, n_heads=2, n_ctx=16), batch_size=4, steps=2, warmup_steps=1,
             log_every=1, eval_every=2, eval_batches=1, ckpt_every=2, tokenizer="byte", data=TRAIN_TEXT)


class _Payload:
    """Unpickling this writes the sentinel file: the proof that code ran."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return pathlib.Path.write_text, (pathlib.Path(self.sentinel), "code ran")


@pytest.fixture
def evil(tmp_path):
    """``(write, sentinel)``: ``write(path)`` puts a malicious pickle at ``path`` (torch's zip
    format for ``.pt``/``.bin``, a bare pickle elsewhere)."""
    sentinel = tmp_path / "SENTINEL"

    def write(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in (".pt", ".bin"):
            torch.save({"model": _Payload(sentinel)}, path)
        else:
            path.write_bytes(pickle.dumps(_Payload(sentinel)))
        return path

    yield write, sentinel
    assert not sentinel.exists(), "a pickle was unpickled: code from a file ran"


def test_the_payload_runs_when_unpickled(tmp_path):
    """The control: the sentinel mechanism works, so its absence below means something."""
    sentinel = tmp_path / "SENTINEL"
    pickle.loads(pickle.dumps(_Payload(sentinel)))
    assert sentinel.read_text() == "code ran"


@pytest.mark.heavy
def test_a_pickled_checkpoint_runs_nothing_in_any_reader(tmp_path, evil):
    write, _ = evil
    write(tmp_path / "run" / LEGACY)
    with pytest.raises(MassiveLensError, match="pickled checkpoint.*convert_checkpoint"):
        load_run(tmp_path / "run")
    with pytest.raises(MassiveLensError, match="pickled checkpoint"):
        train_model("smoke", out_dir=tmp_path / "run", progress=False, **TRAIN)
    with pytest.raises(MassiveLensError, match="could not be converted"):  # torch's weights-only loader refuses
        convert_checkpoint(tmp_path / "run")
    write(tmp_path / "run2" / CKPT)
    with pytest.raises(MassiveLensError, match="not a readable checkpoint"):
        load_run(tmp_path / "run2")
    cli = subprocess.run([sys.executable, "-m", "massive_lens.cli", "train", "smoke", str(tmp_path / "run"),
                          "tokenizer=byte"], capture_output=True, text=True, timeout=300)
    assert cli.returncode != 0 and "pickled checkpoint" in cli.stdout + cli.stderr


def test_an_old_checkpoint_converts_and_resumes_exactly(tmp_path):
    straight = train_model("smoke", progress=False, **{**TRAIN, "steps": 4})
    train_model("smoke", out_dir=tmp_path, progress=False, until_step=2, **{**TRAIN, "steps": 4})
    state = _as_legacy(tmp_path)
    torch.save(state, tmp_path / LEGACY)  # what massive_lens wrote before checkpoints were safetensors
    (tmp_path / CKPT).unlink()
    assert convert_checkpoint(tmp_path) == tmp_path / CKPT
    resumed = train_model("smoke", out_dir=tmp_path, progress=False, **{**TRAIN, "steps": 4})
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, straight.model.state_dict()[name]), name


def _as_legacy(folder: Path) -> dict:
    from massive_lens.train.checkpoint import read_checkpoint

    return read_checkpoint(folder / CKPT)


def test_a_saved_result_with_a_pickle_in_any_file_runs_nothing(tmp_path, evil):
    write, _ = evil
    found = find_massive(tiny_model("llama"), "Hello there. Bye.")
    orig = found.save(tmp_path / "orig")
    victims = sorted(str(p.relative_to(orig)) for p in orig.rglob("*") if p.is_file())
    assert {Path(v).suffix for v in victims} >= {".json", ".parquet"}
    for i, victim in enumerate(victims):
        folder = found.save(tmp_path / f"copy{i}")
        write(folder / victim)
        with pytest.raises(MassiveLensError):
            massive_lens.load(folder)


def test_a_model_folder_is_read_from_safetensors_only(tmp_path, evil):
    write, _ = evil
    folder = _saved_tiny(tmp_path / "tiny")
    (folder / "model.safetensors").unlink()
    write(folder / "pytorch_model.bin")
    with pytest.raises(MassiveLensError, match="safetensors"):
        load_model(folder)
    write(folder / "model.safetensors")
    with pytest.raises(MassiveLensError, match="damaged"):
        load_model(folder)
    with pytest.raises(MassiveLensError):
        load_model(write(tmp_path / "model.gguf"))


def test_a_token_file_that_is_a_pickle_runs_nothing(tmp_path, evil):
    write, _ = evil
    path = write(tmp_path / "tokens.bin")
    meta = dict(tokenizer="byte", vocab_size=len(byte_tokenizer()), dtype="uint16", n_tokens=path.stat().st_size // 2)
    path.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(MassiveLensError, match="beyond the 259-token vocabulary|bytes"):  # bytes read as ids
        read_token_file(path, byte_tokenizer())


def test_the_package_has_no_way_to_unpickle_or_evaluate():
    found = []
    for file in PACKAGE.rglob("*.py"):
        tree = syntax.tree(file)
        for node in syntax.walk(tree):
            where = f"{file.relative_to(PACKAGE)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{where} imports {n}" for n in names if n and n.split(".")[0] in
                          ("pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "yaml")]
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                    found.append(f"{where} calls {func.id}")
                if isinstance(func, ast.Attribute) and func.attr == "load":
                    weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
                    owner = ast.unparse(func.value)
                    if owner in ("torch", "pickle", "yaml") and not (
                            owner == "torch" and len(weights_only) == 1
                            and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True):
                        found.append(f"{where} calls {owner}.load without weights_only=True")
    assert not found, found


def test_the_scan_catches_what_it_looks_for(tmp_path, monkeypatch):
    """The scan above can fail: a module with each forbidden call is reported."""
    bad = tmp_path / "pkg"
    bad.mkdir()
    (bad / "m.py").write_text("import pickle\neval('1')\nimport torch\ntorch.load('x', weights_only=False)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", bad)
    with pytest.raises(AssertionError, match="imports pickle.*calls eval.*torch.load"):
        test_the_package_has_no_way_to_unpickle_or_evaluate()


# --------------------------------------------------------------------------- token files


def _token_file(tmp_path: Path, **changes) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text(TRAIN_TEXT[:2000])
    path = write_token_file(str(text), "byte", tmp_path / "tokens.bin", progress=False)
    meta = json.loads(path.with_suffix(".json").read_text())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize(("changes", "message"), [
    (dict(dtype="object"), "unsigned integer dtype"),
    (dict(dtype="uint8", vocab_size=70000), "unsigned integer dtype"),
    (dict(dtype="float32"), "unsigned integer dtype"),
    (dict(n_tokens=10), "bytes"),
    (dict(n_tokens=None), "lacks or mistypes"),
    (dict(vocab_size="259"), "lacks or mistypes"),
])
def test_a_token_file_description_is_checked_before_the_file_is_mapped(tmp_path, changes, message):
    path = _token_file(tmp_path, **changes)
    tok = byte_tokenizer()
    if "vocab_size" in changes and isinstance(changes["vocab_size"], int):
        tok = type("Big", (), {"__len__": lambda self: 70000})()
    with pytest.raises(MassiveLensError, match=message):
        read_token_file(path, tok)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    path = _token_file(tmp_path)
    data = np.fromfile(path, dtype=np.uint16)
    data[17] = len(byte_tokenizer()) + 5
    data.tofile(path)
    with pytest.raises(MassiveLensError, match=f"token id {len(byte_tokenizer()) + 5}"):
        read_token_file(path, byte_tokenizer())


# --------------------------------------------------------------------------- model folders


def _saved_tiny(folder: Path) -> Path:
    model_cls, config = tiny_config("llama", byte_tokenizer(), {"num_hidden_layers": 2})
    model_cls(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop(next(k for k in t if "down_proj" in k)), "missing keys: .*down_proj"),
    (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)), "unexpected keys: .*extra"),
    (lambda t: t.__setitem__(next(k for k in t if "down_proj" in k),
                             torch.zeros(3, 3)), "do not (match|fit)"),
])
def test_a_model_folder_with_a_missing_extra_or_misshapen_tensor_is_refused(tmp_path, edit, message):
    folder = _saved_tiny(tmp_path / "tiny")
    assert load_model(folder).cfg.n_layers == 2  # the untouched folder loads
    _edit_weights(folder, edit)
    with pytest.raises(MassiveLensError, match=message):
        load_model(folder)


def test_loader_messages_say_what_is_wrong(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MassiveLensError, match="no config.json"):
        load_model(tmp_path / "empty")
    with pytest.raises(MassiveLensError, match="no folder or file"):
        load_model(tmp_path / "absent")
    with pytest.raises(MassiveLensError, match="no GGUF file"):
        load_model(tmp_path / "absent.GGUF")
    with pytest.raises(MassiveLensError, match="unknown device"):
        load_model(_saved_tiny(tmp_path / "tiny"), device="gpu:zero")
    for bad in ("", "  "):
        with pytest.raises(MassiveLensError, match="display name"):
            load_model(tmp_path / "tiny", name=bad)
    with pytest.raises((MassiveLensError, TypeError), match="name"):  # the tests' type checker may come first
        load_model(tmp_path / "tiny", name=123)


def test_a_display_name_that_is_a_transformerlens_alias_loads_the_folder(tmp_path, capsys, caplog):
    folder = _saved_tiny(tmp_path / "tiny")
    plain = load_model(folder)
    named = load_model(folder, name="gpt2")  # a TransformerLens alias: must not be looked up
    out = capsys.readouterr()
    assert "DEPRECATED" not in out.out + out.err + caplog.text
    assert named.cfg.model_name == "gpt2" and named.cfg.n_layers == 2
    tokens = plain.to_tokens("Hello there")
    assert torch.equal(plain(tokens), named(tokens))


# --------------------------------------------------------------------------- threads


WEIGHT_EDITS = {  # every public path that edits a model's weights in place, for a moment
    "trace_origin(verify=True)": lambda m: trace_origin(m, "Hi there. Bye.", dim=DIM, pos=0, verify=True,
                                                        prepend_bos=True),
    "measure_outliers (W8A8 weights)": lambda m: massive_lens.measure_outliers(m, "Hi there. Bye. " * 8, seq_len=16,
                                                                               n_seqs=2),
}


@pytest.mark.parametrize("edit", list(WEIGHT_EDITS))
def test_weight_edits_hold_the_model_lock(edit):
    """A function that edits weights between passes holds the model's lock, so another thread's
    analysis of the same model never sees the edited weights (before the fix, 3 of 8 calls
    during verification answered otherwise)."""
    model = tiny_model("llama")
    plant_story(model)
    text = "Hi there. Bye."
    expected = find_massive(model, text, prepend_bos=True).to_frame()
    answers, errors = [], []

    def analyse():
        try:
            for _ in range(6):
                answers.append(find_massive(model, text, prepend_bos=True).to_frame())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    others = [threading.Thread(target=analyse) for _ in range(2)]
    for t in others:
        t.start()
    for _ in range(2):
        WEIGHT_EDITS[edit](model)
    for t in others:
        t.join()
    assert not errors and len(answers) == 12
    for frame in answers:
        assert frame.equals(expected)


# --------------------------------------------------------------------------- train mode, the cache


def test_an_analysis_of_a_model_in_train_mode_runs_without_dropout_and_keeps_the_mode():
    model = tiny_model("gpt2", resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    model.train()
    model.blocks[0].eval()  # a mixed state, restored module by module
    modes = {name: m.training for tree in (model, model.original_model) for name, m in tree.named_modules()}
    first = massive_lens.layer_profile(model, "Hello there. Bye.").to_frame()
    again = massive_lens.layer_profile(model, "Hello there. Bye.").to_frame()
    assert len(first) and first.equals(again)
    assert {name: m.training for tree in (model, model.original_model) for name, m in tree.named_modules()} == modes


def test_a_cache_the_disk_refuses_gives_a_warning_and_the_model_from_memory(tmp_path, monkeypatch, caplog):
    from massive_lens.models.cache import write_cache

    model_cls, config = tiny_config("llama", byte_tokenizer(), {"num_hidden_layers": 1})
    hf = model_cls(config)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "save_pretrained", full)
    assert write_cache(tmp_path / "cache" / "m-v1", hf, byte_tokenizer()) is False
    assert "could not write the model cache" in caplog.text
    (tmp_path / "ro").write_text("a file where the cache folder's parent should be")
    assert write_cache(tmp_path / "ro" / "m-v1", hf, byte_tokenizer()) is False


def test_the_cache_writer_keeps_a_folder_another_process_published(tmp_path, monkeypatch):
    from massive_lens.models import cache

    model_cls, config = tiny_config("llama", byte_tokenizer(), {"num_hidden_layers": 1})
    hf, folder = model_cls(config), tmp_path / "m-v1"
    assert cache.write_cache(folder, hf, byte_tokenizer())
    published = folder.stat().st_ino
    removed = []
    monkeypatch.setattr(cache.shutil, "rmtree", lambda path, **kw: removed.append(Path(path)))
    assert cache.write_cache(folder, hf, byte_tokenizer())  # a second writer finds it valid: keeps it
    assert folder.stat().st_ino == published and folder not in removed
    (folder / "manifest.json").write_text("{}")  # damaged: replaced
    monkeypatch.undo()
    assert cache.write_cache(folder, hf, byte_tokenizer()) and cache.cache_is_valid(folder)
