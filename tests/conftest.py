import warnings

import pytest

from .harness import close_all, idle_leaks

_SHARED_SCOPES = ("class", "module", "package")  # session fixtures run once per test process anyway


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks (--dist loadgroup)
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
        item.add_marker(pytest.mark.xdist_group(f"{baseid}::{name}"))
    items.sort(key=lambda item: item not in shared)  # stable: collection order within each part


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    leaks = idle_leaks()  # every task's groups and meshes must be gone once it returned
    close_all()
    if leaks:
        warnings.warn(f"rank pool workers kept state between tasks: {leaks}", stacklevel=1)
