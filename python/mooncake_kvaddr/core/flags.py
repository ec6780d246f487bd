"""The one reader of on/off settings (environment variables and config keys, docs/configuration.md).

Every switch of the package spells "on" and "off" the same way. A value that is neither is refused with the
setting named (as vLLM's own boolean variables refuse one), never read as the default: ``PLUGIN=disabled``
must not leave a plugin on. Where a refusal must not raise (vLLM's plugin start-up), it is a warning and off.
"""

from __future__ import annotations

import logging
import reprlib
from typing import Final

__all__ = ["OFF", "ON", "flag"]

ON: Final = frozenset({"1", "true", "on", "yes"})
OFF: Final = frozenset({"0", "false", "off", "no"})


def flag(value: object, default: bool, name: str, *, or_off: str | None = None) -> bool:
    """``value`` (a string, a bool or an int; ``None`` when unset) as on/off; ``default`` when it is unset or
    blank (an empty ``NAME=``). Case and surrounding blanks do not matter. Any other value, ``"disabled"`` or
    ``2`` say, is a ``ValueError`` naming ``name`` (the variable or config key it came from).

    ``or_off``: a logger name, for a caller that must not raise (the vLLM plugin's start-up): a refused value
    is then one warning there, naming ``name``, and reads off (the safe side)."""
    if value is None:
        return default
    text = str(value).strip().lower()
    if not text:
        return default
    if text in ON:
        return True
    if text in OFF:
        return False
    problem = (
        f"{name}={reprlib.repr(value)} is neither on nor off: use one of {', '.join(sorted(ON))} "
        f"or {', '.join(sorted(OFF))}"
    )
    if or_off is None:
        raise ValueError(problem)
    logging.getLogger(or_off).warning("mooncake_kvaddr: %s; switched off", problem)
    return False
