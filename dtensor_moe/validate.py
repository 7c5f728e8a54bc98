"""Type and range checks for the config dataclasses, with messages that name the field and its valid values.

Torch-free: `dtensor-moe plan` validates configs without importing torch.

    check_fields(self, "model.", top_k=Range(1, "num_experts"), score_func=("softmax", "sigmoid"))

Every field is checked against its annotation (int, float, bool, str) first; bools are not ints,
ints are fine where a float is expected, floats must be finite. Then each named rule: a `Range`
(bounds may name another field), a tuple of choices, or a string that only describes the valid
values in the type error (the caller checks the range itself).

The tools' inputs and command-line flags (`Hardware.gpu_mem_gib`, `--top`) use the single-value checks at
the end, with the same type rules and messages.
"""

import math
import numbers
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Range:
    lo: float | str | None = None  # a number, or the name of another field of the same object
    hi: float | str | None = None
    lo_open: bool = False  # lo < value instead of lo <= value

    def describe(self, obj) -> str:
        lo, hi = (_bound(obj, b) for b in (self.lo, self.hi))
        if lo is not None and hi is not None and not self.lo_open:
            return f"in {lo}..{self.hi} ({hi})" if isinstance(self.hi, str) else f"in {lo}..{hi}"
        parts = []
        if lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {lo}")
        if hi is not None:
            parts.append(f"<= {hi}")
        return " and ".join(parts)

    def holds(self, obj, v) -> bool:
        lo, hi = (_bound(obj, b) for b in (self.lo, self.hi))
        if lo is not None and (v <= lo if self.lo_open else v < lo):
            return False
        return hi is None or v <= hi


def at_least(n) -> Range:
    return Range(lo=n)


def above(n) -> Range:
    return Range(lo=n, lo_open=True)


def _bound(obj, b):
    return getattr(obj, b) if isinstance(b, str) else b


def _type_ok(kind, v) -> bool:
    if type(v) is kind:  # the common case, without the abstract-class checks (the folding search builds ~10^4 meshes)
        return kind is not float or math.isfinite(v)
    if kind is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if kind is int:
        return isinstance(v, numbers.Integral)
    if kind is float:
        return isinstance(v, numbers.Real) and math.isfinite(v)
    return isinstance(v, kind)


_KIND = {int: "an int", float: "a finite number", bool: "a bool (true or false)", str: "a string"}


def _valid(kind, rule, obj) -> str:
    if isinstance(rule, tuple):
        return f"one of {list(rule)}"
    text = _KIND.get(kind, f"a {getattr(kind, '__name__', kind)}")
    if isinstance(rule, Range):
        return f"{text} {rule.describe(obj)}"
    return f"{text} {rule}" if isinstance(rule, str) else text


_CHECKED: dict[type, tuple[frozenset[str], tuple[tuple[str, type], ...]]] = {}


def _checked_fields(cls) -> tuple[frozenset[str], tuple[tuple[str, type], ...]]:
    """(every field name, (name, type) of the fields with a checked type) of a dataclass: read once per
    class, since `fields()` costs more than the checks (the folding search builds ~10^4 MoEParallelDims)."""
    if cls not in _CHECKED:
        fs = fields(cls)
        _CHECKED[cls] = frozenset(f.name for f in fs), tuple((f.name, f.type) for f in fs if f.type in _KIND)
    return _CHECKED[cls]


def check_fields(obj, prefix: str, **rules):
    """Raises ValueError for the first field of dataclass `obj` whose type or value is invalid."""
    names, typed = _checked_fields(type(obj))
    unknown = rules.keys() - names
    assert not unknown, f"rules for unknown fields {sorted(unknown)}"
    # All types first: a Range may bound one field by another, which must be a number by then.
    for name, kind in typed:
        v = getattr(obj, name)
        if not _type_ok(kind, v):
            got = f"{v!r} ({type(v).__name__})" if not isinstance(v, float) else repr(v)
            raise ValueError(f"{prefix}{name} must be {_valid(kind, rules.get(name), obj)}, got {got}")
    for name, rule in rules.items():
        v = getattr(obj, name)
        if isinstance(rule, tuple) and v not in rule:
            raise ValueError(f"{prefix}{name} must be one of {list(rule)}, got {v!r}")
        if isinstance(rule, Range) and not rule.holds(obj, v):
            if isinstance(rule.hi, str) and v > _bound(obj, rule.hi):  # the bound is another field: name it
                hi = _bound(obj, rule.hi)
                raise ValueError(
                    f"{prefix}{name} ({v}) must be <= {rule.hi} ({hi}); valid {name}: {_bound(obj, rule.lo)}..{hi}"
                )
            raise ValueError(f"{prefix}{name} must be {rule.describe(obj)}, got {v!r}")


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    """`value` is an int in [minimum, maximum] (no upper bound when maximum is None); 64.0 is not an int."""
    rule = Range(minimum, maximum)
    if not (_type_ok(int, value) and rule.holds(None, value)):
        raise ValueError(f"{name} must be {_valid(int, rule, None)}, got {value!r}")


def check_positive(name: str, value) -> None:
    """`value` is a finite real number > 0 (an int or a float, not a bool)."""
    rule = above(0)
    if not (_type_ok(float, value) and rule.holds(None, value)):
        raise ValueError(f"{name} must be {_valid(float, rule, None)}, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def check_type(name: str, value, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {what}, got {value!r}")
