"""Shared fixtures: seeding, tiny models of each family, the real default model (loaded once
per session) and the quick report of a planted model. Plain helpers (planting, the
"untouched" check, data paths) are in ``helpers.py``."""

from __future__ import annotations

import ast
import logging
import os
import random
from collections import Counter
from pathlib import Path

import deps_first
import pytest

try:  # jaxtyping's private helpers, which _share_stand_ins wraps (light: no torch, no package)
    from jaxtyping import _decorator as jaxtyping_decorator
except ImportError:
    jaxtyping_decorator = None
from xdist.scheduler import LoadFileScheduling

# pytest-xdist's controller process (make test, make check) runs no test: it only hands them out, and the
# worker processes start after it has read this file. So nothing here imports torch or the package at the
# top (that took 10 s of CPU before the workers started); each process that runs tests loads them in
# pytest_configure, and the fixtures import what they use.


def _families() -> tuple[str, ...]:
    """``massive_lens.models.FAMILIES``, read from its source (the fixture ``family`` needs it to be defined;
    pytest_configure checks it against the package's)."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "massive_lens" / "models" / "tiny.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(target, ast.Name) and target.id == "FAMILIES" for target in node.targets))


FAMILIES = _families()

# Under pytest-xdist (make test), each worker gets its share of the cores: two workers with torch's
# default of one thread per core oversubscribe them, and OpenMP's spinning threads made the suite
# 1.8x slower than one process (measured on 2 cores); one thread per worker made it faster.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _runs_tests(config) -> bool:
    """False in pytest-xdist's controller, which only hands the tests out (xdist's own test for it)."""
    return hasattr(config, "workerinput") or not (config.getoption("dist", "no") != "no"
                                                  and config.getoption("tx", None)
                                                  and not config.getvalue("collectonly"))


# jaxtyping's import hook (pyproject's --jaxtyping-packages) decorates every function of the package, those defined
# inside another function too, each time that one runs: a hook closure made per layer and per pass was decorated
# anew each time (~0.3 ms: two stand-in functions with its signature, compiled, then wrapped by beartype), 5,000 to
# 20,000 times in a file of analyses. The stand-ins and their checks depend only on the name, the signature and the
# typechecker, so one made for a signature serves each later function of the same one (the call's own arguments are
# still checked at every call). Signatures with a default other than None, a bool, a number or a string (which
# would keep it alive) or an unhashable annotation are made afresh as before.
_PLAIN_DEFAULTS = (type(None), bool, int, float, str, bytes)
STAND_INS: dict[tuple, object] = {}  # (name, qualname, module, output, signature) -> what jaxtyping made for it
CHECKED: dict[tuple[int, int], tuple[object, object, object]] = {}  # ids -> (typechecker, stand-in, checked one)


def _stand_in_key(name, qualname, module, signature, output) -> tuple | None:
    """What a stand-in depends on (defaults by type and value: 1 and True differ), or None where it is not kept."""
    params = tuple(signature.parameters.values())
    if not all(p.default is p.empty or type(p.default) in _PLAIN_DEFAULTS for p in params):
        return None
    key = (name, qualname, module, output, signature.return_annotation,
           tuple((p.name, p.kind, p.annotation, type(p.default), p.default) for p in params))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _share_stand_ins() -> None:
    """Make jaxtyping build and check one stand-in per signature (see :data:`STAND_INS`)."""
    make = getattr(jaxtyping_decorator, "_make_fn_with_signature", None)
    apply = getattr(jaxtyping_decorator, "_apply_typechecker", None)
    if make is None or apply is None:  # a release renamed them: the stand-ins are made as jaxtyping makes them
        return
    if getattr(make, "shared", False):
        return
    kept: dict[int, object] = {}  # id -> each stand-in in STAND_INS (alive there, so its id stays its own)

    def make_once(name, qualname, module, signature, output):
        key = _stand_in_key(name, qualname, module, signature, output)
        if key is None:
            return make(name, qualname, module, signature, output)
        if key not in STAND_INS:
            STAND_INS[key] = made = make(name, qualname, module, signature, output)
            fn = made[0] if output else made
            kept[id(fn)] = fn
        return STAND_INS[key]

    def apply_once(typechecker, fn):
        if kept.get(id(fn)) is not fn:
            return apply(typechecker, fn)
        key = (id(typechecker), id(fn))
        if key not in CHECKED:
            CHECKED[key] = (typechecker, fn, apply(typechecker, fn))  # the typechecker kept alive: its id stays
        return CHECKED[key][2]

    make_once.shared = True
    jaxtyping_decorator._make_fn_with_signature, jaxtyping_decorator._apply_typechecker = make_once, apply_once


def pytest_configure(config):
    """In a process that runs tests: torch's threads, jaxtyping's stand-ins shared (:func:`_share_stand_ins`),
    then the package's libraries before the package (``deps_first``), then the package."""
    if not _runs_tests(config):
        return
    _share_stand_ins()
    import torch

    if _WORKERS > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))  # subprocesses too
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    deps_first.load()
    from massive_lens.models import FAMILIES as PACKAGE_FAMILIES

    assert PACKAGE_FAMILIES == FAMILIES, (PACKAGE_FAMILIES, FAMILIES)

