"""Routing: which experts each token goes to, and the tables that carry the choice.

`router.py` (`TopKRouter`: scores, top-k, group limits, the aux-free bias), `tables.py` (`TokenCopies` /
`PaddedCopies`: where each token's copies go and how their outputs come back), `capacity.py` (capacity-factor
dropping), `token_rounding.py` (each expert's pairs a multiple of the GEMM tile), `replay.py` (recorded choices
replayed in a later forward). Import the modules themselves; this package imports nothing, so `moe.py` and the
routing modules that read it import each other's files without a circle.
"""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = ["capacity", "replay", "router", "tables", "token_rounding"]
