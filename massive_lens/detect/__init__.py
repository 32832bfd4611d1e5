"""Finding massive activations: in one text, per layer, and over a corpus.

Sun et al. (2024) call a residual-stream activation *massive* when its magnitude is above
100 **and** about 1,000 times the median magnitude of its hidden state (see
:class:`~massive_lens.Criterion`). Three views of the same measurement:

- :func:`find_massive`: every massive entry of one text (or a padded batch): layer,
  position, token, token kind, dimension, value, ratio to the median;
- :func:`layer_profile`: per layer, the top-1..k magnitudes and the median, averaged over
  texts (the paper's layer-wise figure and its Table 2 statistic);
- :func:`scan_corpus`: the same statistics streamed over a corpus, plus how often each
  (dimension, token kind) is massive.

All three hook ``blocks.{l}.hook_resid_post`` (or another residual hook), reduce each
activation in place, and stop the forward pass after the last layer they need.
"""

from massive_lens.detect.find import LayerProfile, MassiveActivations, find_massive, layer_profile
from massive_lens.detect.scan import CorpusScan, scan_corpus

__all__ = ["CorpusScan", "LayerProfile", "MassiveActivations", "find_massive", "layer_profile", "scan_corpus"]
