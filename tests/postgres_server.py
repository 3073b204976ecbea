"""
A throwaway PostgreSQL server for the tests and the distributed benchmark: ``initdb`` + ``pg_ctl`` in a temporary
directory, listening on a Unix socket in that directory and on 127.0.0.1 (a free port), password authentication,
stopped and deleted by :meth:`PostgresServer.stop`. Never a mock.

PostgreSQL refuses to run as root: when the tests run as root (CI), the server runs as the unprivileged user
``nobody`` (``runuser -u nobody --``), and the temporary directory is given to that user.

The server binaries are looked up in ``$SB3_KL_PG_BINDIR``, ``PATH``, ``pg_config --bindir`` and
``/usr/lib/postgresql/*/bin``; :func:`find_bindir` returns None when they are missing
(Debian/Ubuntu: ``apt-get install postgresql``).
"""

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

#: How to install the server binaries, for skip and error messages
INSTALL_HINT = (
    "PostgreSQL server binaries (initdb, pg_ctl) not found: install them (Debian/Ubuntu: `apt-get install postgresql`) "
    "or set SB3_KL_PG_BINDIR to the folder that holds them"
)
#: The unprivileged user the server runs as when the caller is root
SERVER_USER = "nobody"


def find_bindir() -> Path | None:
    """:return: the folder holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL's server is not installed"""
    candidates = [os.environ.get("SB3_KL_PG_BINDIR", "")]
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(initdb).resolve().parent))
    if shutil.which("pg_config"):
        try:
            found = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10)
            candidates.append(found.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in candidates:
        if candidate and all((Path(candidate) / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return Path(candidate)
    return None


def free_port() -> int:
    """:return: a TCP port on 127.0.0.1 that was free a moment ago"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    """
    A PostgreSQL server in a temporary directory (see the module docstring).

    :param bindir: Folder of the server binaries (default: :func:`find_bindir`)
    :param durable: Keep PostgreSQL's default durability (fsync on every commit). The tests turn it off
        (``fsync=off, synchronous_commit=off``), which changes nothing a client can see except speed.
    :param settings: More server settings, e.g. ``"-c shared_preload_libraries=pg_stat_statements"``
    """

    user = "sb3kl"

    def __init__(self, bindir: Path | None = None, durable: bool = False, settings: str = "") -> None:
        found = bindir or find_bindir()
        if found is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.bindir = found
        self.durable = durable
        self.settings = settings
        self.password = secrets.token_hex(8)
        self.port = 0
        # as root, a folder the server's user can reach (TMPDIR may be private to root)
        as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="sb3kl-pg-", dir="/tmp" if as_root and os.path.isdir("/tmp") else None))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._run_as: list[str] = []
        if as_root:
            # initdb refuses root: give the directory to an unprivileged user and run the server as that user
            entry = pwd.getpwnam(SERVER_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._run_as = ["runuser", "-u", SERVER_USER, "--"]
        self.root.chmod(0o755)

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        return subprocess.run(
            [*self._run_as, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=self.root, check=False
        )

    def start(self) -> "PostgresServer":
        """Initialise the cluster and start the server; raises ``RuntimeError`` with the server's log on failure."""
        password_file = self.root / "password"
        password_file.write_text(self.password + "\n")
        if self._run_as:
            entry = pwd.getpwnam(SERVER_USER)
            os.chown(password_file, entry.pw_uid, entry.pw_gid)
        initdb = self._run(
            str(self.bindir / "initdb"), "-D", str(self.data), "-U", self.user, "--auth=scram-sha-256",
            f"--pwfile={password_file}", "-E", "UTF8", "--no-sync", "--no-instructions",
        )  # fmt: skip
        password_file.unlink()
        if initdb.returncode != 0:
            raise RuntimeError(f"initdb failed ({initdb.returncode}): {initdb.stdout}{initdb.stderr}")
        settings = f"-c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} -c max_connections=200"
        if not self.durable:
            settings += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        settings += f" {self.settings}" if self.settings else ""
        last_error = ""
        for _ in range(3):  # another process may take the free port between the check and the bind
            self.port = free_port()
            started = self._run(
                str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                "-o", f"{settings} -p {self.port}", "start",
            )  # fmt: skip
            if started.returncode == 0:
                return self
            last_error = started.stdout + started.stderr + (self.log.read_text() if self.log.exists() else "")
        raise RuntimeError(f"pg_ctl start failed: {last_error}")

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its directory."""
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        """
        :param database: Database name
        :param password: Password to put in the URL (default: the right one)
        :return: SQLAlchemy URL (``postgresql://``: the psycopg 3 driver) over TCP on 127.0.0.1
        """
        return f"postgresql://{self.user}:{self.password if password is None else password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create an empty database; :return: its URL"""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
