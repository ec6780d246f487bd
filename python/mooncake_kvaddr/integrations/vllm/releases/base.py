"""The record a release module fills in (see the package's docstring), apart from the modules themselves."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mooncake_kvaddr.integrations.vllm.plans import Kinds

if TYPE_CHECKING:
    from mooncake_kvaddr.integrations.vllm.send import SendRules

__all__ = ["NOT_PORTED", "PARTS", "Release"]

#: How every ``Release.not_ported`` reason starts (logged at INFO: by design, not a failed check).
NOT_PORTED = "not ported to vLLM"
#: Parts of the plugin besides the layouts, in patch order (``Release.ported`` names those a release has).
PARTS = ("worker", "receive", "lookup", "send")


@dataclass(frozen=True)
class Release:
    """Everything release-specific the plugin needs to check and patch one vLLM release series."""

    #: Version prefixes of the series, e.g. ``("0.32.", "0.33.")``.
    series: tuple[str, ...]
    #: Module holding the store layout classes the layout replacements go into.
    layout_module: str
    #: ``(class name, method name, ours)`` installed on ``layout_module``'s classes.
    replacements: tuple[tuple[str, str, Callable[..., Any]], ...]
    #: ``check_shape(layout_module, worker_module or None)``: "" or the first mismatch.
    check_shape: Callable[[ModuleType, ModuleType | None], str]
    #: ``self_check(layout_module)``: raises AssertionError naming the first difference from vLLM's own.
    self_check: Callable[[ModuleType], None]
    #: Part -> the vLLM functions ("Class.method" or a worker-module function) each part was checked against.
    fingerprinted: Mapping[str, tuple[str, ...]]
    #: Release (e.g. "0.33.0") -> "Class.method" -> fingerprint (registry.fingerprint) of vLLM's function.
    fingerprints: Mapping[str, Mapping[str, str]]
    #: Which of :data:`PARTS` are ported to this series; the others keep vLLM's own, with ``not_ported`` said.
    ported: frozenset[str] = field(default_factory=frozenset)
    not_ported: str = ""
    #: The handlers' planning: our layout methods by role (``rank_local_prepare_values``, ...: a layout class
    #: whose methods are these is backed by our engine) and, per layout kind, ``layout -> (engine, key prefix
    #: per local shard)`` (or why not).
    ours: Mapping[str, Any] = field(default_factory=dict)
    plan_engines: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    #: The worker's transport hook: the ``MooncakeStoreWorker`` methods (name -> parameters after self) it wraps.
    #: ``register_kv_caches`` wraps the store and runs with the wrapper as ``self.store``; each of the others runs
    #: with that wrapper as ``self.store`` again (``close`` last: it drops the pair). A missing one is a mismatch.
    worker_methods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The lookup's release-specific rules (``lookup.LookupRules``: the candidate units, the hit's helpers).
    lookup_rules: Any = None
    #: A token database's chunk-size attribute, and the TP-shared layout's attribute it must equal.
    db_chunk: str = "block_size"
    sharded_chunk: str = "block_size"

    #: ``ChunkedTokenDatabase.process_tokens``'s parameters after self (the walk the handlers reproduce), and
    #: how the handlers' self-checks build this release's layouts (``receive_check.SampleLayouts``).
    process_tokens: tuple[str, ...] = ()
    sample_layouts: Callable[..., Any] | None = None
    #: What the send handler does this release's own way (``send.SendRules``; None where it is not ported).
    send_rules: SendRules | None = None

    def kinds(self, data: ModuleType, layout: ModuleType) -> Kinds:
        """Which of this release's databases and layouts the handlers may plan (``plans.Kinds``)."""
        return Kinds(data, self.ours, layouts=layout, db_chunk=self.db_chunk, sharded_chunk=self.sharded_chunk)

    def matches(self, version: str) -> bool:
        return version.startswith(self.series)
