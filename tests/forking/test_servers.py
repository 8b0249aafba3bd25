"""The tests' pool of pre-imported parents (servers.py): which environment gets a parent, and when one makes room."""

from forking import servers


def test_an_environment_gets_its_server_after_its_fresh_first_children_and_an_idle_one_makes_room(monkeypatch):
    started = []
    monkeypatch.setattr(servers, "Server", lambda env, cwd, per_run: started.append(env) or _StandIn(env))
    pool = servers.ForkServers("/", per_run=frozenset({"RANK"}), fresh_first=1, limit=2)
    a, a_rank1, b, c, d = {"X": "a"}, {"X": "a", "RANK": "1"}, {"X": "b"}, {"X": "c"}, {"X": "d"}
    assert pool.server(a) is None  # the first child of an environment starts afresh
    server_a = pool.server(a_rank1)
    assert server_a.env == a and started == [a]  # the second: its server, without per-run keys
    assert pool.server(a) is server_a and len(started) == 1
    assert pool.server(b) is None
    server_b = pool.server(b)
    server_a.busy = True  # a child of a's still runs: a stays, though used less recently than b
    assert pool.server(c) is None
    server_c = pool.server(c)  # room made: the least recently used idle server closed
    assert server_c.env == c and server_b.parent.closed and not server_a.parent.closed
    assert pool.servers == [server_a, server_c]
    server_c.busy = True
    assert [pool.server(d), pool.server(d)] == [None, None] and len(started) == 3  # none idle: d stays fresh
    server_a.alive = False  # a server that died: its children start afresh
    assert pool.server(a) is None and pool.fresh[frozenset(a.items())] == 2
    pool.close()


class _StandIn:
    """A server for the pool's bookkeeping alone (a real parent is tested in tests/commands/test_forking.py)."""

    def __init__(self, env):
        self.env, self.alive, self.busy, self.promised, self.parent = env, True, False, 0, self

    def accepts(self, env):
        return self.alive and {k: v for k, v in env.items() if k != "RANK"} == self.env

    def idle(self):
        return not self.busy

    closed = False

    def close(self):
        self.closed = True
