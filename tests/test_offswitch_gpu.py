"""benchmarks/offswitch_gpu.sh, the prepared GPU run of the off-switch protocol (issue 51), in its
CPU dry-run mode: tiny gpt-oss and Qwen3-Next through the same command, one page written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "offswitch_gpu.sh"
pytestmark = pytest.mark.heavy  # two subprocess runs of the command, about a minute on 2 cores
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None or
                                not sys.platform.startswith("linux"), reason="a bash script with coreutils' timeout")


@needs_bash
def test_dry_run_writes_the_page(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=400)
    steps = [line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert run.returncode == 0, (steps, [(p.name, p.read_text()[-1500:]) for p in out.glob("*.log")])
    assert steps == [["gptoss", "0"], ["gated", "0"], ["page", "0"]]
    page = (out / "offswitch_gpu.md").read_text()
    assert "dry run" in page and "off-switch: sink logit (s_aux)" in page and "element-wise (q_proj)" in page
    assert "| layer | full_attention | null_mass |" in page


@needs_bash
def test_a_failing_step_is_written_down_and_fails_the_script(tmp_path):
    out = tmp_path / "gpu"
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], cwd=ROOT, env={**os.environ, "PYTHON": "false"},
                         capture_output=True, text=True, timeout=60)
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert run.returncode == 1 and [r[0] for r in rows] == ["gptoss", "gated", "page"]
    assert rows[0][1] != "0" and rows[1][1] != "0"
