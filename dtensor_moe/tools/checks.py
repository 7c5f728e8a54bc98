"""Argument checks shared by the tools' input dataclasses and their command lines.

Each check raises a one-line ValueError that names what was wrong (`Hardware.gpu_mem_gib`, `--top`)
and the valid range. Booleans are not integers here, and floats are not accepted where an integer
is required (`gpus=64.0` is an error, not 64).
"""

import math
import numbers


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    """`value` is an integer in [minimum, maximum] (no upper bound when maximum is None)."""
    if _is_int(value) and value >= minimum and (maximum is None or value <= maximum):
        return
    valid = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    raise ValueError(f"{name} must be an integer {valid}, got {value!r}")


def check_positive(name: str, value) -> None:
    """`value` is a finite real number > 0 (an int or a float, not a bool)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return
    raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if isinstance(value, str) and value in choices:
        return
    raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def check_type(name: str, value, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {what}, got {value!r}")
