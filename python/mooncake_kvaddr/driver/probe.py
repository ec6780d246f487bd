"""Prove a peer responsive before a load lets Mooncake write into the KV cache itself.

A multi-buffer or direct get cannot be abandoned, and against a hung peer it never talked to it blocks per key.
:class:`PeerProbe` first asks the master where the keys live and reads one object from each new peer on an
abandonable thread (docs/transfer-modes.md, "Deadlines"; docs/multihost.md, "Hung peer").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.driver.outcomes import BatchResult, Outcome
from mooncake_kvaddr.driver.store import MooncakeStore, RequestDeadline, StoreError
from mooncake_kvaddr.driver.workers import CallAbandoned, CallRunner

__all__ = ["PROBE_MAX_BYTES", "PeerProbe", "PeerScreen"]

logger = logging.getLogger(__name__)

BoolArray = npt.NDArray[np.bool_]

#: A peer is probed with its smallest object among the request's keys, if that is at most this many bytes
#: (a KV chunk is far smaller); a peer whose objects are all larger is not probed.
PROBE_MAX_BYTES: Final = 64 << 20
#: Probe outcomes that mean the peer does not answer (its keys are not handed to Mooncake).
_PEER_DOWN: Final = (Outcome.TRANSFER_FAILED, Outcome.MASTER_UNREACHABLE)


class PeerScreen:
    """What the probe decided for a get's keys.

    ``stop``: the request must end here (the deadline carries the reason); no key goes to Mooncake.
    ``allowed``: per key, whether it may go to Mooncake (``None``: all). ``endpoints``: per key, the peers
    holding it (``None``: unknown), for :meth:`PeerProbe.forget`.
    """

    __slots__ = ("allowed", "endpoints", "stop")

    def __init__(
        self,
        *,
        stop: bool = False,
        allowed: BoolArray | None = None,
        endpoints: Sequence[tuple[str, ...]] | None = None,
    ) -> None:
        self.stop = stop
        self.allowed = allowed
        self.endpoints = endpoints


_GO: Final = PeerScreen()


class PeerProbe:
    """Remembers the peers this client has read from and probes new ones (see the module docstring).

    ``max_abandoned``: abandoned probes (and queries) in flight before new requests stop at once instead of
    starting another. Thread-safe: receive threads share one probe.
    """

    def __init__(self, store: MooncakeStore, max_abandoned: int) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self._unsupported = False
        #: Runs the replica queries and the probe reads.
        self.calls = CallRunner(max_abandoned, name="KVTransferPeerProbe")
        self.probes = 0  # probe reads made (test and log aid)

    @property
    def known(self) -> frozenset[str]:
        """The peers proven responsive since they were last forgotten."""
        with self._lock:
            return frozenset(self._known)

    def close(self) -> None:
        """End the idle probe threads (an abandoned probe's thread ends when Mooncake returns)."""
        self.calls.close()

    def screen(self, keys: Sequence[str], deadline: RequestDeadline) -> PeerScreen:
        """Probe the new peers holding ``keys``; which keys may go to Mooncake (see :class:`PeerScreen`)."""
        if self._unsupported or not keys:
            return _GO
        if deadline.expired() or self.calls.refuse(deadline.stop, "peer probe(s)", "get"):
            return PeerScreen(stop=True)
        try:
            pending = self.calls.submit(
                lambda: self._store.replica_locations(keys), deadline.remaining(), lambda _exc: None
            )
            located = pending.wait(deadline.remaining())
        except CallAbandoned:
            deadline.stop(
                f"the request deadline of {deadline.timeout_s or 0:g} s passed while the master was asked where "
                "the keys live: no key was handed to Mooncake"
            )
            return PeerScreen(stop=True)
        except Exception as exc:  # the master's answer is advice: the get meets a real failure itself
            logger.warning("peer probe: replica query failed (%r); the get goes ahead unprobed", exc)
            return _GO
        if located is None:
            self._unsupported = True
            logger.info("peer probe: the Mooncake client has no replica query; peers are not probed")
            return _GO
        endpoints = [tuple(dict.fromkeys(e for e, _ in places)) for places in located]
        with self._lock:
            new = {e for places in endpoints for e in places} - self._known
        down: set[str] = set()
        for endpoint in sorted(new):
            if deadline.expired():
                return PeerScreen(stop=True)
            choice = _probe_key(keys, located, endpoint)
            if choice is None:
                continue  # only objects too large to probe: unproven, the get goes ahead
            outcome = self._probe(endpoint, *choice, deadline)
            if outcome is None:
                return PeerScreen(stop=True)
            if outcome is Outcome.OK:
                with self._lock:
                    self._known.add(endpoint)
            elif outcome in _PEER_DOWN:
                down.add(endpoint)
        if not down:
            return PeerScreen(endpoints=endpoints)
        # A key goes ahead if one of its replicas is on a peer not found down (Mooncake picks the replica).
        allowed = np.fromiter(
            (not places or any(e not in down for e in places) for places in endpoints), dtype=bool, count=len(keys)
        )
        return PeerScreen(allowed=allowed, endpoints=endpoints)

    def forget(self, endpoints: Sequence[tuple[str, ...]] | None, failed: BoolArray) -> None:
        """Forget the peers of the keys whose get failed: they are probed again before the next get."""
        if endpoints is None or not failed.any():
            return
        gone = {e for i in np.flatnonzero(failed) for e in endpoints[int(i)]}
        with self._lock:
            self._known -= gone

    def _probe(self, endpoint: str, key: str, nbytes: int, deadline: RequestDeadline) -> Outcome | None:
        """Read ``key`` (``nbytes``, held by ``endpoint``) into a fresh buffer; its outcome, or ``None`` when
        the probe was abandoned at the deadline (which is then stopped with the reason)."""
        buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        ptr = int(buffer.ctypes.data)
        registered = True
        try:  # needed on RDMA, harmless on TCP
            self._store.register_buffer(ptr, max(nbytes, 1))
        except StoreError as exc:
            logger.debug("peer probe: buffer not registered (%s); probing anyway", exc)
            registered = False
        keep = [buffer]  # the buffer lives until Mooncake no longer writes it

        def release(_exc: BaseException | None = None) -> None:
            if registered:
                try:
                    self._store.unregister_buffer(ptr)
                except StoreError as exc:  # also a store closed meanwhile
                    logger.debug("peer probe: unregister failed: %s", exc)
            keep.clear()

        del buffer
        self.probes += 1
        pending = None
        try:
            pending = self.calls.submit(
                lambda: self._store.batch_get_into([key], [ptr], [nbytes], check_values=False, deadline=deadline),
                deadline.remaining(),
                release,
            )
            got: BatchResult = pending.wait(deadline.remaining())
        except CallAbandoned:
            deadline.stop(
                f"the request deadline of {deadline.timeout_s or 0:g} s passed while probing peer {endpoint}, which "
                "this client had not read from yet: it does not answer; no key was handed to Mooncake (the probe "
                "was abandoned and still runs)"
            )
            logger.warning("peer probe of %s abandoned: %s", endpoint, deadline.reason)
            return None
        except StoreError as exc:
            release()
            logger.info("peer probe of %s failed: %s", endpoint, exc)
            return Outcome.OTHER  # the get meets the same error itself
        except BaseException:
            if pending is None or not pending.abandoned:
                release()  # an abandoned call releases when it returns
            raise
        release()
        code = got.codes[0]
        if code == nbytes:
            return Outcome.OK
        outcome = got.outcomes[0]
        logger.info("peer probe of %s: %s (code %d)", endpoint, outcome.value, code)
        return Outcome.OTHER if outcome is Outcome.OK else outcome


def _probe_key(
    keys: Sequence[str], located: Sequence[tuple[tuple[str, int], ...]], endpoint: str
) -> tuple[str, int] | None:
    """The smallest object among ``keys`` held by ``endpoint`` alone (else by it among others), if it is at
    most :data:`PROBE_MAX_BYTES`."""
    best: tuple[int, int, str] | None = None  # (not alone, bytes, key)
    for key, places in zip(keys, located):
        for where, nbytes in places:
            if where != endpoint or not 0 < nbytes <= PROBE_MAX_BYTES:
                continue
            rank = (0 if all(e == endpoint for e, _ in places) else 1, nbytes, key)
            if best is None or rank < best:
                best = rank
    return None if best is None else (best[2], best[1])
