"""The paper-scale simulator: a virtual clock, engine cost models, workloads and simulated
speculative decoding, driving the real control-plane scheduler core.

A composition root beside ``cli/``: it may import ``seer`` (base) and the control plane's
pure core; nothing but ``cli/``, benchmarks and tests imports it.
"""
