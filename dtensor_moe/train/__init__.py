"""The main job (`dtensor-moe train`): model, data, optimizer, loop, metrics, checkpoints, export, and its
configuration."""
