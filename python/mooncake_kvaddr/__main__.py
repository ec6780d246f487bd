"""``python -m mooncake_kvaddr demo|bench ...``: the end-to-end demo (the main job) or the benchmark.

The sub-commands own their process: they keep Mooncake's native log lines quiet unless ``--verbose`` (or
``MOONCAKE_KVADDR_VERBOSE=1``) asks for them, and end on Ctrl-C with one line and exit status 130; the library
itself never changes logging, signals or the environment (``docs/configuration.md``). ``bench`` runs
``python -m mooncake_kvaddr.bench`` with the same arguments.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Final

from mooncake_kvaddr._version import __version__

USAGE: Final = """usage: python -m mooncake_kvaddr {demo,bench} [options]
       python -m mooncake_kvaddr --version
  demo   store one request's KV cache in a real Mooncake store, look it up, load it into a second cache and
         verify every byte (an embedded master on loopback unless --config / $MOONCAKE_CONFIG_PATH names one)
  demo --cluster  the same through etcd and two HA masters on loopback, killing the leader mid-run
  bench  benchmark against what this package replaces: numpy address rows as vLLM 0.33 computes them, Python
         key strings, Mooncake's bound methods, vLLM's one-call transfers; --vllm adds vLLM 0.33.0's own
         layouts and send/receive threads. Every table names its baseline
'<command> --help' says more. Both hide Mooncake's own log lines unless --verbose or MOONCAKE_KVADDR_VERBOSE=1;
Ctrl-C ends either with one line ("interrupted") and exit status 130."""

# How long the bench's child may take to end after Ctrl-C was passed on before it is killed.
_CHILD_GRACE_S: Final = 5.0


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a sub-command."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)  # --help: stdout; no command, a usage error
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"mooncake_kvaddr {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        from mooncake_kvaddr._cli import exit_on_interrupt

        with exit_on_interrupt():  # before the demo's imports: Ctrl-C while they load is one line too
            if "--cluster" in rest:
                from mooncake_kvaddr.demo_cluster import main as cluster_main

                return cluster_main([arg for arg in rest if arg != "--cluster"])
            from mooncake_kvaddr.demo import main as demo_main

            return demo_main(rest)
    if command == "bench":
        # A child process, not an import: nothing outside the bench package imports it (docs/architecture.md).
        return _run_child([sys.executable, "-m", "mooncake_kvaddr.bench", *rest])
    print(f"unknown command {command!r}: expected demo or bench (or --help, --version)", file=sys.stderr)
    return 2


def _run_child(command: list[str]) -> int:
    """Run ``command`` and return its exit status; Ctrl-C is passed on to it (a terminal sends it to both), and
    a child that has not ended :data:`_CHILD_GRACE_S` later is killed (then this prints the line itself). The
    child gets SIGTERM when this process ends otherwise (SIGTERM, SIGKILL): it never runs on orphaned."""
    from mooncake_kvaddr._cli import INTERRUPTED_EXIT, INTERRUPTED_LINE
    from mooncake_kvaddr.driver.process import pdeathsig_preexec

    child = subprocess.Popen(command, preexec_fn=pdeathsig_preexec())  # SIGTERM when this process ends
    interrupted: list[float] = []

    def pass_on(signum: int, frame: FrameType | None) -> None:
        interrupted.append(time.monotonic())
        if child.poll() is None:
            child.send_signal(signum)

    previous = signal.signal(signal.SIGINT, pass_on)
    try:
        while True:
            try:
                status = child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            else:
                return 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell says
            if interrupted and time.monotonic() - interrupted[0] > _CHILD_GRACE_S:
                child.kill()
                child.wait()
                print(INTERRUPTED_LINE, file=sys.stderr)
                return INTERRUPTED_EXIT
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    raise SystemExit(main())