# What --quick leaves out is chosen by marker (a slow module says so itself: `pytestmark = pytest.mark.heavy`)
# and by fixture; tests/test_layout.py fails on a test that loads a real model or builds a report without either.
QUICK_SKIPPED_MARKERS = ("slow", "real", "dist", "heavy")
QUICK_SKIPPED_FIXTURES = {"default_model", "planted_report", "story_report"}  # the real model; whole reports


def _module_marks(path: Path) -> set[str]:
    """The markers a test module's own ``pytestmark`` names (``pytest.mark.<name>``), read from its source."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", "") == "pytestmark" for target in node.targets):
            names |= {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return names


def pytest_ignore_collect(collection_path: Path, config):
    """Under ``--quick``, a test module whose ``pytestmark`` leaves every one of its tests out is not imported at all
    (each process's start read 17 such modules only to deselect their tests: ~1.3 s of CPU); otherwise pytest
    decides."""
    if (config.getoption("--quick") and collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and _module_marks(collection_path) & set(QUICK_SKIPPED_MARKERS)):
        return True
    return None


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the development loop (make check): tiny llama models only; no slow, real, dist or heavy "
                          "tests, whole reports, notebooks, browser, docs build or architecture matrix")


# make test (pytest-xdist, --dist loadfile) hands each worker process one test file at a time, so a
# module's fixtures load once; the tests named here are spread instead, each one (each parameter) a unit
# of its own: the docs pages and notebooks run side by side, not one after the other in one process, and
# the longest tests run beside the rest of their file.
SPREAD = ("tests/test_docs_examples.py::test_docs_page_examples_run", "tests/test_notebooks.py::test_notebook_runs",
          "tests/test_report.py::test_the_default_models_report_peaks_within_1_5x_its_weights_and_1_4x_with_a_pinned"
          "_allocator", "tests/test_nnsight.py::test_real_models_same_numbers")


# The units that start first in each process, whatever their number of tests: the memory watch's test walks
# every object alive (2 s at a process's start, 13-20 s late in one: its walks queue one after another), and
# the others run long for their few tests (a subprocess, a model trained), so none of them starts last while
# the other process has nothing left to do. By file, as measured in a one-process --quick run.
FIRST = ("tests/test_report_memory_watch.py", "tests/test_bench_vocab.py", "tests/test_head_curve.py",
         "tests/test_quant_granularity.py", "package source", "tests/test_handover.py")


# Files that share work done once per process run in one process, as one unit: the contract and save/load tests
# share the session fixture result_examples (one example of every result type, ~5 s of CPU to build); the
# static checks of the package's source share its parse (tests/source.py: each file parsed and walked once, not
# once per check).
GROUPS = {"tests/test_contract.py": "result examples", "tests/test_save_load.py": "result examples",
          "tests/test_layout.py": "package source", "tests/test_rules.py": "package source",
          "tests/test_safe_reading.py": "package source", "tests/test_model_lock_rule.py": "package source"}


def work_unit(nodeid: str) -> str:
    """What make test's scheduler keeps in one worker process: the test's file (its group's name where it is
    in :data:`GROUPS`), or the test itself where it is one of :data:`SPREAD`."""
    if nodeid.split("[")[0] in SPREAD:
        return nodeid
    file = nodeid.split("::")[0]
    return GROUPS.get(file, file)


class FileScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the tests of :data:`SPREAD` as units of their own."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before pytest-xdist's own choice; none without it (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    return FileScheduling(config, log) if config.getoption("dist", "no") == "loadfile" else None


def pytest_collection_modifyitems(config, items):
    """The units of :data:`FIRST` come first, in its order; in make test's and make check's worker processes, then the
    units holding a ``slow`` or ``real`` test, then the others, each kind by its number of tests, most
    first (both keep this order: ``--no-loadscope-reorder``), so that no long unit starts last; under
    ``--quick``, keep only what runs on a tiny llama in seconds."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the order it collects is the order handed out
        units = Counter(work_unit(item.nodeid) for item in items)
        slow = {work_unit(item.nodeid) for item in items if any(map(item.get_closest_marker, ("slow", "real")))}
        items.sort(key=lambda item: (work_unit(item.nodeid) not in slow, -units[work_unit(item.nodeid)]))  # stable
    first = {unit: i for i, unit in enumerate(FIRST)}
    items.sort(key=lambda item: first.get(work_unit(item.nodeid), len(FIRST)))  # stable: the rest as above
    if not config.getoption("--quick"):
        return
    others = set(FAMILIES) - {"llama"}
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        quick = (not any(item.get_closest_marker(m) for m in QUICK_SKIPPED_MARKERS)
                 and not QUICK_SKIPPED_FIXTURES & set(getattr(item, "fixturenames", ()))
                 and not others & {v for v in params.values() if isinstance(v, str)})
        (keep if quick else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


def _global_torch_state() -> dict:
    """What a test could leave behind for every later test in its worker process: accelerate's
    meta-device patches of ``nn.Module``, transformers' loading patches (two threads loading at once once
    left ``tie_weights`` a no-op, and every later model with a meta ``lm_head``), torch's default device and
    dtype, the mode stacks."""
    import torch
    from transformers import PreTrainedModel

    return {"register_parameter": torch.nn.Module.register_parameter,
            "register_buffer": torch.nn.Module.register_buffer,
            "tie_weights": PreTrainedModel.tie_weights, "init_weights": PreTrainedModel.init_weights,
            "normal_": torch.nn.init.normal_,
            "default device": torch.get_default_device(), "default dtype": torch.get_default_dtype(),
            "torch function modes": torch._C._len_torch_function_stack(),
            "grad enabled": torch.is_grad_enabled()}


@pytest.fixture(autouse=True)
def _seed():
    """Seeded; afterwards, the process's global torch state as it was (a test that changed it fails
    here, by name, and the state is put back, so the tests after it in the worker are not run on it)."""
    import torch

    random.seed(0)
    torch.manual_seed(0)
    before = _global_torch_state()
    yield
    import matplotlib.pyplot as plt

    plt.close("all")
    after = _global_torch_state()
    changed = [key for key in before if after[key] != before[key]]
    if changed:
        torch.nn.Module.register_parameter = before["register_parameter"]
        torch.nn.Module.register_buffer = before["register_buffer"]
        from transformers import PreTrainedModel

        PreTrainedModel.tie_weights, PreTrainedModel.init_weights = before["tie_weights"], before["init_weights"]
        torch.nn.init.normal_ = before["normal_"]
        torch.set_default_device(None if before["default device"].type == "cpu" else before["default device"])
        torch.set_default_dtype(before["default dtype"])
        while torch._C._len_torch_function_stack() > before["torch function modes"]:
            torch._C._pop_torch_function_stack()
        torch.set_grad_enabled(before["grad enabled"])
        pytest.fail(f"the test left the process's global torch state changed: {changed} "
                    f"({[(before[k], after[k]) for k in changed]}); put back")


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny(family):
    from massive_lens import tiny_model

    return tiny_model(family)


@pytest.fixture(scope="session")
def default_model():
    """The real offline default (SmolLM2-135M-Instruct), shared by the whole session."""
    from massive_lens import load_model

    return load_model()


PLANTED_REPORT_LOG: list[str] = []  # what the planted report's run logged (massive_lens.report.write, INFO)


@pytest.fixture(scope="session")
def planted_report(tmp_path_factory):
    """``index.html`` of the quick report on a tiny llama whose layer-1 MLP writes 600 into
    dim 7 at BOS (checked to leave the model untouched); ``report.md``, ``figures/`` and ``tables/``
    beside it, and the messages its run logged in :data:`PLANTED_REPORT_LOG`."""
    from helpers import plant_massive, untouched

    from massive_lens import tiny_model
    from massive_lens.report import write_report

    model = tiny_model("llama")
    plant_massive(model, layer=1, neuron=5, dim=7, value=600.0, trigger=model.tokenizer.bos_token_id, trigger_dim=3)
    logger, handler = logging.getLogger("massive_lens.report.write"), logging.Handler(logging.INFO)
    handler.emit = lambda record: PLANTED_REPORT_LOG.append(record.getMessage())
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with untouched(model):
            return write_report(model, out_dir=tmp_path_factory.mktemp("report"), quick=True, progress=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="session")
def result_examples():
    """One example of every public result type (``tests/examples.py``), built once."""
    from examples import result_examples

    return result_examples()


@pytest.fixture(scope="module")
def models():
    """A tiny llama and a float16 copy whose layer 2 overflows, for the bad-input tables."""
    from helpers import overflowing

    from massive_lens import tiny_model

    return {"tiny": tiny_model("llama"), "overflow": overflowing()}


@pytest.fixture(scope="module")
def free_matrix_models():
    """The planted architecture-matrix models live for one module only."""
    from matrix import build

    yield
    build.cache_clear()
