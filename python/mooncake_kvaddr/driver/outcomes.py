"""Per-key results of Mooncake's batch calls: :class:`Outcome`, :class:`BatchResult`, :class:`Health`.

Mooncake answers a batch with one integer per key whose reading depends on the call (put/remove: 0, get:
bytes read, exist: 1/0; failures: a negative error code). This module turns them into classified outcomes;
the table of codes is in ``docs/configuration.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "CODE_HAS_LEASE",
    "CODE_INVALID_PARAMS",
    "CODE_MASTER_UNREACHABLE",
    "CODE_NOT_FOUND",
    "CODE_NO_SPACE",
    "CODE_TRANSFER_FAILED",
    "BatchResult",
    "Health",
    "Outcome",
]

# Mooncake ErrorCode values that callers act on (docs/configuration.md lists what each means here).
CODE_NO_SPACE: Final = -200
CODE_INVALID_PARAMS: Final = -600
CODE_NOT_FOUND: Final = -704
CODE_HAS_LEASE: Final = -706
CODE_TRANSFER_FAILED: Final = -800
CODE_MASTER_UNREACHABLE: Final = -900

class Outcome(enum.Enum):
    """What happened to one key of a batch call."""

    OK = "ok"
    NOT_FOUND = "not_found"  # -704; also ``0`` from batch_is_exist
    NO_SPACE = "no_space"  # -200: the pool is full (back-pressure; eviction frees space later)
    TRANSFER_FAILED = "transfer_failed"  # -800: bad pointer/size split, TCP queue overflow, 60 s timeout
    INVALID_PARAMS = "invalid_params"  # -600: buffer too small, empty key, zero-byte object
    MASTER_UNREACHABLE = "master_unreachable"  # -900: RPC to the master failed
    HAS_LEASE = "has_lease"  # -706: remove refused, the object is leased by a recent read
    OTHER = "other"  # any other code; the raw value is in BatchResult.codes

    @classmethod
    def from_error(cls, code: int) -> Outcome:
        """Outcome of a negative Mooncake ``ErrorCode`` (non-negative codes are op-specific)."""
        return _ERROR_OUTCOMES.get(code, cls.OTHER)


_ERROR_OUTCOMES: Final = {
    CODE_NO_SPACE: Outcome.NO_SPACE,
    CODE_INVALID_PARAMS: Outcome.INVALID_PARAMS,
    CODE_NOT_FOUND: Outcome.NOT_FOUND,
    CODE_HAS_LEASE: Outcome.HAS_LEASE,
    CODE_TRANSFER_FAILED: Outcome.TRANSFER_FAILED,
    CODE_MASTER_UNREACHABLE: Outcome.MASTER_UNREACHABLE,
}


class _Op(enum.Enum):
    """How non-negative codes read: put/remove return 0, get returns bytes, exist returns 1/0."""

    PUT = "put"
    GET = "get"
    EXIST = "exist"
    REMOVE = "remove"


def _outcome(op: _Op, code: int) -> Outcome:
    if code < 0:
        return Outcome.from_error(code)
    if op is _Op.GET:
        return Outcome.OK  # bytes read
    if op is _Op.EXIST:
        return Outcome.OK if code == 1 else Outcome.NOT_FOUND
    return Outcome.OK if code == 0 else Outcome.OTHER


def _all_succeeded(op: _Op, codes: Sequence[int]) -> bool:
    """Whether every (non-empty) code is a success for ``op``, in two C-level passes."""
    if op is _Op.GET:
        return min(codes) > 0
    if op is _Op.EXIST:
        return min(codes) == max(codes) == 1
    return min(codes) == max(codes) == 0


@dataclass(frozen=True)
class BatchResult:
    """Per-key results of one batch call, in key order.

    ``codes`` are Mooncake's raw values (put/remove: 0; get: bytes read; exist: 1/0; failures: negative
    ``ErrorCode``); ``outcomes`` are the same, classified.
    """

    codes: tuple[int, ...]
    outcomes: tuple[Outcome, ...]

    @classmethod
    def _build(cls, op: _Op, codes: Sequence[int]) -> BatchResult:
        values = tuple(codes)
        if values and _all_succeeded(op, values):
            # The common case without a Python call per key (docs/configuration.md, section 9).
            return cls(values, (Outcome.OK,) * len(values))
        return cls(values, tuple(_outcome(op, c) for c in values))

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self) -> Iterator[Outcome]:
        return iter(self.outcomes)

    def __getitem__(self, index: int) -> Outcome:
        return self.outcomes[index]

    @property
    def ok(self) -> bool:
        """True if every key succeeded (exist: every key is present). True for an empty batch."""
        return self.outcomes.count(Outcome.OK) == len(self.outcomes)  # a C-level scan, no call per key

    @property
    def present(self) -> list[bool]:
        """Per key: succeeded (for ``batch_is_exist``: the object exists)."""
        return [o is Outcome.OK for o in self.outcomes]

    @property
    def failed(self) -> list[int]:
        """Indices of the keys that did not succeed (for exist: that are absent or errored)."""
        return [i for i, o in enumerate(self.outcomes) if o is not Outcome.OK]

    @property
    def back_pressure(self) -> bool:
        """True if any key hit ``NO_SPACE``: the pool is full, callers should pause storing."""
        return Outcome.NO_SPACE in self.outcomes

    @property
    def bytes_transferred(self) -> int:
        """For gets: total bytes read by the successful keys."""
        return sum(c for c, o in zip(self.codes, self.outcomes, strict=True) if o is Outcome.OK and c > 0)

    def count(self, outcome: Outcome) -> int:
        """How many keys ended with ``outcome``."""
        return self.outcomes.count(outcome)

    def summary(self) -> dict[str, int]:
        """``{outcome value: count}`` for the outcomes that occurred (for logs)."""
        if self.ok:
            return {Outcome.OK.value: len(self.outcomes)} if self.outcomes else {}
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.value] = counts.get(o.value, 0) + 1
        return counts


class Health(enum.IntEnum):
    """Mooncake's ``health_check()`` codes."""

    OK = 0
    NOT_READY = 1  # not set up, or closed
    MASTER_UNREACHABLE = 2
