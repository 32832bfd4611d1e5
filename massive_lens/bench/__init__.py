"""Benchmarks: cost ratios against a plain forward pass, one area per module
(``detect``, ``origin``, ``attention``, ``train``), one harness (:mod:`.harness`).
Run ``python -m massive_lens.bench --write docs/benchmarks.md``."""
