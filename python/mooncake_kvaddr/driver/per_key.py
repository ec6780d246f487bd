"""The per-key fields of Mooncake's ``ReplicateConfig``, cut with their keys (docs/native-client.md, "Per-key
config fields").

Mooncake answers -600 for every key of a put whose per-key field (``group_ids``) does not hold one value per key.
Every place that splits or filters a put (region budget, row widths, the range guard, staging rounds, and the
native client's guard through its C++ helper) builds each part's config here, so that each value goes with its key.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import MutableSequence, Sequence, Sized
from typing import Any, Final

__all__ = ["PER_KEY_CONFIG_FIELDS", "check_count", "config_for", "configs_for", "put_back"]

#: The fields of Mooncake's ``ReplicateConfig`` that hold one value per key of the call (Mooncake 0.3.13:
#: ``group_ids``, set by vLLM's send thread with group semantics). The one table: a field Mooncake adds later
#: that is per key goes here, and every split cuts it too. ``None`` (unset) means "not per key".
PER_KEY_CONFIG_FIELDS: Final[tuple[str, ...]] = ("group_ids",)


def config_for(config: Any, picks: Sequence[int], n: int) -> Any:
    """The replicate config of a part of a put of ``n`` keys that holds the keys at ``picks`` (in that order).

    ``config`` itself when no per-key field is set (``None``), or when the part is the whole call in order;
    else a copy of it whose per-key fields hold the values at ``picks``. The caller's config is never changed.
    A per-key field that does not hold ``n`` values (Mooncake refuses the whole call) stays wrong in every
    part: it keeps its values, or gets one more when their number happens to be the part's, so that each part
    is refused as the whole call would be."""
    per_key = [(name, value) for name in PER_KEY_CONFIG_FIELDS if (value := getattr(config, name, None)) is not None]
    if not per_key:
        return config
    picked = list(picks)
    if picked == list(range(n)):
        return config
    part = _copy(config)
    for name, values in per_key:
        setattr(part, name, _cut(values, picked, n))
    return part


def configs_for(configs: tuple[Any, ...], picks: Sequence[int], n: int) -> tuple[Any, ...]:
    """:func:`config_for` over a call's optional config argument (a tuple of none or one config)."""
    return tuple(config_for(config, picks, n) for config in configs)


def _cut(values: Any, picks: list[int], n: int) -> Any:
    if isinstance(values, (str, bytes)):
        return values  # not a sequence of per-key values: Mooncake decides, as with the whole call
    try:
        count = len(values)
    except TypeError:
        return values
    if count == n:
        return [values[i] for i in picks]
    if count != len(picks):
        return list(values)
    return [*values, values[-1]] if count else [""]


def _copy(config: Any) -> Any:
    """A new config equal to ``config``: its type's no-argument constructor, then every read-write property (a
    pybind11 class such as ``ReplicateConfig``: it cannot be pickled or copied) and the instance dict; checked by
    ``str`` where the type defines it (Mooncake's lists every field). Other objects: ``copy.copy``."""
    cls: Any = type(config)
    try:
        fresh = cls()
    except Exception:
        return copy.copy(config)
    for name in _settable(cls):
        setattr(fresh, name, getattr(config, name))
    state = getattr(config, "__dict__", None)
    if isinstance(state, dict) and state:
        fresh.__dict__.update(state)
    if getattr(cls, "__str__", None) is not object.__str__ and str(fresh) != str(config):  # cls writes its own str
        raise TypeError(f"cannot copy this {cls.__qualname__} field by field (its str differs): not split")
    return fresh


@functools.cache
def _settable(cls: type) -> tuple[str, ...]:
    """The read-write properties of ``cls`` (its own and inherited; the most derived definition decides)."""
    names: dict[str, bool] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            names[name] = isinstance(value, property) and value.fset is not None
    return tuple(name for name, settable in names.items() if settable)


def check_count(
    answers: Sized, n: int, who: str = "Mooncake", error: type[Exception] = RuntimeError, unit: str = " keys"
) -> None:
    """The one check of a batch call's answers: exactly one per key of the call, else ``error`` naming both
    (``unit`` after the count: a ranged read answers per buffer and names no unit)."""
    if len(answers) != n:
        raise error(f"{who} returned {len(answers)} results for {n}{unit}")


def put_back(
    results: MutableSequence[Any], picks: Sequence[int], answers: Any, who: str = "Mooncake", unit: str = " keys"
) -> None:
    """The one merge: the answers of a call made for the keys at ``picks`` go back to those places of
    ``results``, in order (:func:`check_count` first: a short or long answer never lands on the wrong key)."""
    got = answers if type(answers) is list else list(answers)
    check_count(got, len(picks), who, unit=unit)
    for i, value in zip(picks, got, strict=True):
        results[i] = value
