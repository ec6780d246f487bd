"""An embedded Mooncake HA cluster on loopback (:class:`EmbeddedCluster`): one etcd and several HA masters.

Mooncake's masters elect their leader through etcd and clients name the cluster as ``etcd://host:port``.
The failover tests, the failover benchmark and ``demo --cluster`` need such a cluster that they can start,
ask who leads, break (SIGKILL the leader) and stop without leaking a process; this is it, everything on
127.0.0.1 (docs/deployment.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from mooncake_kvaddr.driver.master import (
    HA_MASTER_FLAGS,
    MasterError,
    check_master_args,
    check_start_options,
    find_master_binary,
    free_ports,
)
from mooncake_kvaddr.driver.process import LOOPBACK, STDERR_TAIL_BYTES, ChildOwner, ChildProcess, health, owns_listener

__all__ = [
    "ETCD_PACKAGE",
    "ClusterError",
    "EmbeddedCluster",
    "EmbeddedEtcd",
    "HaMaster",
    "MasterStatus",
    "etcd_install_hint",
    "find_etcd_binary",
]

#: The Debian/Ubuntu package that provides ``/usr/bin/etcd`` (3.4 on Debian 12).
ETCD_PACKAGE: Final = "etcd-server"
_ETCD_PATH: Final = "/usr/bin/etcd"
_PORT_ATTEMPTS: Final = 3
_POLL_S: Final = 0.05


class ClusterError(MasterError):
    """etcd or a master of the cluster could not be found, started, or did not become ready."""


def etcd_install_hint() -> str:
    """How to get etcd: the Debian package and the binary it installs."""
    return (
        f"etcd is not installed (no 'etcd' on PATH): on Debian/Ubuntu run 'apt-get install {ETCD_PACKAGE}' "
        f"(it provides {_ETCD_PATH}), or pass etcd_binary= the path of an etcd 3.4 or newer"
    )


def find_etcd_binary() -> Path:
    """Path of the ``etcd`` server on ``PATH``; :class:`ClusterError` naming the package when there is none."""
    found = shutil.which("etcd")
    if found is None:
        raise ClusterError(etcd_install_hint())
    return Path(found)


@dataclass(frozen=True)
class MasterStatus:
    """What an HA master's ``/health`` answers: its role, whether it serves, and whom it sees leading."""

    role: str  # "leader" or "standby"
    ha_state: str  # "serving", "standby", "leader_warmup", ...
    service_ready: bool
    leader_address: str  # "host:port" of the leader this master knows of ("" if none)
    view_version: int  # bumped by every election

    @property
    def serving(self) -> bool:
        """This master leads and answers clients."""
        return self.role == "leader" and self.service_ready


def _master_status(port: int) -> MasterStatus | None:
    answer = health(port)
    if answer is None:
        return None
    try:
        body = json.loads(answer)
        return MasterStatus(
            role=str(body["role"]),
            ha_state=str(body.get("ha_state", "")),
            service_ready=bool(body.get("service_ready", False)),
            leader_address=str(body.get("leader_address", "")),
            view_version=int(body.get("view_version", 0)),
        )
    except (ValueError, KeyError, TypeError):
        return None  # a master without HA answers plain text, not this JSON


class _Child:
    """What etcd and each master share: a named child process (started by ``ChildProcess.start``) and its log."""

    def __init__(self, name: str, state: ChildProcess) -> None:
        self._name = name
        self._state = state

    @property
    def pid(self) -> int | None:
        """PID of the running process, ``None`` when it is not running."""
        popen = self._state.popen
        return popen.pid if popen is not None and popen.poll() is None else None

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        """The last ``limit`` bytes it logged."""
        return self._state.stderr_tail(limit)


