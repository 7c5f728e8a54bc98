"""Instrumentation as context managers: what a block of code sent, or how often it waited for the device.

    with count("sent_bytes") as sent:   # exchange.count_sent_bytes()
        model(x).sum().backward()
    sent[("tokens", "there")]           # bytes this rank's all-to-alls sent to other ranks in that block

A counter exists only while its block runs (blocks nest, each sees what ran inside it), so no process-wide total
grows and nothing has to be cleared between measurements. `add` costs one dict lookup when nothing counts.
"""

import collections
import contextlib

__all__ = ["add", "count"]

_ACTIVE: dict[str, list[collections.Counter]] = {}


def add(kind: str, key, n: int = 1) -> None:
    """Adds `n` under `key` to every open `count(kind)` block's counter."""
    for counter in _ACTIVE.get(kind, ()):
        counter[key] += n


@contextlib.contextmanager
def count(kind: str):
    """Counts what `add(kind, ...)` records while the block runs.

    Args:
        kind (str): what is counted, e.g. "sent_bytes" (parallel/exchange.py) or "host_syncs" (kernels/policy.py).

    Returns:
        collections.Counter: filled as the block runs, kept after it.
    """
    counter = collections.Counter()
    _ACTIVE.setdefault(kind, []).append(counter)
    try:
        yield counter
    finally:
        _ACTIVE[kind].remove(counter)
