"""Behind `dtensor-moe plan` and `explain`: the folding search (cost model, search, report), presets. Torch-free."""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = ["folding", "presets"]
