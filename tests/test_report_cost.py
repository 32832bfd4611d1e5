"""What the report's first run costs: the light default against ``full``, and time estimates
taken from measured passes."""

from __future__ import annotations

import logging
import math
import re
import time

import pandas as pd
import pytest
import torch
from conftest import PLANTED_REPORT_LOG
from planting import TEXT, bos_tokens, plant_story

from massive_lens import MassiveLensError, tiny_model, trace_origin
from massive_lens.origin import verify
from massive_lens.report import sections
from massive_lens.report.inputs import QUICK, Inputs
from massive_lens.report.memory import PeakMemory, SectionPeaks
from massive_lens.report.render import Section
from massive_lens.report.write import SECTIONS

STORY_TEXT = "The cat sat on the mat. It was warm, and the dog slept by the door."
DELAY = 0.4  # seconds each perplexity run is made to take


@pytest.fixture(scope="module")
def story():
    return plant_story(tiny_model("llama"))


def test_the_verification_estimate_comes_from_a_measured_perplexity_run(story, monkeypatch, caplog):
    """The estimate logged before the ablations' perplexity runs is what they then take: here each
    run is made to last ``DELAY`` s, as a real model's runs dwarf the short text's passes. The
    estimate taken from the capture pass's time per token (the code before) said a fraction of a
    second on this tiny model."""
    runs = []

    def slow_ppl(model, tokens, hooks):
        if tokens is None:
            return math.nan
        time.sleep(DELAY)
        runs.append(time.perf_counter())
        return 1.0

    monkeypatch.setattr(verify, "ppl", slow_ppl)
    corpus = bos_tokens(story, TEXT, 32, 2)
    with caplog.at_level(logging.INFO, logger="massive_lens.origin.trace"):
        trace = trace_origin(story, STORY_TEXT, verify=True, corpus=corpus, prepend_bos=True)
    assert not trace.verification.empty and len(runs) > 2
    message = next(r.getMessage() for r in caplog.records if "verifying" in r.getMessage())
    estimated = float(re.search(r"estimated (\d+) s more", message).group(1))
    assert f"{len(runs) - 1} perplexity runs of 2 x 32 tokens" in message, message
    taken = runs[-1] - runs[0]  # every run after the measured one, and the text's passes between them
    # the runs are in the estimate, and the text's passes (estimated from the capture pass, heavier
    # than each of them) do not swamp it; the per-token extrapolation read ~1,000 s here
    assert (len(runs) - 1) * DELAY * 0.9 <= estimated <= 3 * taken + 2, (message, taken)


# --------------------------------------------------------------------------- the light default and --full


def test_the_default_is_lighter_than_full_and_full_is_one_flag_away():
    from massive_lens.cli import build_parser
    from massive_lens.report import DEFAULT, FULL
    from massive_lens.report.lowbit_section import LOWBIT
    from massive_lens.report.sections import VERIFY_CORPUS
    from massive_lens.report.write import settings_for

    assert settings_for(False) == DEFAULT and settings_for(False, full=True) == FULL
    assert DEFAULT.n_seqs < FULL.n_seqs and DEFAULT.scan_seqs < FULL.scan_seqs
    assert len(LOWBIT[False][0]) < len(LOWBIT[True][0]) and LOWBIT[False][1] < LOWBIT[True][1]
    assert VERIFY_CORPUS[False][0] < VERIFY_CORPUS[True][0]
    assert build_parser().parse_args(["report", "--full"]).full is True
    with pytest.raises(MassiveLensError, match="quick and full"):
        settings_for(True, full=True)


def test_the_report_names_the_w8a8_granularity_and_recommends_no_unconfirmed_fix(planted_report):
    md = (planted_report.parent / "report.md").read_text()
    w8a8 = md.split("## W8A8 quantization")[1].split("\n## ")[0]
    lowbit = md.split("## Low-bit settings")[1].split("\n## ")[0]
    assert "per-tensor static activations" in w8a8 and "per-tensor activations" in w8a8
    assert "per-token activations" in lowbit and "differs from the W8A8 of the section above" in lowbit
    assert "Fix:" not in w8a8 and "No fix is recommended from a prediction" in w8a8


