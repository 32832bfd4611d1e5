"""``massive-lens train``: the entry point that replaced ``torchrun -m massive_lens.train.trainer``,
whose ``k=v`` parser fed any value starting with a digit or one of ``-[{tf`` to ``json.loads``
(``data=tiny.txt`` and ``data=fineweb-edu-10BT.bin`` crashed with JSONDecodeError)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from massive_lens import MassiveLensError
from massive_lens.cli import parse_overrides

pytestmark = pytest.mark.heavy  # left out of the quick loop (make check)


def test_values_that_crashed_the_old_parser_are_strings():
    got = parse_overrides(["data=tiny.txt", "data2=fineweb-edu-10BT.bin", "tokenizer=byte", "name=true-ish",
                           "model={'n_layers': 1}", "lr=-3e-4", "prepend_bos=False", "seeds=[0, 1]"])
    assert got == {"data": "tiny.txt", "data2": "fineweb-edu-10BT.bin", "tokenizer": "byte", "name": "true-ish",
                   "model": {"n_layers": 1}, "lr": -3e-4, "prepend_bos": False, "seeds": [0, 1]}


def test_a_pair_without_equals_is_refused():
    with pytest.raises(MassiveLensError, match="key=value"):
        parse_overrides(["steps"])


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "massive_lens.cli", "train", "smoke", str(tmp_path / "run"), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_train_reads_a_relative_data_file_that_starts_with_t(tmp_path):
    (tmp_path / "tiny.txt").write_text("To be, or not to be. " * 200)
    done = _train(tmp_path, "data=tiny.txt", "steps=2", "tokenizer=byte", "log_every=1",
                  "model={'n_layers': 1, 'd_model': 16, 'n_heads': 2, 'n_ctx': 16}")
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["step"] == 2 and run["config"]["data"] == "tiny.txt"


def test_a_missing_token_file_is_a_clear_error(tmp_path):
    done = _train(tmp_path, "data=fineweb-edu-10BT.bin", "steps=1", "tokenizer=byte")
    assert done.returncode == 2 and "JSONDecodeError" not in done.stderr
    assert "fineweb-edu-10BT.bin" in done.stderr
