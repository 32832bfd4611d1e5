"""What the sink does for the model: one experiment per published claim.

- :func:`compression_valley` (Queipo-de-Llano et al., 2025): per layer, the matrix entropy of
  the representations, the first token's norm and the sink rate, with and without the massive
  activations;
- :func:`streaming_window` (Xiao et al., 2023, StreamingLLM): perplexity with a rolling window
  of recent tokens and the first ``k`` tokens kept, positions within the cache;
- :func:`over_mixing` (Barbero et al., 2025): how far a small perturbation of one early token
  spreads to later tokens, with the sinks intact and with attention to them removed;
- :func:`repeated_token_probe` (Yona et al., 2025): a token repeated after the first token, the
  layer-0 head and the MLP neuron that make the repeats look like the first token, and a patch.

Each takes the glossary's arguments (``corpus``/``text``, ``layers``, ``seq_len``, ``n_seqs``),
leaves the model as found and returns a result with ``summary``, ``to_frame``, ``plot`` and ``save``.
"""

from massive_lens.effects.mixing import OverMixing, over_mixing
from massive_lens.effects.repeated import RepeatedToken, repeated_token_probe
from massive_lens.effects.streaming import StreamingWindow, streaming_window
from massive_lens.effects.valley import CompressionValley, compression_valley, matrix_entropy

__all__ = ["CompressionValley", "OverMixing", "RepeatedToken", "StreamingWindow", "compression_valley",
           "matrix_entropy", "over_mixing", "repeated_token_probe", "streaming_window"]
