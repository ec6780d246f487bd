"""The driver's errors (docs/errors.md): a store call that failed as a whole, one refused because the store is
not open, and a failed set-up. ``mooncake_kvaddr.driver.store`` re-exports them."""

from __future__ import annotations

__all__ = ["StoreClosedError", "StoreError", "StoreSetupError"]


class StoreError(RuntimeError):
    """A Mooncake store operation failed as a whole (not per key). ``code`` is Mooncake's, if any."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class StoreClosedError(StoreError):
    """The store is not set up yet, or is closing/closed: the call never reached Mooncake."""


class StoreSetupError(StoreError):
    """``setup()`` failed: no master reachable, client port clash, bad configuration."""
