"""The rollout link (rollout.placement: separate): its two ends in two threads of this process, over gloo."""

import threading

import pytest
import torch

from trapo.config import ConfigError
from trapo.engine.dist import free_port
from trapo.engine.rollout_link import LinkError, RolloutLink, checksum, split_world


def pair(timeout_s=20.0):
    """Both ends of a fresh link (link rank 0 = the trainer, 1 = a rollout rank)."""
    address, ends = ("127.0.0.1", free_port()), {}

    def open_end(rank):
        ends[rank] = RolloutLink(rank, 2, timeout_s, address)

    thread = threading.Thread(target=open_end, args=(1,))
    thread.start()
    open_end(0)
    thread.join()
    return ends[0], ends[1]


def test_weights_arrive_whole_with_their_version_and_sends_do_not_wait_for_the_receiver():
    trainer, rollout = pair()
    weights = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5, dtype=torch.bfloat16))]
    sent = trainer.send_weights(iter(weights), 7, [1])  # returns before the rollout rank receives anything
    trainer.send({"kind": "generate", "prompts": [[1, 2]]}, 1)
    assert sent == 3 * 4 * 4 + 5 * 2
    header = rollout.recv(0, "weights")
    got = dict(rollout.receive_weights(header))
    assert header["version"] == 7 and list(got) == ["a.weight", "b.bias"]
    assert all(torch.equal(got[name], t) and got[name].dtype == t.dtype for name, t in weights)
    assert rollout.recv(0, "a request") == {"kind": "generate", "prompts": [[1, 2]]}  # in the order sent
    rollout.send({"answer": 1}, 0)
    assert trainer.recv(1, "an answer") == {"answer": 1}
    trainer.flush()


def test_weights_travel_in_buckets_each_checked_before_its_tensors_are_handed_on():
    trainer, rollout = pair()
    weights = [(f"w{i}", torch.full((i + 1,), float(i))) for i in range(6)]  # 4, 8, ..., 24 bytes
    trainer.send_weights(iter(weights), 2, [1], bucket_bytes=20)  # buckets: w0 w1 | w2 | w3 | w4 | w5
    trainer.send({"kind": "stop"}, 1)
    header = rollout.recv(0, "weights")
    assert [n for n, _, _ in header["meta"]] == ["w0", "w1"] and header["count"] is None  # more to come
    stream = rollout.receive_weights(header)
    first = next(stream)  # the first bucket is handed on before the rest has been read
    assert first[0] == "w0" and torch.equal(first[1], weights[0][1])
    rest = list(stream)
    assert [n for n, _ in [first, *rest]] == [n for n, _ in weights]
    assert all(torch.equal(t, dict(weights)[n]) for n, t in rest)
    assert rollout.recv(0, "a request") == {"kind": "stop"}  # the next message follows the last bucket
    trainer.flush()


def test_damaged_or_incomplete_weights_are_refused_naming_the_version():
    trainer, rollout = pair()
    header = {"kind": "weights", "version": 3, "count": 1, "meta": [("w", (2,), torch.float32)]}
    trainer.send_tensor(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(LinkError, match="version 3 arrived damaged"):
        list(rollout.receive_weights({**header, "checksum": checksum([torch.tensor([1.0, 2.5])])}))
    trainer.send_tensor(torch.tensor([1.0, 2.0]), 1)
    good = checksum([torch.tensor([1.0, 2.0])])
    with pytest.raises(LinkError, match="version 3 arrived incomplete .* 1 tensors of 2"):
        list(rollout.receive_weights({**header, "count": 2, "checksum": good}))
    trainer.flush()


def test_checksum_sees_a_swapped_or_altered_tensor():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    assert checksum([a, b]) == checksum([a.clone(), b.clone()])
    assert checksum([b, a]) != checksum([a, b])
    assert checksum([a, b + 1e-3]) != checksum([a, b])
    assert checksum([a.to(torch.bfloat16)]) != checksum([a])


def test_a_silent_peer_ends_the_wait_with_one_line_naming_it():
    trainer, _rollout = pair(timeout_s=1.0)
    with pytest.raises(LinkError, match=r"^rollout rank 0 \(link rank 1\) stopped answering .* waiting for a round"):
        trainer.recv(1, "a round of rollouts")


def test_split_world_renumbers_the_training_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    assert split_world("separate", 1) == ("rollout", 1)
    assert split_world("colocated", 1) == ("train", 2)
    monkeypatch.setenv("RANK", "1")
    assert split_world("separate", 2) == ("rollout", 1)
    monkeypatch.setenv("RANK", "0")
    assert split_world("separate", 2) == ("train", 0)
    import os

    assert os.environ["WORLD_SIZE"] == "1"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rollout.ranks=2 leaves no training rank"):
        split_world("separate", 2)


def test_a_request_is_ordered_and_keyed_alike_whatever_the_training_world():
    from trapo.engine.remote_engine import deinterleave, interleave, request_key

    batch = list(range(7))
    two, three = [batch[r::2] for r in range(2)], [batch[r::3] for r in range(3)]
    assert interleave(two) == interleave(three) == batch  # rank r holds batch[r::world]
    assert deinterleave(batch, [4, 3]) == two and deinterleave(batch, [3, 2, 2]) == three
    assert interleave([[1, 2, 3], [], [4]]) == [1, 4, 2, 3] and deinterleave([1, 4, 2, 3], [3, 0, 1]) == [
        [1, 2, 3],
        [],
        [4],
    ]
    assert request_key([interleave(two), None], {"n": 8}) == request_key([interleave(three), None], {"n": 8})


def test_a_link_port_in_use_is_named_with_the_fix():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(LinkError, match=r"port \d+ \(the launcher's MASTER_PORT \+ 1\) is in use .* --master_port"):
            RolloutLink(0, 2, 5.0, ("127.0.0.1", held.getsockname()[1]))
