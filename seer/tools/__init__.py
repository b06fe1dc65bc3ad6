"""Tools that agentic RL examples call from a rollout (``seer.tools.python_sandbox``)."""
