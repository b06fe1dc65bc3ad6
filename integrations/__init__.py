"""Trainer integrations: adapters that let an RL trainer use Seer as its rollout.

Layer rule: these modules import only the base layer (``seer.client``, ``seer.protocol``),
never the control plane, the engines or vLLM; a trainer's own framework (TRL, torch) is
imported lazily by the adapter that needs it. ``batching`` is pure and torch-free.
"""