@pytest.mark.heavy  # a whole (small) report
def test_the_lowbit_section_keeps_its_kept_sinks_row_on_a_post_norm_model(tmp_path):
    """Gemma-3-style sandwich norms: the rotated settings cannot run; the section says why and
    shows the kept sinks without the rotation (its title promises them)."""
    from massive_lens.report import write as rep

    path = rep.write_report(tiny_model("gemma3"), out_dir=tmp_path, quick=True, progress=False, tables=False,
                            skip="massive,origin,attention,sinks,interventions,quantization")
    md = (path.parent / "report.md").read_text()
    lowbit = md.split("## Low-bit settings")[1]
    assert "W4A4+hadamard was left out:" in lowbit and "post-norm" in lowbit and "rotation=None" not in lowbit
    assert "| W4A4+kvsink |" in lowbit


@pytest.mark.heavy  # the intervention table on a tiny model (seconds)
def test_the_interventions_section_shows_its_own_progress(story, capsys):
    """The report's longest section had no progress inside it: its bar follows the report's."""
    inputs = Inputs(story, STORY_TEXT, "One two three four. " * 200, QUICK, progress=True)
    sections.intervention_section(inputs, Section("Interventions"))
    assert "interventions:" in capsys.readouterr().err


def test_the_model_section_shows_each_steps_peak_and_the_run_peak_is_their_largest(planted_report):
    """Issue 53: each step's peak memory and time, in the Model section's table and the run's log;
    the steps cover the run, so the run's peak (the report's memory line) is the largest step's.
    On the session's planted quick report (tests/conftest.py), with what its run logged."""
    page, folder = planted_report, planted_report.parent
    tables = sorted((folder / "tables").glob("*-model-where-the-memory-goes*.csv"))
    assert len(tables) == 1
    frame = pd.read_csv(tables[0])
    assert frame["section"].tolist() == ["loading the model and the corpus", *(t for _, t, _, _ in SECTIONS),
                                         "figures written"]
    line = re.search(r"Peak memory ([\d.]+) (MiB|GiB) resident", (folder / "report.md").read_text())
    assert line, "the report's memory line is missing"
    peak = float(line.group(1)) * (1024 if line.group(2) == "GiB" else 1)  # printed as 1.49 GiB past 1 GiB
    assert abs(peak - frame["peak_MiB"].max()) <= (1 if line.group(2) == "MiB" else 6)  # the printed rounding
    assert (frame["seconds"] >= 0).all()
    # A section marked exact raised the process's high-water mark, so its peak is the run's largest so far.
    # Whether any section raises it depends on what the test process freed before (a heap kept from earlier
    # tests can hold the whole quick report): test_a_section_that_raises_the_mark_is_exact shows it does.
    so_far = frame["peak_MiB"].cummax()
    assert (frame["peak_MiB"][frame["exact"]] >= so_far[frame["exact"]] - 1).all(), frame
    logged = [m for m in PLANTED_REPORT_LOG if m.startswith("report section ")]
    assert len(logged) == len(SECTIONS) + 1 and all("MiB above the start" in m for m in logged)
    assert "where the memory goes" in page.read_text()


def test_a_section_that_raises_the_mark_is_exact():
    """A block that touches fresh pages past the process's high-water mark has it as its exact peak; the
    block after it, which allocates nothing new, is sampled (``exact`` False) and peaks below it."""
    with PeakMemory() as run:  # resets the mark to the resident size now
        peaks = SectionPeaks(run.start_bytes)
        with peaks.track("grows"):
            block = torch.ones(64 * 2**20 // 4)  # 64 MiB written: resident, past the reset mark
            del block
        with peaks.track("small"):
            torch.ones(16)
    frame = peaks.to_frame()
    if not run.own_peak:
        pytest.skip("this system cannot reset the process's high-water mark (/proc/self/clear_refs)")
    assert frame["exact"].tolist() == [True, False], frame
    assert frame["peak_MiB"][1] <= frame["peak_MiB"][0], frame
