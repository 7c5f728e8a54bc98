"""Routing: which experts each token goes to, and the tables that carry the choice.

`router.py` (`TopKRouter`: scores, top-k, group limits, the aux-free bias), `tables.py` (`TokenCopies` /
`PaddedCopies`: where each token's copies go and how their outputs come back), `capacity.py` (capacity-factor
dropping), `token_rounding.py` (each expert's pairs a multiple of the GEMM tile). Recording and replaying every
layer's choices (routing replay) hooks `MoE` layers, so it lives a floor above them, in dtensor_moe/replay.py.
Import the modules themselves; this package imports nothing.
"""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = ["capacity", "router", "tables", "token_rounding"]
