"""Issue 52 on a retrofitted model: ``sink_predictor`` on a model built by ``retrofit`` (a tiny
Llama with a planted massive activation, removed, its attention swapped, one fine-tuning step),
saved by the run (``save_models``) and read back through the retrofit's own path
(``load_retrofitted``, safetensors), measured on the bridge that computes its variant
(``analysis_bridge``), as ``scripts/quant_retrofit_predictor.py`` does with the real ones."""

from __future__ import annotations

import math

import pytest
import torch
from planting import TEXT, plant_sink

from massive_lens import tiny_model
from massive_lens.core.criterion import SINK_QUERIES
from massive_lens.quant.predictor import sink_predictor
from massive_lens.train.hf_attention import attention_modules
from massive_lens.train.retrofit import retrofit
from massive_lens.train.retrofit_parts import analysis_bridge, load_retrofitted


def retrofitted(tmp_path, variant: str):
    """``<variant>-removed`` after one retrofit step, saved by the run and loaded back."""
    model = tiny_model("llama")
    plant_sink(model)  # a massive activation for the retrofit to remove
    retrofit(model, [f"{variant}-removed"], steps=1, batch_size=2, seq_len=16, data=TEXT, eval_data=TEXT,
             eval_every=1, eval_seqs=1, measure=False, progress=False, save_models=tmp_path)
    return load_retrofitted(tmp_path / f"{variant}-removed_seed0")


def tokens(bos: int, n: int = 4, seq_len: int = 24) -> torch.Tensor:
    x = torch.randint(0, 256, (n, seq_len), generator=torch.Generator().manual_seed(1))
    x[:, 0] = bos
    return x


def first_key_mass(hf: torch.nn.Module, x: torch.Tensor) -> list[float]:
    """Per layer, the first queries' attention on key 0, read from the Hugging Face model's own
    swapped attention (its unfused path; no bridge, no TransformerLens hooks)."""
    seen = []
    queries = min(SINK_QUERIES, x.shape[1])
    for module in attention_modules(hf):
        tap = module.ml_tap
        tap.on = True
        tap.hook_pattern = lambda p, tap=tap: seen.append(float(p[:, :, :queries, 0].mean())) or p
    try:
        with torch.no_grad():
            hf(x, use_cache=False)
    finally:
        for module in attention_modules(hf):
            del module.ml_tap.hook_pattern
            module.ml_tap.on = False
    return seen


@pytest.mark.parametrize("variant", ["softmax1", "softmax"])
def test_sink_predictor_on_a_retrofitted_model(tmp_path, variant):
    hf, tokenizer, meta = retrofitted(tmp_path, variant)
    assert meta["variant"] == variant and tokenizer is not None
    bridge = analysis_bridge(hf, tokenizer, name=meta["setting"])
    x = tokens(tokenizer.bos_token_id)
    before = {k: v.clone() for k, v in bridge.state_dict().items()}
    p = sink_predictor(bridge, x[:2], calibration=x[2:], seq_len=x.shape[1], n_seqs=2, setting="W4A4@tensor")
    frame = p.frame
    n_layers = len(attention_modules(hf))
    assert frame.layer.tolist() == list(range(n_layers))
    # the bridge computes the saved model's variant: its sink mass is the swapped model's own
    assert frame.sink_mass.tolist() == pytest.approx(first_key_mass(hf, x[:2]), rel=1e-4, abs=1e-6)
    assert all(math.isfinite(d) for d in frame.damage) and frame.damage.abs().max() > 0
    assert set(p.correlations.x) == {"sink_mass", "dispersion", "underflow"}
    after = bridge.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is left as it was


def test_softmax1_changes_the_sink_mass(tmp_path):
    """The check above can fail: the variant (an extra 1 in the denominator) moves the mass."""
    masses = {}
    for variant in ("softmax1", "softmax"):
        hf, tokenizer, _ = retrofitted(tmp_path, variant)
        masses[variant] = first_key_mass(hf, tokens(tokenizer.bos_token_id)[:2])
    assert all(a < b for a, b in zip(masses["softmax1"], masses["softmax"], strict=True))
