"""Python's garbage collector at fixed steps, the same on every rank.

Left to itself the collector runs when a rank's allocation counts say so: a full collection over a large
process (the model's modules, compiled code, the data) stalls that rank for tens of milliseconds at a step no
other rank shares, and under data parallelism every other rank waits for it in the next collective. Off
between collections, it then runs on every rank at the same steps: the cost is paid once, together.
"""

from __future__ import annotations

import gc


def collect_at(step: int, every: int) -> None:
    """At the start of optimizer step `step`: the automatic collector off, a full collection every `every` steps,
    step 0 included (what an earlier job in the same process left, e.g. `loom verify` after `train`); full, not
    the young generations alone: cycles that reached the oldest would otherwise never be freed. `every` = 0
    leaves the collector to Python."""
    if every <= 0:
        return
    if gc.isenabled():
        gc.disable()
    if step % every == 0:
        gc.collect()
