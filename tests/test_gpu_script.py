"""benchmarks/gpu.sh, the prepared GPU run, in its CPU dry-run mode: every step runs at tiny
sizes and writes its results into the one results folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# three python subprocesses (a benchmark, a big-input run, a training run): 39 s of a one-process --quick run
@pytest.mark.heavy
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None or
                    not sys.platform.startswith("linux"), reason="a bash script with coreutils' timeout")
def test_the_gpu_script_dry_run_writes_every_steps_results(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    steps = (out / "steps.tsv").read_text().splitlines()
    assert run.returncode == 0, (steps, run.stdout, [(p.name, p.read_text()[-1500:]) for p in out.glob("*.log")])
    assert [line.split("\t")[:2] for line in steps[1:]] == [["bench", "0"], ["big", "0"], ["scratch", "0"]]
    assert "dry run" in (out / "env.txt").read_text()
    bench = (out / "bench.md").read_text()
    assert "| tiny-llama | origin | trace_origin" in bench and "bfloat16" in bench
    big = json.loads((out / "big.json").read_text().strip().splitlines()[-1])
    assert big["case"] == "find_massive" and big["peak"] > big["weights"] > 0
    assert "massive entries, dims [7]" in big["found"]  # the planted activation was found
    scratch = json.loads((out / "scratch" / "scratch.json").read_text())
    assert sorted(scratch["runs"]) == ["softmax", "softmax1"]


def test_a_failing_step_is_written_down_and_fails_the_script(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": "false"}  # every python step fails at once
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert [r[0] for r in rows] == ["bench", "big", "scratch"] and all(r[1] != "0" for r in rows)
