"""One example of every public result type, on tiny models (shared by the contract and the
save/load tests through the session fixture ``result_examples`` in ``conftest.py``)."""

from __future__ import annotations

import importlib
import pkgutil
from types import SimpleNamespace

import torch
from planting import SINK_DIM, bos_tokens, plant_misranked, plant_sink

import massive_lens
from massive_lens import (
    calibrate,
    decompose_attention,
    find_massive,
    layer_profile,
    measure_outliers,
    perplexity,
    run_interventions,
    scan_corpus,
    sink_attention,
    tiny_model,
    trace_origin,
)
from massive_lens.attention.census import sink_census
from massive_lens.attention.circuit import sink_circuit
from massive_lens.attention.dormant import dormant_heads
from massive_lens.attention.gates import gate_census
from massive_lens.attention.kv import sink_kv
from massive_lens.attention.norm_roles import norm_roles
from massive_lens.attention.null_mass import null_mass
from massive_lens.core.criterion import SinkRule
from massive_lens.core.results import Result
from massive_lens.effects import compression_valley, over_mixing, repeated_token_probe, streaming_window
from massive_lens.handover import (
    exclusion_mask,
    massive_dims,
    norm_thresholds,
    offswitch,
    outlier_severity,
    precision_check,
    sae_check,
)
from massive_lens.interventions import head_curve, sink_dependence, sink_scale_sweep
from massive_lens.origin import verify_super_weights
from massive_lens.quant import fewest_float16, granularity_table, lowbit_grid, quantize_grid, sink_predictor
from massive_lens.train import compare_variants, retrofit, train_model, training_stability
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM

RESULT_TYPES = ["MassiveActivations", "LayerProfile", "CorpusScan", "OriginTrace", "SinkAttention",
                "AttentionDecomposition", "Perplexity", "Calibration", "InterventionTable", "OutlierReport",
                "TrainRun", "Comparison", "Retrofit", "LowBitGrid", "SinkCensus", "SinkKV", "DormantHeads",
                "ExclusionMask", "NormThresholds", "MassiveDims", "PrecisionCheck", "SAECheck", "HeadCurve",
                "CompressionValley", "StreamingWindow", "OverMixing", "RepeatedToken", "Quantization",
                "TrainingStability", "SinkCircuit", "NormRoles", "OutlierSeverity", "SinkScaleSweep",
                "SuperWeightCheck", "SinkDependence", "GranularityTable", "Float16Search", "SinkPredictor",
                "NullMass", "GateCensus", "OffSwitch"]


TEXT = "The cat sat. The dog ran!\nA bird sang, loudly. " * 8
TINY_TRAIN = dict(steps=2, data="One. Two, three.\n" * 100, model=dict(n_layers=1, d_model=16, n_ctx=16))


