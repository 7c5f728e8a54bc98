"""Planning tools (`dtensor-moe plan` and `explain`): cost model, folding search, report, presets. Torch-free."""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = ["folding", "presets"]
