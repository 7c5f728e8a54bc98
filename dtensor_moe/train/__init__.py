"""The main job (`dtensor-moe train`): model, data, optimizer, loop, metrics, checkpoints, export, and its
configuration."""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = [
    "checkpoint", "config", "data", "data_files", "export", "hf_checkpoint", "hf_config", "loop", "loss", "metrics",
    "model", "optim", "parallel", "prelaunch", "reference", "supervision", "token_cache", "tokenizer",
]
