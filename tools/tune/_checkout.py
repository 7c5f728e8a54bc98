"""Imported first by the tuners here, as benchmarks/_checkout.py is by the benchmarks: this checkout's `dtensor_moe`
on `sys.path`, so that `python tools/tune/<script>.py` runs from a clone whether or not the package is installed (the
GPU machine has no install) and measures this checkout's kernels, not another copy's."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
