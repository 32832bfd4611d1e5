"""Attention sinks as a fixed bias.

Tokens that carry massive activations attract most of the attention (the *attention
sink*). After the layer norm their hidden states are nearly identical sparse vectors, so
their keys and values barely depend on the input. Sun et al. (2024, section 4.2) split the
attention output of a head at query ``q`` with sink set C as

    sum_{i in C} p_qi v_i   +   sum_{i not in C} p_qi v_i
    (sink term)                 (content term)

and observe that the sink term is nearly the same vector at every query and for every
input: an implicit attention bias. This module measures both halves:

- :func:`sink_attention`: per layer and head, the attention mass queries put on the sink
  positions, and the sink metric of Gu et al. (2024): the share of heads whose mean
  attention to the first token (over the first 64 queries) exceeds a threshold (0.3);
- :func:`decompose_attention`: the two terms per layer, head and query position, mapped
  through ``W_O`` into the residual stream (``b_O`` kept separate), so that
  sink + content + b_O reconstructs the attention output exactly; and how constant each
  term is (relative standard deviation and mean pairwise cosine, across query positions
  and across texts). Grouped-query attention (query head h reads kv head
  ``h // (n_heads // n_kv_heads)``) and value biases (inside ``v``) are handled.

The sinks default to the positions that act as sinks (:func:`find_sinks`, the rule of
:class:`~massive_lens.core.criterion.SinkRule`): they draw attention from a large share of
heads, or carry a massive activation that persists across layers; a dim that crosses the
massive criterion at one early layer does not make its positions sinks. A sequence with
none falls back to its first token. Every result says which positions it treated as sinks
(:class:`SinkSet`: count per sequence and token kinds). On models with a post-attention norm
(Gemma 2/3) the decomposed output is the one *before* that norm
(``blocks.{l}.attn.hook_out``), since the norm is not linear; the summary says so. Where the
output projection has its own hook (``attn.o.hook_out``: exactly ``z @ W_O + b_O``) that is
the output decomposed, so an attention module that adds the residual itself (BLOOM) splits
too. The split is checked: an attention whose output sink + content + b_O does not
reconstruct (a norm between the heads and ``W_O``, a gated output, latent attention) raises a
``MassiveLensError`` instead of returning numbers.

Why the first token is the sink, head by head: :func:`sink_circuit` splits the logit on it
exactly and cuts each part (:mod:`~massive_lens.attention.circuit`); :func:`norm_roles` says
whether each massive entry is a rescaler or a contributor at the next norm, and how alike and
sparse the massive tokens are after it (:mod:`~massive_lens.attention.norm_roles`).

Where an attention has its own off-switch: :func:`null_mass` (the attention to a learned sink
logit or sink slot, :mod:`~massive_lens.attention.null_mass`) and :func:`gate_census` (how often
an output gate shuts, :mod:`~massive_lens.attention.gates`).

Modules: :mod:`~massive_lens.attention.sinks` (which positions are sinks),
:mod:`~massive_lens.attention.mass` (``sink_attention``) and
:mod:`~massive_lens.attention.decompose` (``decompose_attention``).
"""

from massive_lens.attention.census import SinkCensus, sink_census
from massive_lens.attention.circuit import SinkCircuit, sink_circuit
from massive_lens.attention.decompose import AttentionDecomposition, decompose_attention
from massive_lens.attention.dormant import DormantHeads, dormant_heads
from massive_lens.attention.gates import GateCensus, gate_census
from massive_lens.attention.kv import SinkKV, sink_kv
from massive_lens.attention.mass import SinkAttention, sink_attention
from massive_lens.attention.norm_roles import NormRoles, norm_roles
from massive_lens.attention.null_mass import NullMass, null_mass
from massive_lens.attention.sinks import find_sinks

__all__ = ["AttentionDecomposition", "DormantHeads", "GateCensus", "NormRoles", "NullMass", "SinkAttention",
           "SinkCensus", "SinkCircuit", "SinkKV", "decompose_attention", "dormant_heads", "find_sinks", "gate_census",
           "norm_roles", "null_mass", "sink_attention", "sink_census", "sink_circuit", "sink_kv"]
