import warnings

import pytest

from .harness import close_all, idle_leaks


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    leaks = idle_leaks()  # every task's groups and meshes must be gone once it returned
    close_all()
    if leaks:
        warnings.warn(f"rank pool workers kept state between tasks: {leaks}", stacklevel=1)
