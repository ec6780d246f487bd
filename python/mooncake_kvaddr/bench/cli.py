"""``python -m mooncake_kvaddr.bench [--quick] [--json PATH] [--plot PATH] [--no-mooncake] [--vllm] [--multihost]``."""

from __future__ import annotations

import argparse
import gc

from mooncake_kvaddr._cli import native_log, verbose_requested
from mooncake_kvaddr.bench import (
    addresses,
    end_to_end,
    external,
    gil,
    keys,
    plan,
    scaling,
    tcp,
    threads,
    transfer_modes,
)
from mooncake_kvaddr.bench.harness import NO_MOONCAKE, Report, have_mooncake, skipped
from mooncake_kvaddr.bench.workload import HEADLINE, Shape

DESCRIPTION = """Side-by-side benchmark of mooncake_kvaddr against the code paths it replaces: numpy address rows
as vLLM 0.33 computes them, Python key strings, Mooncake's bound methods, vLLM 0.33's one-call multi-buffer
transfers; with --vllm, the installed vLLM's own layouts and send/receive threads with and without the plugin,
and vLLM 0.33 and 0.34 side by side (0.34 in its own environment, $MOONCAKE_KVADDR_VLLM034_VENV).

Every table names its baseline. Variants of a section run interleaved in one process, so machine noise hits
them alike: quote medians and ratios, not single absolute times (docs/benchmarks.md). Ctrl-C ends the run
with one line and exit status 130."""


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print (and optionally save) the results."""
    parser = argparse.ArgumentParser(prog="python -m mooncake_kvaddr.bench", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions: a smoke run (~1 min)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per variant (default 30; 5 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of speed-up vs request length (matplotlib)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip the sections that need a Mooncake store")
    parser.add_argument("--vllm", action="store_true",
                        help="add the vLLM sections (layouts vs vLLM's own, vLLM's real threads with the plugin) and "
                             "the releases side by side (vLLM 0.34 in a child process when its environment exists)")
    parser.add_argument("--multihost", action="store_true",
                        help="add the cross-namespace TCP section (root; builds network namespaces; minutes)")
    parser.add_argument("--verbose", action="store_true", help="let Mooncake's own log lines through")
    args = parser.parse_args(argv)
    with native_log(verbose_requested(args.verbose)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    reps = args.reps or (5 if args.quick else 30)
    quick = bool(args.quick)

    report = Report(reps, quick)
    info = report.machine
    print(f"mooncake_kvaddr {info['mooncake_kvaddr']} bench on {info['cpu']} ({info['cores']} cores), "
          f"Python {info['python']}, numpy {info['numpy']}, Mooncake {info['mooncake'] or 'not installed'}; "
          f"gc {'on' if gc.isenabled() else 'off'}")

    shape = HEADLINE
    report.add("addresses", addresses.run(shape, reps))
    key_table, lookup_table = keys.run(shape, reps)
    report.add("keys", key_table)
    report.add("lookup_keys", lookup_table)
    report.add("plan", plan.run(shape, reps))
    report.add("gil", gil.run(shape, seconds=0.3 if quick else 1.5))
    report.add("threads", threads.run(shape, requests=8 if quick else 16))
    if quick:
        report.add("scaling", scaling.run(scaling.QUICK_TOKENS, scaling.QUICK_REGIONS, reps=3))
    else:
        report.add("scaling", scaling.run(scaling.TOKENS, scaling.REGIONS, reps=max(5, reps // 4)))

    mooncake_sections = ("end_to_end", "tcp", "transfer_modes")
    if args.no_mooncake:
        for name in mooncake_sections:
            skipped(name, "--no-mooncake")
            report.add(name, None)
    elif not have_mooncake():
        for name in mooncake_sections:
            skipped(name, NO_MOONCAKE)
            report.add(name, None)
    else:
        e2e_shape = Shape(tokens=32_768) if quick else HEADLINE
        report.add("end_to_end", end_to_end.run(e2e_shape, reps=3 if quick else 10))
        # --quick stays under the TCP region budget (800 regions): every path should succeed in one call, in
        # well under a second. The full run's 100,000 regions show vLLM's single call failing, which can take
        # Mooncake's 60 s transfer timeout (docs/benchmarks.md).
        report.add("tcp", tcp.run(8 if quick else 1000, 100, 2048, reps=1 if quick else 3))
        if quick:
            shapes = [(256, 100, 2048)]
        else:  # equal payloads at 2 and 8 KiB; 32 KiB at a quarter of the chunks to fit in memory
            shapes = [(2258, 100, 2048), (2258, 100, 8192), (565, 100, 32768)]
        report.add("transfer_modes", [transfer_modes.run(c, r, b, reps=3 if quick else 7) for c, r, b in shapes])
        report.add("native_client", external.native_client(quick))
    if args.vllm:
        report.add("layouts", external.layouts(quick))
        mooncake = not args.no_mooncake and have_mooncake()
        if mooncake:
            report.add("vllm_threads", external.vllm_threads(quick))
            report.add("vllm_lookup", external.vllm_lookup(quick))
            report.add("vllm_send", external.vllm_send(quick))
            report.add("vllm_receive_cases", external.vllm_receive_cases(quick))
        report.add("vllm_releases", external.vllm_releases(report.sections, quick, args.reps, mooncake))
    if args.multihost:
        report.add("multihost", external.multihost(quick))
    if args.plot:
        scaling.plot(report.data, args.plot)
    if args.json:
        report.write(args.json)
    return 0