class EmbeddedEtcd(_Child):
    """A single-member etcd on 127.0.0.1 with its data in a private temporary directory."""

    def __init__(self, state: ChildProcess, binary: Path, data_dir: Path) -> None:
        super().__init__("etcd", state)
        self._binary = binary
        self._data_dir = data_dir
        self.client_port = 0
        self.peer_port = 0

    @property
    def endpoint(self) -> str:
        """``"127.0.0.1:<client port>"``: what the masters' ``-etcd_endpoints`` and clients' ``etcd://`` name."""
        return f"{LOOPBACK}:{self.client_port}"

    def healthy(self) -> bool:
        """etcd answers ``{"health": "true"}`` on its client port."""
        answer = health(self.client_port)
        if answer is None:
            return False
        with contextlib.suppress(ValueError, AttributeError):
            return str(json.loads(answer).get("health")) == "true"
        return False

    def start(self, timeout_s: float) -> None:
        """Start on free ports and wait until healthy; a lost port race retries with new ones."""
        self._state.start(
            self._name,
            self._command,
            lambda pid: self.healthy() and owns_listener(pid, self.client_port),
            timeout_s=timeout_s,
            attempts=_PORT_ATTEMPTS,
            ports=lambda: f"client port {self.client_port}, peer port {self.peer_port}",
            waited_for='/health never answered {"health": "true"}',
            error=ClusterError,
        )

    def _command(self) -> list[str]:
        self.client_port, self.peer_port = free_ports(2)
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        client = f"http://{LOOPBACK}:{self.client_port}"
        # A fresh member directory per attempt: a half-initialised one names the old peer URL.
        shutil.rmtree(self._data_dir / "member", ignore_errors=True)
        return [
            str(self._binary),
            "--name=mooncake-kvaddr",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=mooncake-kvaddr={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=warn",
        ]


class HaMaster(_Child):
    """One ``mooncake_master -enable_ha=true`` of an :class:`EmbeddedCluster`, on fixed loopback ports."""

    def __init__(
        self, index: int, state: ChildProcess, command: Callable[[int, int], list[str]], env: Mapping[str, str]
    ) -> None:
        super().__init__(f"mooncake_master_{index}", state)
        self.index = index
        self._command = command
        self._env = dict(env)
        self.rpc_port = 0
        self.metrics_port = 0

    @property
    def rpc_address(self) -> str:
        """``"127.0.0.1:<rpc port>"``, as the masters publish the leader's address in etcd."""
        return f"{LOOPBACK}:{self.rpc_port}"

    def status(self) -> MasterStatus | None:
        """Its ``/health`` answer, ``None`` when it does not answer (stopped, starting, killed)."""
        if not self.alive:
            return None
        return _master_status(self.metrics_port)

    def serving(self) -> bool:
        """It leads, says it is ready, and its own process holds the RPC port clients are sent to."""
        status = self.status()
        pid = self.pid
        return status is not None and status.serving and pid is not None and owns_listener(pid, self.rpc_port)

    def start(self, timeout_s: float, *, new_ports: bool) -> None:
        """Start and wait until it answers ``/health`` (as a standby or leader); ``new_ports`` picks ports."""

        def command() -> list[str]:
            if new_ports:
                self.rpc_port, self.metrics_port = free_ports(2)
            return self._command(self.rpc_port, self.metrics_port)

        self._state.start(
            self._name,
            command,
            lambda pid: _master_status(self.metrics_port) is not None and owns_listener(pid, self.metrics_port),
            timeout_s=timeout_s,
            attempts=_PORT_ATTEMPTS if new_ports else 1,
            ports=lambda: f"rpc port {self.rpc_port}, metrics port {self.metrics_port}",
            waited_for="/health never answered as a leader or standby",
            error=ClusterError,
            env=self._env,
        )

    def kill(self) -> None:
        """SIGKILL it (a crash) and reap it. Safe when it is not running."""
        self._state.stop(kill=True)

    def stop(self) -> None:
        """SIGTERM it, SIGKILL after a bounded grace period (it goes down within about a second)."""
        self._state.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.alive else "stopped"
        return f"HaMaster(#{self.index}, rpc={self.rpc_port}, metrics={self.metrics_port}, {state})"


class EmbeddedCluster(ChildOwner):
    """etcd plus ``masters`` HA ``mooncake_master`` processes, all children of this process, on 127.0.0.1.

    Ports are picked free at :meth:`start`. Use as a context manager, or call :meth:`start` and
    :meth:`close`::

        with EmbeddedCluster(masters=2) as cluster:
            config = StoreConfig(master_server_address=cluster.master_server_address)
            killed = cluster.kill_leader()
            cluster.wait_for_leader()
            cluster.revive(killed)

    Every process is stopped by :meth:`close`, by garbage collection, at interpreter exit, and when this
    process dies (``PR_SET_PDEATHSIG``); etcd's data directory is removed with it.
    """

    def __init__(
        self,
        masters: int = 2,
        *,
        master_args: Sequence[str] = (),
        master_env: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0,
        master_binary: str | os.PathLike[str] | None = None,
        etcd_binary: str | os.PathLike[str] | None = None,
        log_level: int = 1,
    ) -> None:
        """Configure (nothing starts until :meth:`start` or ``with``); every argument is checked here.

        Args:
            masters: how many HA masters (2..8; one leads, the others stand by).
            master_args: extra ``-flag=value`` arguments for every master (e.g. ``-enable_oplog=true``).
            master_env: variables added to the masters' environment only (Mooncake's snapshots read
                ``MOONCAKE_SNAPSHOT_LOCAL_PATH``); this process's environment is never changed.
            start_timeout_s: bound on each wait: etcd healthy, each master answering, a leader serving.
            master_binary: ``mooncake_master`` (default: the one in the Mooncake wheel).
            etcd_binary: ``etcd`` (default: the one on ``PATH``; Debian's ``etcd-server`` package).
            log_level: the masters' glog ``-minloglevel`` (0 INFO .. 3 FATAL); logs go to private files.
        """
        if isinstance(masters, bool) or not isinstance(masters, int) or not 2 <= masters <= 8:
            raise ValueError(f"masters: must be 2..8 (one leader and its standbys), got {masters!r}")
        env = dict(master_env or {})
        for name, value in env.items():
            if not isinstance(name, str) or not isinstance(value, str) or not name or "=" in name:
                raise TypeError(f"master_env: expected variable names and string values, got {name!r}={value!r}")
        self._start_timeout_s = check_start_options(start_timeout_s, log_level)
        self._count = masters
        # The embedded master's rules (loopback only, one -name=value flag each); the HA flags, and the cluster id
        # its clients' etcd:// address reads the leader under, are the cluster's.
        self._master_args = check_master_args(
            "master_args", master_args, HA_MASTER_FLAGS | {"cluster_id"}, "the cluster sets (HA over its own etcd)"
        )
        self._master_env = env
        self._master_binary = Path(master_binary) if master_binary is not None else None
        self._etcd_binary = Path(etcd_binary) if etcd_binary is not None else None
        self._log_level = log_level
        self._started = False
        self._etcd: EmbeddedEtcd | None = None
        self._masters: list[HaMaster] = []
        # Everything the finalizer needs, never `self`: the children (masters first) and the data directory.
        self._children: list[ChildProcess] = []
        self._data_dir = Path(tempfile.mkdtemp(prefix="mooncake_kvaddr_etcd_"))
        self._own(_release, self._children, self._data_dir)

    # ------------------------------------------------------------------ what clients and tests read

    @property
    def etcd(self) -> EmbeddedEtcd:
        if self._etcd is None:
            raise ClusterError("the cluster has not been started yet")
        return self._etcd

    @property
    def etcd_endpoint(self) -> str:
        """``"127.0.0.1:<port>"`` of the cluster's etcd."""
        return self.etcd.endpoint

    @property
    def master_server_address(self) -> str:
        """``"etcd://127.0.0.1:<port>"``: a client's ``master_server_address`` for this cluster."""
        return f"etcd://{self.etcd_endpoint}"

    @property
    def masters(self) -> list[HaMaster]:
        """The masters, in start order (a killed one stays in the list; :meth:`revive` restarts it)."""
        return list(self._masters)

    def statuses(self) -> list[MasterStatus | None]:
        """Each master's ``/health`` answer, ``None`` for one that does not answer."""
        return [m.status() for m in self._masters]

    def leader(self) -> HaMaster | None:
        """The master that serves now (leads, ready, holds its RPC port), or ``None`` during a failover."""
        serving = [m for m in self._masters if m.serving()]
        return serving[0] if len(serving) == 1 else None

    def wait_for_leader(self, timeout_s: float | None = None, *, exclude: HaMaster | None = None) -> HaMaster:
        """Wait until one master serves (not ``exclude``: the one just killed); ClusterError at the timeout, and at
        once for a cluster closed or never started (no master to wait for)."""
        self._check_open(ClusterError)
        if not self._masters:
            raise ClusterError("the cluster has not been started yet")
        limit = self._start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            found = self.leader()
            if found is not None and found is not exclude:
                return found
            if time.monotonic() >= deadline:
                logs = "".join(f"\nmaster #{m.index} log tail:\n{m.stderr_tail(1500) or '-'}" for m in self._masters)
                raise ClusterError(
                    f"no master serves after {limit:.1f} s: statuses {self.statuses()}; "
                    f"etcd alive={self._etcd is not None and self._etcd.alive}{logs}"
                )
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EmbeddedCluster:
        """Start etcd, then the masters, and wait until a leader serves; returns ``self``. Thread-safe."""
        with self._lifecycle:
            self._check_open(ClusterError)
            if self._started:
                return self
            master_binary = self._master_binary or find_master_binary()
            etcd_binary = self._etcd_binary or find_etcd_binary()
            try:
                etcd = EmbeddedEtcd(self._child(etcd=True), etcd_binary, self._data_dir)
                self._etcd = etcd
                etcd.start(self._start_timeout_s)
                for index in range(self._count):
                    command = self._master_command(master_binary)
                    master = HaMaster(index, self._child(), command, self._master_env)
                    self._masters.append(master)
                    master.start(self._start_timeout_s, new_ports=True)
                self.wait_for_leader()
            except BaseException:
                self.close()  # nothing half-started stays behind; this object is spent (a retry: a clear error)
                raise
            self._started = True
            return self

    def kill_leader(self) -> HaMaster:
        """SIGKILL the serving master (a crash) and return it; ClusterError when none serves."""
        with self._lifecycle:
            leader = self.leader()
            if leader is None:
                raise ClusterError(f"no master serves, nothing to kill: statuses {self.statuses()}")
            leader.kill()
            return leader

    def revive(self, master: HaMaster) -> None:
        """Start a stopped master again on its ports; it joins as a standby. No-op if it runs."""
        with self._lifecycle:
            if self._closed:
                raise ClusterError("this EmbeddedCluster was closed")
            if master not in self._masters:
                raise ValueError(f"{master!r} is not a master of this cluster")
            if master.alive:
                return
            timeout_s = self._start_timeout_s
            self._start_again(lambda: master.start(timeout_s, new_ports=False), ClusterError, timeout_s)

    def __repr__(self) -> str:
        etcd = f"etcd={self._etcd.endpoint}" if self._etcd is not None and self._etcd.client_port else "etcd=?"
        return f"EmbeddedCluster({etcd}, masters={self._masters})"

    # ------------------------------------------------------------------ internals

    def _child(self, *, etcd: bool = False) -> ChildProcess:
        state = ChildProcess()
        # Masters are stopped before etcd: a master that loses etcd first only logs about it.
        if etcd:
            self._children.append(state)
        else:
            self._children.insert(0, state)
        return state

    def _master_command(self, binary: Path) -> Callable[[int, int], list[str]]:
        endpoint = self.etcd_endpoint

        def command(rpc_port: int, metrics_port: int) -> list[str]:
            # Extra flags first: gflags takes the last occurrence, so the cluster's own flags always win.
            return [
                str(binary),
                *self._master_args,
                "-enable_ha=true",
                f"-etcd_endpoints={endpoint}",
                f"-rpc_address={LOOPBACK}",
                f"-rpc_port={rpc_port}",
                f"-metrics_host={LOOPBACK}",
                f"-metrics_port={metrics_port}",
                "-rpc_thread_num=2",
                "-logtostderr=1",
                f"-minloglevel={self._log_level}",
            ]

        return command


def _release(children: list[ChildProcess], data_dir: Path) -> None:
    """Stop every child (masters first, then etcd), close their logs and remove etcd's data directory."""
    for state in list(children):
        with contextlib.suppress(Exception):
            state.release()
    shutil.rmtree(data_dir, ignore_errors=True)
