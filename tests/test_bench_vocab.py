"""A vocabulary large next to the model's width (262k tokens on a width-64 model, where one
sequence's logits weigh about as much as the weights): scoring text holds one pass's logits
once, never a second float32 copy of them for the loss."""

from __future__ import annotations

import sys

import pytest
import torch

from massive_lens import tiny_model
from massive_lens.core.budget import LOSS_CHUNK_BYTES, logit_batches, weight_bytes
from massive_lens.metrics import perplexity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (VmHWM)")
VOCAB, SEQ_LEN = 262_144, 128


def _peak_above_start(call) -> int:
    from benchmarks.harness import peak_memory_of

    return int(peak_memory_of(call) * 2**20)


def test_the_loss_of_a_262k_vocabulary_holds_the_logits_once():
    model = tiny_model("llama", vocab_size=VOCAB)
    tokens = torch.randint(0, 256, (2, SEQ_LEN))
    tokens[:, 0] = model.tokenizer.bos_token_id
    logits = SEQ_LEN * VOCAB * 4  # one sequence's float32 logits: about the weights' size here
    assert logits > 0.9 * weight_bytes(model)
    assert [len(b) for b in logit_batches(model, tokens)] == [1, 1]  # one sequence a pass
    perplexity(model, tokens[:1, :8], progress=False)  # wire lazy state first
    peaks = [_peak_above_start(lambda: perplexity(model, tokens, progress=False)) for _ in range(3)]
    # one pass's logits, the loss's float32 chunk (8 MB) and as much again for the activations; a
    # log-softmax over 32 positions (32 MB, as before) or of a whole sequence would not fit
    assert min(peaks) < logits + 2 * LOSS_CHUNK_BYTES, [p / 2**20 for p in peaks]
