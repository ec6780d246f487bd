"""One module per vLLM release series the plugin knows (docs/architecture.md, "Where a change goes").

What differs between releases (module and class names, the replaced methods and their parameters, the
self-check's cases, the fingerprints, which handlers are ported) is a :class:`Release` in ``v0_33``/``v0_34``;
the engine, the planners, the patching mechanism and the checks' loops (``layouts``) are shared. A new release
is one new module here.
"""

from __future__ import annotations

from mooncake_kvaddr.integrations.vllm.releases.base import NOT_PORTED, PARTS, Release

__all__ = ["NOT_PORTED", "PARTS", "Release", "for_version", "known_series", "releases"]


def releases() -> tuple[Release, ...]:
    """Every release module's :class:`Release` (imported on first use: the entry point needs none of them)."""
    from mooncake_kvaddr.integrations.vllm.releases import v0_33, v0_34

    return (v0_33.RELEASE, v0_34.RELEASE)


def known_series() -> tuple[str, ...]:
    """Every series prefix any release module covers, without importing one (the entry point decides on these)."""
    return ("0.32.", "0.33.", "0.34.")


def for_version(version: str) -> Release | None:
    """The release module that covers ``version``, or None."""
    return next((release for release in releases() if release.matches(version)), None)
