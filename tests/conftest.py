import sys
import warnings
from pathlib import Path

import pytest

from .harness import close_all, idle_leaks

# The scripts of benchmarks/, tests/gpu/ and tools/tune/ import their siblings (`_checkout`, `routing`,
# `titan_torch211`, `expert_gemms`) from their own folder, which is on sys.path when one runs as a script; tests
# import them as modules, and the harness's rank processes inherit this. Each folder's `_checkout` puts this same
# checkout on sys.path.
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("benchmarks", "tests/gpu", "tools/tune")]

_SHARED_SCOPES = ("class", "module", "package")  # session fixtures run once per test process anyway


@pytest.hookimpl(hookwrapper=True)  # before every plugin's hook: pytest-xdist reads the marks in its own
def pytest_collection_modifyitems(items):
    """Tests that share a class-, module- or package-scoped fixture, directly or through other fixtures,
    form one xdist_group, so the fixture runs once, on one test process; the others are scheduled one by
    one. The groups (the longest serial chains: torchtitan's Trainer runs, Hugging Face checkpoints) come
    first, so that the other test process works through the single tests meanwhile instead of waiting for
    a group scheduled last. Fixtures that do not share a set-up split a module into separate groups."""
    parent = {}

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        keys = [
            (defs[-1].baseid, name)
            for name, defs in (info.name2fixturedefs.items() if info else ())
            if defs and defs[-1].scope in _SHARED_SCOPES
        ]
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
        if keys:
            shared[item] = keys[0]
    for item, key in shared.items():
        baseid, name = root(key)
        item.add_marker(pytest.mark.xdist_group(f"{baseid.replace('/', '.').replace('::', '.')}.{name}"))
    items.sort(key=lambda item: item not in shared)  # stable: collection order within each part
    yield
    # pytest-xdist 3.8 names a test's group by appending it to `item._nodeid`, which pytest >= 9 no longer
    # reads (Node.nodeid is str(item._id)): without this every xdist_group was silently ignored and each test
    # process ran the torchtitan and Hugging Face fixtures itself.
    if not hasattr(pytest.Item, "id"):  # pytest < 9: nodeid is _nodeid
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        renamed = getattr(item, "_nodeid", None)
        if renamed and renamed != item.nodeid:
            item._id = coerce_node_id(renamed)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    leaks = idle_leaks()  # every task's groups and meshes must be gone once it returned
    close_all()
    if leaks:
        warnings.warn(f"rank pool workers kept state between tasks: {leaks}", stacklevel=1)
