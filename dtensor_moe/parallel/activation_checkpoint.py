"""The activation-checkpoint modes and their check, torch-free: `dtensor-moe train` validates
training.activation_checkpoint before it imports torch, and compile.py applies the modes."""

AC_MODES = ("none", "full", "selective")


def check_activation_checkpoint(mode, prefix: str = "") -> None:
    """`prefix` names the field's section (e.g. "training.") so the message names the field the user set."""
    if not (isinstance(mode, str) and mode in AC_MODES):
        raise ValueError(f"{prefix}activation_checkpoint must be one of {list(AC_MODES)}, got {mode!r}")
