"""Benchmarks: cost ratios against a plain forward pass, one area per module
(``detect``, ``origin``, ``attention``, ``train``), one harness (:mod:`.harness`).
Run ``python -m benchmarks --write docs/benchmarks.md``."""