def all_result_types() -> set[type]:
    for info in pkgutil.walk_packages(massive_lens.__path__, "massive_lens."):
        importlib.import_module(info.name)
    found, todo = set(), [Result]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("massive_lens.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def result_examples() -> dict[str, object]:
    model = tiny_model("llama")
    return {
        "MassiveActivations": find_massive(model, "Hello there."),
        "LayerProfile": layer_profile(model, ["One text.", "Two texts."]),
        "CorpusScan": scan_corpus(model, TEXT, seq_len=16, max_tokens=64, progress=False),
        "OriginTrace": trace_origin(model, "Hi.", dim=3, pos=0),
        "SinkAttention": sink_attention(model, "Hello world."),
        "AttentionDecomposition": decompose_attention(model, "Hello world.", sinks=[0]),
        "Perplexity": perplexity(model, TEXT, seq_len=16, n_seqs=2, progress=False),
        "Calibration": calibrate(model, TEXT, seq_len=16, n_seqs=2, progress=False),
        "InterventionTable": run_interventions(model, TEXT, calibration=TEXT[::-1], seq_len=16, n_seqs=2,
                                               settings=["sink_term_mean"], progress=False),
        "OutlierReport": measure_outliers(MassiveLM(MassiveLMConfig(n_layers=2, d_model=32, n_heads=2)), TEXT,
                                          seq_len=16, n_seqs=2),
        "TrainRun": train_model("smoke", progress=False, **TINY_TRAIN),
        "Comparison": compare_variants(["softmax"], preset="smoke", seeds=[0], progress=False, measure_seqs=1,
                                       **TINY_TRAIN),
        "LowBitGrid": lowbit_grid(model, TEXT, settings=["W8A8", "W4A16"], seq_len=16, n_seqs=2),
        "Quantization": quantize_grid(model, TEXT, settings=["W8A8", "W4A4KV4+hadamard+kvsink"], seq_len=16, n_seqs=2,
                                      calibration=TEXT[::-1]),
        "SinkCensus": sink_census(model, ["The cat sat. The dog ran!", "A bird sang, loudly."]),
        "SinkKV": sink_kv(model, "The cat sat. The dog ran!"),
        "DormantHeads": dormant_heads(model, "The cat sat. The dog ran!"),
        "Retrofit": retrofit(_planted(), ["softmax-kept"], steps=1, batch_size=1, seq_len=16, data=TEXT,
                             eval_data=TEXT, eval_every=1, eval_seqs=1, measure=False, progress=False),
        "ExclusionMask": exclusion_mask(_planted(), ["The cat sat. The dog ran!", "A bird sang."]),
        "NormThresholds": norm_thresholds(_planted(), TEXT, seq_len=16, n_seqs=2),
        "MassiveDims": massive_dims(_planted(), TEXT, seq_len=16, n_seqs=2),
        "PrecisionCheck": precision_check(_planted(), TEXT, seq_len=16, n_seqs=2),
        "SAECheck": sae_check(_planted(), StandInSAE(64), TEXT, seq_len=16, n_seqs=2),
        "HeadCurve": head_curve(model, TEXT, calibration=TEXT[::-1], shares=(0.25,), draws=2, seq_len=16, n_seqs=2),
        "CompressionValley": compression_valley(_planted(), TEXT, seq_len=16, n_seqs=2, calibration=TEXT[::-1]),
        "StreamingWindow": streaming_window(model, TEXT, window=4, sinks=(0, 1), seq_len=24, n_seqs=2, bins=4),
        "OverMixing": over_mixing(model, TEXT, seq_len=16, n_seqs=2, calibration=TEXT[::-1]),
        "RepeatedToken": repeated_token_probe(model, "a", 12, text=TEXT, seq_len=16, n_seqs=2),
        "TrainingStability": training_stability(train_model("smoke", progress=False, **TINY_TRAIN)),
        "SinkCircuit": sink_circuit(_planted(), "The cat sat. The dog ran!", heads=[(1, 0)],
                                    rule=SinkRule(threshold=0.01)),  # random tiny heads spread their attention
        "NormRoles": norm_roles(_planted(), "The cat sat. The dog ran!"),
        "OutlierSeverity": outlier_severity(_planted(), TEXT, seq_len=16, n_seqs=2),
        "SinkScaleSweep": sink_scale_sweep(model, TEXT, gammas=(0.5,), seq_len=16, n_seqs=2, repeat_len=4,
                                           repeat_seqs=2),
        "SuperWeightCheck": _super_weights(),
        "SinkDependence": sink_dependence(model, TEXT, seq_len=16, n_seqs=2, heads=[(1, 0)], progress=False),
        "GranularityTable": granularity_table(model, TEXT, bases=["W8A8"], granularities=["tensor", "token"], extra=[],
                                              seq_len=16, n_seqs=2),
        "Float16Search": fewest_float16(model, TEXT, setting="W4A4@tensor", seq_len=16, n_seqs=2),
        "SinkPredictor": sink_predictor(model, TEXT, seq_len=16, n_seqs=2),
        "NullMass": null_mass(tiny_model("gpt_oss"), "The cat sat. The dog ran!"),
        "GateCensus": gate_census(tiny_model("qwen3_next"), "The cat sat. The dog ran!"),
        "OffSwitch": offswitch(tiny_model("gpt_oss"), "The cat sat. The dog ran!", precision=False),
    }


def _super_weights():
    planted = plant_misranked(tiny_model("llama"))
    tokens = bos_tokens(planted, TEXT, 16, 4)
    trace = trace_origin(planted, tokens[:1], dim=SINK_DIM, pos=0)
    return verify_super_weights(planted, trace, tokens, progress=False)


class StandInSAE:
    """What ``sae_check`` reads of a SAELens SAE (``encode``, ``decode``, ``cfg``), without sae-lens:
    ``d_sae = 2 * d_in`` latents (``relu(x)`` and ``relu(-x)``) decoded to ``scale * x``."""

    def __init__(self, d_in: int, hook: str = "blocks.1.hook_resid_post", scale: float = 0.9):
        self.cfg = SimpleNamespace(d_in=d_in, hook_name=hook)
        self.scale = scale

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, -x], -1).relu()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        d = self.cfg.d_in
        return self.scale * (z[..., :d] - z[..., d:])


def _planted():
    model = tiny_model("llama")
    plant_sink(model)
    return model


