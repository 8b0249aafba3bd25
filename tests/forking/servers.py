"""The tests' pre-imported parents: the trainer processes of the suite forked from a parent that has made a
trainer's imports (trapo/commands/reproduce/forking.py, the study runner's), one parent per environment.

A test's child may differ from its parent's environment in the launcher's variables (each rank's), the test's
name and the fault it switches on (read at run time); a different environment otherwise gets a parent of its
own at its second child (`ForkServers`), or starts afresh."""

import atexit
import os
import threading

from trapo.commands.reproduce.forking import Parent

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The parent's program: the tests' grader parent put in place first (forking/graders.py), then the sweep parent's
# loop; its children inherit both.
ENTRY = ["-u", os.path.join(TESTS, "forking", "serve.py")]

# What may differ between a parent's environment and a child's: the launcher's variables for each rank, read by
# the trainer at run time, never at import.
LAUNCHER_VARS = frozenset(
    ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "RANK", "LOCAL_RANK")
)

# Set in os.environ by imports the parent does not make, read by nothing it imported: the pytest process has them
# once it made those imports, and a child that makes them sets them again (MLflow's telemetry session id,
# tensorboardX's crc32c mode).
IMPORT_SET = frozenset(("_MLFLOW_TELEMETRY_SESSION_ID", "CRC32C_SW_MODE"))

# Read by the interpreter at its start only: a forked child's was the parent's, started as `python -u`.
STARTUP_VARS = frozenset(("PYTHONUNBUFFERED",))


class Server:
    """One parent, and the children started from it that may still be running."""

    def __init__(self, env: dict[str, str], cwd, per_run: frozenset[str]):
        self.parent, self.per_run = Parent(env, cwd, ENTRY), per_run
        self.children: list = []
        self.promised = 0  # children a pool handed this server out for, not started yet

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a child in `env` can be forked here: the parent's environment but for `per_run`, those above
        and the variables its own imports set (`Parent.takes`)."""
        return self.parent.takes(env, self.per_run | IMPORT_SET | STARTUP_VARS)

    def start(self, argv, env, out, err, process_group=0, cwd=None):
        child = self.parent.start(argv, env, out, err, process_group, cwd)
        self.children.append(child)
        self.promised = max(0, self.promised - 1)
        return child

    def run(self, argv, env, timeout=None):
        self.promised = max(0, self.promised - 1)
        return self.parent.run(argv, env, timeout=timeout)

    def idle(self) -> bool:
        self.children = [c for c in self.children if c.poll() is None]
        return not self.children and not self.promised


class ForkServers:
    """Parents by environment, each started when a child first needs it. An environment gets its own parent once
    `fresh_first` children of it have started afresh (a parent costs about what one child's imports cost: an
    environment used once is cheaper fresh). At most `limit` parents run (each holds ~0.5 GB): a new one
    replaces the least recently used idle one, or if none is idle the child starts afresh. Thread-safe."""

    def __init__(self, cwd, per_run: frozenset[str] = LAUNCHER_VARS, fresh_first: int = 0, limit: int = 3):
        self.cwd, self.per_run, self.fresh_first, self.limit = cwd, per_run, fresh_first, limit
        self.servers: list[Server] = []  # the least recently used first
        self.fresh: dict[frozenset, int] = {}  # children started afresh so far, by environment
        self.lock = threading.Lock()
        atexit.register(self.close)

    def server(self, env: dict[str, str]) -> Server | None:
        """The server to fork a child in `env` from, started now if its turn has come; None: start it afresh."""
        shared = self._shared(env)
        key = frozenset(shared.items())
        with self.lock:
            server = next((s for s in self.servers if s.accepts(env)), None)
            if server is None and self.fresh.get(key, 0) >= self.fresh_first and self._make_room():
                server = Server(shared, self.cwd, self.per_run)
            if server is None:
                self.fresh[key] = self.fresh.get(key, 0) + 1
                return None
            if server in self.servers:
                self.servers.remove(server)
            self.servers.append(server)  # now the most recently used
            server.promised += 1  # not idle until the caller's child has started
            return server

    def prestart(self, env: dict[str, str]) -> None:
        """A server for `env` started now, where none runs yet: many children in `env` will come."""
        with self.lock:
            if not self.servers and self._make_room():
                self.servers.append(Server(self._shared(env), self.cwd, self.per_run))

    def _shared(self, env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in self.per_run}

    def _make_room(self) -> bool:
        if len(self.servers) < self.limit:
            return True
        idle = next((s for s in self.servers if s.idle()), None)
        if idle is None:
            return False
        self.servers.remove(idle)
        idle.parent.close()
        return True

    def close(self) -> None:
        with self.lock:
            for server in self.servers:
                server.parent.close()
            self.servers.clear()
