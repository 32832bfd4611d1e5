"""Handing the detector to the tools that need it: SAE trainers, abliteration tools, half precision.

Other projects rewrite a massive-activation or sink detector by hand: SAELens and
dictionary_learning drop the first token or high-norm positions from SAE training, heretic
keeps massive dims out of its abliteration direction, and half-precision users hit float16
overflow. This subpackage gives them the library's own definitions (``find_massive``'s
:class:`~massive_lens.Criterion` and ``sink_census``'s levels), in the shapes they take:

- :func:`exclusion_mask`: a bool ``[batch, pos]`` mask of the positions to leave out, with a
  reason each, a token-id list (SAELens) and a keep-mask for an activation store;
- :func:`norm_thresholds`: a norm-multiple threshold per layer (dictionary_learning);
- :func:`massive_dims`: the dims to keep out of a direction, as a small JSON file;
- :func:`precision_check`: whether float16 / bfloat16 hold the model's values, confirmed by
  running it in each;
- :func:`outlier_severity`: γ = ‖μ‖/‖σ‖ per layer and hook, with and without the massive and
  sink positions, and the SAE dead-latent share a fit implies;
- :func:`sae_check`: an SAE's reconstruction error at massive and sink positions against the
  rest, and the latents that fire only there.
"""

from massive_lens.core.stats import spearman_interval
from massive_lens.handover.dims import MassiveDims, massive_dims, read_dims
from massive_lens.handover.gamma import (
                                         DeadShareFit,
                                         OutlierSeverity,
                                         fit_dead_share,
                                         gamma_of,
                                         outlier_severity,
)
from massive_lens.handover.masks import ExclusionMask, NormThresholds, exclusion_mask, norm_thresholds
from massive_lens.handover.offswitch import OffSwitch, offswitch
from massive_lens.handover.precision import PrecisionCheck, precision_check
from massive_lens.handover.sae import SAECheck, sae_check

__all__ = ["OffSwitch", "offswitch",
           "DeadShareFit", "ExclusionMask", "MassiveDims", "NormThresholds", "OutlierSeverity", "PrecisionCheck",
           "SAECheck", "exclusion_mask", "fit_dead_share", "gamma_of", "massive_dims", "norm_thresholds",
           "outlier_severity", "precision_check", "read_dims", "sae_check", "spearman_interval"]
