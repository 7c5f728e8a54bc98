"""Imported first by the GPU checks here, as benchmarks/_checkout.py is by the benchmarks: this checkout's
`dtensor_moe` and `tests/` on `sys.path`, so that `python tests/gpu/<script>.py` runs from a clone whether or not the
package is installed (the GPU machine has no install) and never imports another copy of the package."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
