"""The requirements of the installed vLLM, read from its own metadata (Requires-Dist), for .ci/setup.

vLLM 0.34.0 is installed with ``--no-deps`` because one pin (``flashinfer-python==0.7.3``) is not served here;
this prints every other requirement that applies to this interpreter (markers evaluated, no extras), one per
line, so that the list follows the installed wheel instead of a copy that rots. ``--missing`` prints only those
that no installed distribution satisfies (what pip still has to install).

    python .ci/vllm_requirements.py [--missing] [--exclude NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements(exclude: set[str]) -> list[Requirement]:
    """vLLM's requirements that apply here, without extras and without the excluded names."""
    found = []
    for text in importlib.metadata.requires("vllm") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in exclude:
            continue
        found.append(req)
    return found


def satisfied(req: Requirement) -> bool:
    """True when the first installed distribution of that name on sys.path is in the requirement's range."""
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--missing", action="store_true", help="only the requirements not satisfied here")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME", help="leave this name out")
    args = parser.parse_args(argv)
    exclude: set[str] = {canonicalize_name(name) for name in args.exclude}
    for req in requirements(exclude):
        if not (args.missing and satisfied(req)):
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
