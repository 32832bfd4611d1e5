"""scan_corpus under torchrun (gloo, 2 CPU processes) equals the single-process scan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.dist


def test_scan_corpus_all_reduces_across_ranks(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "dist_scan_worker.py")
    out = str(tmp_path / "scan")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(__file__)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker, out]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.load(open(f"{out}.{r}.json")) for r in range(2)]

    sys.path.insert(0, os.path.dirname(__file__))
    from dist_scan_worker import scan

    alone = scan()
    for got in ranks:  # every rank holds the full, all-reduced result
        assert got["n_sequences"] == alone.n_sequences > 2 and got["n_tokens"] == alone.n_tokens
        pd.testing.assert_frame_equal(pd.DataFrame(got["frequency"]), alone.frequency, check_dtype=False)
        pd.testing.assert_frame_equal(pd.DataFrame(got["profile"]), alone.profile,
                                      check_dtype=False, rtol=1e-5)  # float32 activations, other batches
    assert not alone.frequency.empty
