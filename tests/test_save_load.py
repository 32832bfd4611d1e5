"""Every result type saves to a folder (JSON manifest, Parquet tables, one safetensors file)
and loads back without the model: the same fields, ``to_frame()``, ``summary()`` and
``plot()``. Bad folders, unknown types and newer formats are refused; saves are atomic and
never delete what is not a saved result. The report writes its tables as CSV."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import matplotlib.axes
import numpy as np
import pandas as pd
import pytest
import torch
from examples import RESULT_TYPES, all_result_types
from helpers import DIM, plant_story

import massive_lens
from massive_lens import MassiveLensError, find_massive, load, tiny_model, trace_origin
from massive_lens.core import store
from massive_lens.core.results import Result
from massive_lens.report.render import Section, write_tables

EXTRA = ["OriginTrace:planted", "MassiveActivations:planted"]  # populated tables (neurons, why, verification)


@pytest.fixture(scope="module")
def examples(result_examples) -> dict[str, Any]:
    """Every result type's example, plus a planted trace and detection with populated tables."""
    found = dict(result_examples)
    model = tiny_model("llama")
    plant_story(model)
    found["OriginTrace:planted"] = trace_origin(model, "Hi there. Bye.", dim=DIM, pos=0, verify=True)
    found["MassiveActivations:planted"] = find_massive(model, ["Hi there.", "Bye now, friend."])
    return found


