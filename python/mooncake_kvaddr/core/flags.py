"""The one reader of on/off settings (environment variables and config keys, docs/configuration.md).

Every switch of the package spells "on" and "off" the same way; a value that is neither keeps the default.
"""

from __future__ import annotations

from typing import Final

__all__ = ["OFF", "ON", "flag"]

ON: Final = frozenset({"1", "true", "on", "yes"})
OFF: Final = frozenset({"0", "false", "off", "no"})


def flag(value: object, default: bool) -> bool:
    """``value`` (a string, a bool or an int; ``None`` when unset) as on/off; ``default`` when it is unset or
    spells neither (case and surrounding blanks do not matter)."""
    if value is None:
        return default
    text = str(value).strip().lower()
    if text in ON:
        return True
    if text in OFF:
        return False
    return default
