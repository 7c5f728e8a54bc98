"""Planning tools (`dtensor-moe plan` and `explain`): cost model, folding search, report, presets. Torch-free."""
