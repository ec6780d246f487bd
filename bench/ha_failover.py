"""Leader kills during a store / lookup / load workload on an embedded HA cluster: what a failover costs.

Run from the repository root (after an in-place build)::

    PYTHONPATH=python python3 bench/ha_failover.py [--kills 20] [--replication none,oplog] [--json PATH]

For each replication setting, one cluster (etcd + ``--masters`` HA masters on loopback, driver/cluster.py) and
one client run the workload of tests/ha_workload.py (fresh 16-chunk requests stored, looked up and loaded in a
loop, every loaded block compared with what was stored, every call timed against its deadline) while the
leader is SIGKILLed ``--kills`` times (the killed master is restarted as a standby after each failover).
Before each kill two probe requests are stored: one ``--settle`` seconds before it, one just before it.
Each setting runs in a child process of its own: Mooncake's client connects to one etcd per process, for the
life of the process. Prints, per setting: wrong bytes, calls past their deadline, time to service (median,
worst) and how many chunks of each probe request the new leader still serves. docs/deployment.md quotes the output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ha_workload import Pair, Workload, kill_and_measure, store_config, summary
from mooncake_kvaddr.driver.cluster import EmbeddedCluster
from mooncake_kvaddr.driver.store import MooncakeStore

#: Replication settings: the masters' extra flags. "snapshot" needs a directory, filled in per run.
REPLICATION: dict[str, list[str]] = {
    "none": [],
    "oplog": ["-enable_oplog=true"],
    "snapshot": [
        "-enable_snapshot=true",
        "-enable_snapshot_restore=true",
        "-snapshot_interval_seconds=1",
        "-snapshot_object_store_type=local",
    ],
    "oplog+snapshot": [
        "-enable_oplog=true",
        "-enable_snapshot=true",
        "-enable_snapshot_restore=true",
        "-snapshot_interval_seconds=1",
        "-snapshot_object_store_type=local",
    ],
}


def run(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = list(REPLICATION[setting])
    with tempfile.TemporaryDirectory(prefix="ha_failover_snap_") as snap:
        env = {"MOONCAKE_SNAPSHOT_LOCAL_PATH": snap} if "snapshot" in setting else {}
        # INFO logs (to private files): a stuck election is reported with the masters' last state lines.
        cluster = EmbeddedCluster(masters=args.masters, master_args=flags, master_env=env, log_level=0)
        with cluster:
            store = MooncakeStore(store_config(cluster, args.request_timeout, args.mode)).setup()
            try:
                pair = Pair(store, args.mode, "workload")
                probe = Pair(store, args.mode, "probe")
                workload = Workload(pair, [])
                workload.start()
                kills = []
                started = time.monotonic()
                try:
                    for i in range(args.kills):
                        result = kill_and_measure(cluster, probe, workload, 1000 + i, settle_s=args.settle)
                        kills.append(result)
                        print(
                            f"  [{setting}] kill {i + 1}/{args.kills}: master #{result.killed}, service "
                            f"{result.service_s:.2f} s, settled {result.settled_survived}/16, "
                            f"fresh {result.fresh_survived}/16" + (f"; STUCK: {result.stuck}" if result.stuck else ""),
                            flush=True,
                        )
                    time.sleep(1.0)  # the workload runs on the last leader a moment too
                finally:
                    workload.stop()
                    pair.close()
                    probe.close()
                report = summary(kills, workload.stats, args.request_timeout)
                report["setting"] = setting
                report["master_flags"] = flags
                report["wall_s"] = round(time.monotonic() - started, 1)
                return report
            finally:
                store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="leader kills per setting (20)")
    parser.add_argument("--masters", type=int, default=2, help="HA masters (2)")
    parser.add_argument("--replication", default="none,oplog", help=f"comma-separated, of {sorted(REPLICATION)}")
    parser.add_argument("--request-timeout", type=float, default=10.0, help="StoreConfig.request_timeout_s (10)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between the settled probe and the kill")
    parser.add_argument("--mode", default="auto", help="transfer mode (auto)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # one setting, here
    args = parser.parse_args()
    settings = [s.strip() for s in args.replication.split(",") if s.strip()]
    for setting in settings:
        if setting not in REPLICATION:
            parser.error(f"--replication: unknown setting {setting!r}; known: {sorted(REPLICATION)}")
    if args.child is not None:
        args.child.write_text(json.dumps(run(settings[0], args)))
        return 0
    reports = []
    for setting in settings:
        with tempfile.TemporaryDirectory(prefix="ha_failover_") as tmp:
            out = Path(tmp) / "report.json"
            command = [sys.executable, __file__, "--replication", setting, "--child", str(out)]
            for name in ("kills", "masters", "request_timeout", "settle", "mode"):
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            done = subprocess.run(command, check=False)
            if done.returncode != 0 or not out.exists():
                print(f"{setting}: the run failed (exit status {done.returncode})", file=sys.stderr)
                return 2
            report = json.loads(out.read_text())
        reports.append(report)
        service = report["service_s"]
        print(
            f"{setting}: {report['kills']} kills; wrong blocks {report['wrong_blocks']}; calls past the "
            f"{args.request_timeout:g} s deadline {report['calls_past_deadline']}; unloadable hits "
            f"{report['unloadable_hits']}; API errors {len(report['errors'])}; time to service median "
            f"{service['median']} s, worst {service['worst']} s; settled chunks surviving "
            f"{sum(report['settled_survived'])}/{16 * report['kills']}, fresh "
            f"{sum(report['fresh_survived'])}/{16 * report['kills']}; longest call "
            f"{max(v['max_s'] for v in report['calls'].values())} s; standby never took over "
            f"{len(report['stuck_failovers'])} time(s)",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "settings": reports}, indent=2) + "\n")
    bad = any(r["wrong_blocks"] or r["calls_past_deadline"] or r["unloadable_hits"] or r["errors"] for r in reports)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
