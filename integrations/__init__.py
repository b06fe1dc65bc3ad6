"""Adapters that let RL trainers (TRL, veRL) use Seer as their rollout; they import only ``seer`` and the trainer."""
