"""What the report's first run costs: the light default against ``full``, and time estimates
taken from measured passes."""

from __future__ import annotations

import logging
import math
import re
import time

import pytest
from planting import TEXT, bos_tokens, plant_story

from massive_lens import tiny_model, trace_origin
from massive_lens.origin import verify

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
