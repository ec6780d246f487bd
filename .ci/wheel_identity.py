"""One wheel-matrix venv's Mooncake, as the package sees it (.ci/wheels; docs/native-client.md, "Wheel matrix").

Run with the venv's interpreter: ``python .ci/wheel_identity.py --expect NAME==VERSION``. Prints where
``mooncake`` and its store library were loaded from, which distribution owns them and at what version (the
native client's own probe, ``mooncake_distribution()``), whether that pair is in ``VERIFIED_VERSIONS``, and -
with ``--native`` - what ``NativeClient.probe`` says on a store set up against an embedded master on loopback.
Exits 1 when the venv does not load its own wheel or the distribution is not the expected one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _inside(path: str, prefix: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(prefix)]) == os.path.realpath(prefix)


def _native_probe() -> dict[str, Any]:
    import mooncake.store as ms

    from mooncake_kvaddr.driver.master import EmbeddedMaster
    from mooncake_kvaddr.driver.native_client import NativeClient

    with EmbeddedMaster() as master:
        store = ms.MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", master.rpc_address)
        if rc != 0:
            return {"native_client": "store setup failed", "setup_rc": rc}
        try:
            client, reason = NativeClient.probe(store)
            if client is None:
                return {"native_client": "off", "reason": reason}
            info = {"native_client": "on", "library": client.library, "slots": client.slots}
            client.close()
            return info
        finally:
            store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", required=True, help="NAME==VERSION of the Mooncake wheel this venv adds")
    parser.add_argument("--native", action="store_true", help="also probe the native client on a live store")
    args = parser.parse_args()
    name, _, version = args.expect.partition("==")

    started = time.perf_counter()
    import mooncake
    import mooncake.store

    from mooncake_kvaddr.driver import native_client as nc

    library = nc.store_library()
    distribution = nc.mooncake_distribution()
    report: dict[str, Any] = {
        "python": sys.executable,
        "prefix": sys.prefix,
        "mooncake": mooncake.__file__,
        "mooncake.store": getattr(mooncake.store, "__file__", None),
        "store_library": library,
        "distribution": list(distribution) if distribution else None,
        "verified": distribution in nc.VERIFIED_VERSIONS,
        "native_client_setting": os.environ.get(nc.ENV_VAR),
        "import_s": round(time.perf_counter() - started, 2),
    }
    problems = []
    if not _inside(str(mooncake.__file__), sys.prefix):
        problems.append(f"mooncake was imported from outside the venv ({mooncake.__file__})")
    if library is None:
        problems.append("the store's extension module was not found")
    elif not _inside(library, sys.prefix):
        problems.append(f"the store library is outside the venv ({library})")
    if distribution != (name, version):
        problems.append(f"distribution {distribution} is not the expected ({name!r}, {version!r})")
    if args.native and not problems:
        report.update(_native_probe())
    report["problems"] = problems
    print(json.dumps(report, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
