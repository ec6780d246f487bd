"""``python -m mooncake_kvaddr demo|bench ...``: the end-to-end demo (the main job) or the benchmark.

The sub-commands own their process and keep Mooncake's native log lines quiet unless ``--verbose`` (or
``MOONCAKE_KVADDR_VERBOSE=1``) asks for them; the library itself never changes logging or the environment
(``docs/configuration.md``). ``bench`` runs ``python -m mooncake_kvaddr.bench`` with the same arguments.
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a sub-command."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: python -m mooncake_kvaddr {demo,bench} [options]\n"
            "  demo   store, look up and load one request through a real Mooncake store (embedded master\n"
            "         unless --config / $MOONCAKE_CONFIG_PATH names one); --verbose shows Mooncake's logs\n"
            "  bench  side-by-side benchmark against the oracle and the numpy approach\n"
            "The demo hides Mooncake's own log lines unless --verbose or MOONCAKE_KVADDR_VERBOSE=1 is given."
        )
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from mooncake_kvaddr.demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        # A child process, not an import: nothing outside the bench package imports it (docs/architecture.md).
        return subprocess.call([sys.executable, "-m", "mooncake_kvaddr.bench", *rest])
    print(f"unknown command {command!r}: expected demo or bench", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
