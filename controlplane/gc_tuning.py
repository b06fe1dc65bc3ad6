"""Garbage-collector settings of the control plane's process (and of the simulator's).

Owns one decision: how often CPython's cyclic collector runs while the scheduler works.
The scheduler keeps tens of thousands of live container objects (requests, queue
entries, in-flight maps) and allocates a few short-lived tuples per decision. With
CPython's default thresholds (a young collection every 700 net allocations) the
collector ran every few decisions and its older generations walked that whole live
graph: on the decision-rate microbenchmark (context, 16 engines, ~10,000 waiting) the
collector cost ~20 % of ``schedule()`` (docs/benchmarks.md, "Simulation cost and
decision rate").

``tune_for_service`` is called once, after start-up: it collects what start-up left,
moves every surviving object (imported modules, configuration, the tokenizer) to the
permanent generation so no later collection walks it again, and raises the young
threshold. Cyclic garbage is still collected, only less often: about every
``YOUNG_THRESHOLD`` net container allocations, with the old generations' usual ratios
behind it. Ended rollouts are not left to it (``memory.py`` takes them apart: reference
counting frees them).

The young threshold is also the size of a young collection's walk (what was allocated
since the last one and still lives: the newest rollouts' requests), and each collection
holds the event loop. At 50,000 the soak's collections stood the loop still for
40-240 ms (4-11 own-work stalls over 100 ms per 200,000 samples); at 10,000 the longest
inside a stall was 27-51 ms over 200,000 samples (112 ms once over 1,000,000), for 5-7 %
of ``schedule()``'s decision rate (docs/benchmarks.md, "Soak").
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # net container allocations between young collections (CPython: 700)
OLDER_RATIO = 10  # young collections per middle one, middle per full one (CPython's defaults)


def tune_for_service() -> None:
    """Freeze what start-up built and make young collections rarer (idempotent)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_RATIO, OLDER_RATIO)


__all__ = ["OLDER_RATIO", "YOUNG_THRESHOLD", "tune_for_service"]
