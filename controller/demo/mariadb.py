"""A real MariaDB on loopback, for the MySQL sink's tests, the benches and the demo (``servers._Server``'s machinery:
a fresh temporary directory, free ports, a log, always stopped). The binaries: Debian's ``mariadb-server``
(``hack/install-mariadb.sh`` installs it without leaving a service running), or ``$CFM_MARIADB_BIN_DIR``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller.demo.servers import LOOPBACK, ServerError, _describe, _Server, free_port


def mariadb_bin_dir(bin_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``mariadbd`` is: ``bin_dir``, ``$CFM_MARIADB_BIN_DIR``, the directory of ``mariadbd`` on ``PATH``, or
    ``/usr/sbin`` (Debian's ``mariadb-server``); ``mariadb-install-db`` is looked up beside it, then on ``PATH``."""
    for candidate in (bin_dir, os.environ.get("CFM_MARIADB_BIN_DIR")):
        if candidate:
            return Path(candidate)
    found = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise ServerError("mariadbd not found: install Debian's mariadb-server (the service need not run)")
    return Path(found).parent


class MariaDBServer(_Server):
    """A MariaDB server on loopback: ``mariadb-install-db`` into a temporary directory, then ``mariadbd`` with no
    option file, TCP on 127.0.0.1 only, superuser ``root`` without a password (loopback only). :attr:`dsn` is the
    sink Secret's value for it. ``fsync`` off by default (a throwaway server: ``innodb_flush_log_at_trx_commit=0``).
    Run by root, the server runs as root (``--user=root``): it needs no copy of the installation."""

    kind = "mariadb"
    #: The Changefeed's ``spec.sink.<kind>`` this server is a sink for.
    sink_kind = "mysql"
    stop_steps = ((signal.SIGTERM, 15.0),)

    def __init__(
        self,
        *,
        bin_dir: str | os.PathLike[str] | None = None,
        fsync: bool = False,
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
        attempts: int = 3,
    ) -> None:
        super().__init__(start_timeout=start_timeout, attempts=attempts)
        self.bin_dir = mariadb_bin_dir(bin_dir)
        self.fsync = fsync
        self.settings = dict(settings or {})
        self.host = LOOPBACK
        self.port = 0
        self.user = "root"

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def dsn(self) -> str:
        return self.url()

    def url(self, user: str = "root", password: str = "") -> str:
        """The ``mysql://`` DSN of ``user`` on this server (credentials percent-encoded)."""
        from urllib.parse import quote

        secret = f":{quote(password, safe='')}" if password else ""
        return f"mysql://{quote(user, safe='')}{secret}@{self.host}:{self.port}/"

    def _install_db(self) -> Path:
        for name in ("mariadb-install-db", "mysql_install_db"):
            for where in (self.bin_dir, self.bin_dir.parent / "bin"):
                if (where / name).exists():
                    return where / name
            found = shutil.which(name)
            if found:
                return Path(found)
        raise ServerError("mariadb-install-db not found beside mariadbd nor on PATH")

    def _user_args(self) -> list[str]:
        return ["--user=root"] if os.geteuid() == 0 else []

    def _prepare(self) -> None:
        argv = [
            str(self._install_db()), "--no-defaults", f"--datadir={self.data_dir}",
            "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve", *self._user_args(),
        ]  # fmt: skip
        assert self._log is not None
        self._log.write(f"--- {' '.join(argv)}\n".encode())
        self._log.flush()
        try:
            result = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                    cwd=self.directory, timeout=self.start_timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ServerError(
                f"mariadb-install-db did not finish within {self.start_timeout:g} s", self.log_path
            ) from None
        if result.returncode != 0:
            raise ServerError(f"mariadb-install-db failed with {_describe(result.returncode)}", self.log_path)

    def _choose_ports(self) -> None:
        self.port = free_port()

    def _argv(self) -> list[str]:
        options = {
            "datadir": str(self.data_dir), "socket": str(self.directory / "mariadb.sock"), "port": str(self.port),
            "bind-address": self.host, "pid-file": str(self.directory / "mariadb.pid"), "skip-name-resolve": "",
            "skip-log-bin": "", "innodb-buffer-pool-size": "128M", "max-connections": "200",
            "innodb-flush-log-at-trx-commit": "1" if self.fsync else "0", "skip-grant-tables": None,
        }  # fmt: skip
        if not self.fsync:
            options["innodb-doublewrite"] = "0"
        options.update(self.settings)
        argv = [str(self.bin_dir / "mariadbd"), "--no-defaults", *self._user_args()]
        for k, v in options.items():
            if v is None:
                continue
            argv.append(f"--{k}={v}" if v else f"--{k}")
        return argv

    def _ready(self) -> bool:
        try:
            rows = self.sql("SELECT @@datadir")
        except Exception:
            return False
        # The server that answers is ours (not another one that took the port first).
        return bool(rows) and Path(str(rows[0][0])).resolve() == self.data_dir.resolve()

    def sql(self, *statements: str) -> list[tuple[Any, ...]]:
        """Run ``statements`` as root (autocommit), returning the last one's rows: test setup (users, grants). Callable
        from inside an event loop too (it runs on a thread of its own then)."""
        import asyncio
        import concurrent.futures

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.asql(*statements))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self.asql(*statements)).result()

    async def asql(self, *statements: str) -> list[tuple[Any, ...]]:
        import asyncmy

        conn = await asyncmy.connect(host=self.host, port=self.port, user="root", password="", connect_timeout=2,
                                     autocommit=True)  # fmt: skip
        try:
            rows: list[tuple[Any, ...]] = []
            async with conn.cursor() as cur:
                for statement in statements:
                    await cur.execute(statement)
                    rows = list(await cur.fetchall() or [])
            return rows
        finally:
            conn.close()