def assert_same(saved: Any, loaded: Any, where: str = "result") -> None:
    """Deep equality: frames by ``assert_frame_equal``, tensors exactly (dtype and shape too)."""
    if isinstance(saved, pd.DataFrame):
        pd.testing.assert_frame_equal(saved, loaded, obj=where)
        assert saved.attrs == loaded.attrs, where
    elif isinstance(saved, torch.nn.Module):
        assert type(saved) is type(loaded), where
        assert saved.cfg.to_dict() == loaded.cfg.to_dict(), where
        assert_same(dict(saved.state_dict()), dict(loaded.state_dict()), where + ".state_dict()")
    elif isinstance(saved, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == saved.dtype, where
        assert loaded.shape == saved.shape and torch.equal(saved.cpu(), loaded), where
    elif dataclasses.is_dataclass(saved):
        assert type(saved) is type(loaded), where
        for f in dataclasses.fields(saved):
            assert_same(getattr(saved, f.name), getattr(loaded, f.name), f"{where}.{f.name}")
    elif isinstance(saved, dict):
        assert type(loaded) is dict and list(saved) == list(loaded), where
        assert [type(k) for k in saved] == [type(k) for k in loaded], where
        for key in saved:
            assert_same(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert type(saved) is type(loaded) and len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(saved, float) and math.isnan(saved):
        assert isinstance(loaded, float) and math.isnan(loaded), where
    else:
        assert type(saved) is type(loaded) and saved == loaded, f"{where}: {saved!r} != {loaded!r}"


def test_every_result_type_is_saved_here():
    assert {t.__name__ for t in all_result_types()} == set(RESULT_TYPES)


@pytest.mark.parametrize("name", RESULT_TYPES + EXTRA)
def test_round_trip_without_the_model(examples, name, tmp_path):
    result = examples[name]
    folder = result.save(tmp_path / "saved")
    assert folder == tmp_path / "saved" and (folder / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]  # no temporary folder left behind
    loaded = load(folder)
    assert type(loaded) is type(result)
    assert_same(result, loaded)
    pd.testing.assert_frame_equal(result.to_frame(), loaded.to_frame())
    assert loaded.summary() == result.summary()
    assert loaded._repr_html_() == result._repr_html_()
    ax = loaded.plot()
    assert isinstance(ax, matplotlib.axes.Axes) and (ax.lines or ax.patches or ax.collections)


def test_the_folder_is_the_documented_format(examples, tmp_path):
    trace = examples["OriginTrace:planted"]
    folder = trace.save(tmp_path / "trace")
    manifest = json.loads((folder / "manifest.json").read_text(),
                          parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert manifest["format"] == "massive_lens.result" and manifest["format_version"] == 1
    assert (manifest["type"], manifest["module"]) == ("OriginTrace", "massive_lens.origin.trace")
    assert manifest["library_version"] == massive_lens.__version__
    assert manifest["summary"] == trace.summary()
    assert manifest["fields"]["ledger"] == {"$frame": "frames/ledger.parquet", "columns": list(trace.ledger.columns)}
    assert manifest["fields"]["n_tokens"] == trace.n_tokens
    pd.testing.assert_frame_equal(pd.read_parquet(folder / "frames" / "ledger.parquet"), trace.ledger)
    assert sorted(manifest["files"]["frames"]) == sorted(str(p.relative_to(folder)) for p in folder.glob("frames/*"))

    calib = examples["Calibration"]
    folder = calib.save(tmp_path / "calibration")
    fields = json.loads((folder / "manifest.json").read_text())["fields"]
    assert fields["criterion"]["$dataclass"] == "massive_lens.core.criterion:Criterion"
    assert fields["sink_z"] == {"$tensor": "sink_z"}
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "tensors.safetensors"))
    assert torch.equal(tensors["sink_z"], calib.sink_z) and torch.equal(tensors["sinks.mask"], calib.sinks.mask)


def test_a_loaded_train_run_predicts_as_the_trained_one(examples, tmp_path):
    run = examples["TrainRun"]
    loaded = load(run.save(tmp_path / "run"))
    tokens = torch.tensor([[1, 70, 71, 72, 73]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(tokens), run.model.eval()(tokens), rtol=0, atol=0)
    assert not loaded.model.training and loaded.model.tokenizer is not None
    keys = load_file_keys(tmp_path / "run" / "tensors.safetensors")
    assert {f"model.state.{k}" for k in run.model.state_dict()} == keys


def load_file_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


# --------------------------------------------------------------------------- the generic encoder


@dataclasses.dataclass(frozen=True)
class Everything(Result):
    """A result with every kind of value the store handles."""

    numbers: dict[int, torch.Tensor]
    nested: tuple[tuple[str, ...], ...]
    weird_floats: list[float]
    keyed: dict[tuple[int, int], str]
    dollar: dict[str, int]
    table: pd.DataFrame
    series: pd.Series
    array: np.ndarray
    dtype: torch.dtype
    path: Path
    shared: tuple[torch.Tensor, torch.Tensor]
    half: torch.Tensor
    scalar: float = 0.0
    maybe: Any = None

    def to_frame(self) -> pd.DataFrame:
        return self.table

    def summary(self) -> str:
        return f"{len(self.table)} rows"

    def plot(self, ax: Any = None) -> Any:
        return ax


def test_every_kind_of_value_round_trips(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    table = pd.DataFrame({"layer": [0, 1, 2], "token": ["a", "b", None], "value": [1.5, np.nan, 3.0],
                          "massive": [True, False, True]}, index=pd.Index([5, 6, 7], name="pos"))
    table.attrs["verdict"] = "kept"
    thing = Everything(
        numbers={5: base[0], 900: torch.zeros(0, dtype=torch.long)},
        nested=(("a", "b"), ()),
        weird_floats=[float("nan"), float("inf"), -float("inf"), 1e-300],
        keyed={(0, 1): "x"},
        dollar={"$tensor": 3},
        table=table,
        series=pd.Series([1.0, 2.0], index=["a", "b"], name="score"),
        array=np.arange(6, dtype=np.int32).reshape(2, 3),
        dtype=torch.bfloat16,
        path=Path("some/where.txt"),
        shared=(base[1], base.T),  # views of one storage, one of them not contiguous
        half=torch.randn(2, 3).to(torch.bfloat16),
        scalar=np.float64(2.5),
    )
    loaded = load(thing.save(tmp_path / "everything"))
    for f in dataclasses.fields(Everything):
        if f.name not in ("series", "array", "scalar"):
            assert_same(getattr(thing, f.name), getattr(loaded, f.name), f.name)
    pd.testing.assert_series_equal(loaded.series, thing.series)
    np.testing.assert_array_equal(loaded.array, thing.array)
    assert loaded.array.dtype == np.int32 and loaded.scalar == 2.5 and type(loaded.scalar) is float


def test_a_value_that_cannot_be_saved_is_named_and_nothing_is_written(tmp_path):
    thing = Everything({}, (), [], {}, {}, pd.DataFrame(), pd.Series(dtype=float), np.zeros(1), torch.float32,
                       Path("."), (), torch.zeros(1), maybe=object())
    with pytest.raises(MassiveLensError, match="maybe.*object"):
        thing.save(tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- refusals and atomicity


def _saved(tmp_path: Path, name: str = "saved") -> Path:
    return find_massive(tiny_model("llama"), "Hello.").save(tmp_path / name)


def _edit_manifest(folder: Path, **changes: Any) -> None:
    path = folder / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_load_refuses_what_is_not_a_saved_result(tmp_path):
    with pytest.raises(MassiveLensError, match="does not exist"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MassiveLensError, match="holds no saved result"):
        load(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("hello")
    with pytest.raises(MassiveLensError, match="no saved result"):
        load(tmp_path / "file.txt")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("{not json")
    with pytest.raises(MassiveLensError, match="not valid JSON"):
        load(tmp_path / "junk")
    (tmp_path / "junk" / "manifest.json").write_text('{"name": "something else"}')
    with pytest.raises(MassiveLensError, match="not the manifest of a saved massive_lens result"):
        load(tmp_path / "junk")


def test_load_refuses_unknown_types_newer_formats_and_missing_files(tmp_path):
    folder = _saved(tmp_path, "unknown")
    _edit_manifest(folder, type="FutureResult", module="massive_lens.future")
    with pytest.raises(MassiveLensError, match="unknown result type massive_lens.future.FutureResult"):
        load(folder)
    folder = _saved(tmp_path, "not-a-result")
    _edit_manifest(folder, type="Criterion", module="massive_lens.core.criterion")  # a dataclass, not a result
    with pytest.raises(MassiveLensError, match="unknown result type"):
        load(folder)
    folder = _saved(tmp_path, "newer")
    _edit_manifest(folder, format_version=2, library_version="9.0")
    with pytest.raises(MassiveLensError, match="format version 2 by massive_lens 9.0.*upgrade"):
        load(folder)
    folder = _saved(tmp_path, "damaged")
    (folder / "frames" / "entries.parquet").unlink()
    with pytest.raises(MassiveLensError, match="entries.parquet is missing"):
        load(folder)


def test_a_moved_result_class_is_found_by_name(tmp_path):
    folder = _saved(tmp_path)
    _edit_manifest(folder, module="massive_lens.old_place")
    assert type(load(folder)).__name__ == "MassiveActivations"


def test_a_massive_activations_saved_with_its_old_field_name_loads(tmp_path):
    folder = _saved(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    fields = {("profile" if k == "magnitudes" else k): v for k, v in manifest["fields"].items()}
    _edit_manifest(folder, fields=fields)  # as saved before MassiveActivations.profile became per layer
    again, found = load(folder), load(_saved(tmp_path, "new"))
    pd.testing.assert_frame_equal(again.magnitudes, found.magnitudes)
    assert again.summary() == found.summary()


def test_save_refuses_an_existing_target_unless_told(tmp_path):
    folder = _saved(tmp_path)
    trace = trace_origin(tiny_model("llama"), "Hi.", dim=3, pos=0)
    with pytest.raises(MassiveLensError, match="exists and is not empty.*overwrite=True"):
        trace.save(folder)
    assert type(load(folder)).__name__ == "MassiveActivations"
    trace.save(folder, overwrite=True)
    assert load(folder).summary() == trace.summary()
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]

    (tmp_path / "empty").mkdir()
    assert load(trace.save(tmp_path / "empty")).summary() == trace.summary()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(MassiveLensError, match="not a saved result"):
        trace.save(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    (tmp_path / "file").write_text("x")
    with pytest.raises(MassiveLensError, match="is a file"):
        trace.save(tmp_path / "file", overwrite=True)
    assert trace.save(tmp_path / "a" / "b" / "c").is_dir()  # parents are created


def test_an_interrupted_save_leaves_nothing_half_written(tmp_path, monkeypatch):
    folder = _saved(tmp_path)
    trace = trace_origin(tiny_model("llama"), "Hi.", dim=3, pos=0)
    real, calls = pd.DataFrame.to_parquet, []

    def crash_on_the_third(frame, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(frame, *args, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", crash_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        trace.save(tmp_path / "new")
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        trace.save(folder, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]  # no "new", no temporary folders
    assert type(load(folder)).__name__ == "MassiveActivations"  # the old result, intact


def test_registry_holds_every_result_type():
    registered = {cls.__name__ for cls in store.RESULT_CLASSES.values() if cls.__module__.startswith("massive_lens.")}
    assert set(RESULT_TYPES) <= registered


# --------------------------------------------------------------------------- report tables


def test_write_tables_writes_whole_tables_named_by_section_and_caption(tmp_path):
    first, second = Section("Massive activations"), Section("W8A8 quantization")
    big = pd.DataFrame({"layer": range(50), "value": np.linspace(0, 1, 50)})
    first.table(big, "how often each (dim, token kind) is massive")
    first.text("not a table")
    second.table(big.head(3))
    paths = write_tables([first, second], tmp_path / "tables")
    assert [p.name for p in paths] == ["01-massive-activations-how-often-each-dim-token-kind-is-massive.csv",
                                       "02-w8a8-quantization-table.csv"]
    assert len(first.blocks[0][1]) == 30  # the page shows the head ...
    pd.testing.assert_frame_equal(pd.read_csv(paths[0]), big)  # ... the CSV holds all of it


def test_the_report_writes_its_tables(planted_report):
    tables = sorted((planted_report.parent / "tables").glob("*.csv"))
    assert len(tables) >= 5
    assert any("origin" in p.name for p in tables)
    assert all(len(pd.read_csv(p).columns) > 0 for p in tables)


def test_a_loaded_calibration_gives_the_same_interventions(tmp_path):
    from massive_lens import calibrate, run_interventions

    text = "The cat sat. The dog ran!\nA bird sang, loudly. " * 8
    model = tiny_model("llama")
    with torch.no_grad():
        model.W_E[model.tokenizer.bos_token_id, 5] = 3000.0
    calib = calibrate(model, text, seq_len=16, n_seqs=2, progress=False)
    loaded = load(calib.save(tmp_path / "calibration"))
    assert list(loaded.dims) == list(calib.dims) and torch.equal(loaded.dims[0], calib.dims[0])
    tables = [run_interventions(model, text[::-1], calibration=c, seq_len=16, n_seqs=2, progress=False,
                                settings=["mean", "sink_term_mean"]) for c in (calib, loaded)]
    pd.testing.assert_frame_equal(tables[0].to_frame(), tables[1].to_frame())
