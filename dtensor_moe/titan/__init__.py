"""torchtitan hook: `--module dtensor_moe.titan --config <fn>` trains torchtitan's MoE models with
dtensor_moe's EP x EDP x ETP. Needs torchtitan 0.3.0 (torch >= 2.13); see docs/titan.md.

`wrap_config(config)` makes any torchtitan Trainer.Config of an MoE decoder (a user's own included) one for
this hook (dtensor_moe.titan.config_registry.wrap_config).

Imports nothing at import time: `dtensor_moe.titan.cpu_train` must import nothing from torchtitan before it
switches torchtitan to the CPU, so `wrap_config` is looked up (and torchtitan imported) on first use.
"""

__all__ = ["wrap_config"]


def __getattr__(name: str):
    if name == "wrap_config":
        from .config_registry import wrap_config

        return wrap_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
