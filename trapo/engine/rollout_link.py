"""The link between the training ranks and the rollout ranks (`rollout.placement: separate`).

With `separate` the launcher's last `rollout.ranks` processes hold only rollout engines; the others train
under DeepSpeed in a world of their own (`split_world` renumbers them before any process group exists),
so ZeRO-3 and every collective of the trainer never wait for a rollout rank. Training rank 0 and the rollout
ranks talk over this module's own gloo process group, made from its own TCPStore on MASTER_PORT + 1:

    link rank 0        training rank 0 (it speaks for all training ranks)
    link ranks 1..R    the rollout ranks, in launcher order

Messages are ordered per pair and sent without waiting for the receiver (gloo's send posts the buffer and
returns; the data leaves when the receiver posts its receive), so a round request or a weight push never
blocks the trainer while the rollout rank generates. Every receive waits at most `timeout_s`; a rollout rank
that died or hangs ends the run with one line naming it (`LinkError`).

Weights travel in buckets of about BUCKET_BYTES: each a header (version, names, shapes, dtypes, a checksum;
the last one also the version's tensor count) and then its tensors. The receiver checks each bucket's
checksum before it hands the bucket's tensors on, and the count at the last (`receive_weights`), so a rollout
rank loads a version bucket by bucket, never holding a second copy of the model. A bucket is posted as it
is gathered; its host copy lives until the rollout rank takes it (while that rank still generates the round
before, that is the whole version). GPU note: tensors go through host memory over gloo (no NCCL path yet).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import pickle
from collections.abc import Iterable, Iterator

import torch

from trapo.config import ConfigError
from trapo.engine.policy import TrainingError

TAG = 41  # the link's only tag: messages between a pair arrive in the order they were sent
BUCKET_BYTES = 256 * 2**20  # weights are sent in buckets of about this size (one tensor larger: alone)
PORT_OFFSET = 1  # the link's TCPStore listens on MASTER_PORT + 1 on the master's host


class LinkError(TrainingError):
    """A rollout rank (or the trainer, seen from a rollout rank) stopped answering on the link."""


def split_world(placement: str, rollout_ranks: int) -> tuple[str, int]:
    """("train", training rank) or ("rollout", link rank) for this process; with `separate`, a training
    rank's RANK / WORLD_SIZE are renumbered to the training world before any process group starts. Not
    collective. `colocated` (or no launcher) changes nothing: every process trains."""
    rank = int(os.environ.get("RANK", "0"))
    if placement != "separate":
        return "train", rank
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = world - rollout_ranks
    if training < 1:
        raise ConfigError(
            f"rollout.ranks={rollout_ranks} leaves no training rank in a world of {world}: launch at least "
            f"{rollout_ranks + 1} processes, or lower rollout.ranks"
        )
    if rank >= training:
        return "rollout", rank - training + 1
    os.environ["WORLD_SIZE"] = str(training)
    return "train", rank


def link_address() -> tuple[str, int]:
    """(host, port) of the link's store: the launcher's master host, its port + PORT_OFFSET."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return host, int(os.environ.get("MASTER_PORT", "29500")) + PORT_OFFSET


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """A BLAKE2b digest of the tensors' bytes and shapes, in order: a dropped, swapped or altered tensor changes it."""
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        digest.update(repr((tuple(t.shape), str(t.dtype))).encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class RolloutLink:
    """One end of the link: link rank `rank` of `size` (1 + the rollout ranks)."""

    def __init__(self, rank: int, size: int, timeout_s: float, address: tuple[str, int] | None = None):
        import torch.distributed as tdist

        host, port = address or link_address()
        self.rank, self.size = rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = tdist.TCPStore(host, port, size, rank == 0, timeout=self.timeout)
            self.group = tdist.ProcessGroupGloo(store, rank, size, self.timeout)
        except RuntimeError as err:
            if "EADDRINUSE" in str(err):  # the launcher's port is free, the next one is not
                raise LinkError(
                    f"rollout link: port {port} (the launcher's MASTER_PORT + 1) is in use by another process: "
                    "launch again with another --master_port"
                ) from None
            raise LinkError(
                f"rollout link (port {port}): link rank {rank} of {size} could not connect within "
                f"{timeout_s:g} s: {str(err).splitlines()[0]}"
            ) from None
        self.pending: list = []  # sends not known to be delivered, and their buffers (kept alive until then)

    def name(self, peer: int) -> str:
        """The peer as a user knows it: 'the training ranks' or 'rollout rank k' (link rank k, launcher order)."""
        return "training rank 0" if peer == 0 else f"rollout rank {peer - 1} (link rank {peer})"

    # ------------------------------------------------------------------ transport

    def send_tensor(self, tensor: torch.Tensor, peer: int) -> None:
        """Posted now, delivered when `peer` receives it; the buffer is kept until then."""
        tensor = tensor.detach().to("cpu").contiguous()
        try:
            self.pending.append((self.group.send([tensor], peer, TAG), tensor))
        except RuntimeError as err:  # the peer's connection is gone already
            raise self._lost(peer, "it to take a message", err) from None
        self.pending = [(work, buf) for work, buf in self.pending if not work.is_completed()]

    def recv_tensor(self, tensor: torch.Tensor, peer: int, waiting_for: str) -> torch.Tensor:
        try:
            self.group.recv([tensor], peer, TAG).wait(self.timeout)
        except RuntimeError as err:
            raise self._lost(peer, waiting_for, err) from None
        return tensor

    def _lost(self, peer: int, waiting_for: str, err: RuntimeError) -> LinkError:
        """The one line for a peer that died or hangs (gloo's reason, cut, at its end)."""
        return LinkError(
            f"{self.name(peer)} stopped answering on the rollout link (it died or hangs; waiting for "
            f"{waiting_for}, at most dist_timeout_minutes = {self.timeout.total_seconds() / 60:g}); see its "
            f"log.rank-R.txt, then run again with resume_from=latest: {str(err).splitlines()[0][:120]}"
        )

    def send(self, obj, peer: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.send_tensor(torch.tensor([len(data)], dtype=torch.long), peer)
        self.send_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer)

    def recv(self, peer: int, waiting_for: str):
        size = self.recv_tensor(torch.zeros(1, dtype=torch.long), peer, waiting_for)
        data = self.recv_tensor(torch.empty(int(size.item()), dtype=torch.uint8), peer, waiting_for)
        return pickle.loads(data.numpy().tobytes())

    def flush(self) -> None:
        """Wait until every send was delivered (before closing: a process that exits drops what is queued)."""
        for work, _ in self.pending:
            work.wait(self.timeout)
        self.pending = []

    # ------------------------------------------------------------------ weights

    def send_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, peers: list[int], bucket_bytes=None
    ) -> int:
        """Every (name, tensor) to every peer, labelled with `version`, in buckets of about `bucket_bytes`
        (BUCKET_BYTES), each posted as soon as it is full; the bytes sent to one peer."""
        limit = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        bucket, size, total, count = [], 0, 0, 0
        for name, tensor in named_tensors:
            tensor = tensor.detach().to("cpu").contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                self._send_bucket(bucket, version, peers, last=None)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size, total, count = size + nbytes, total + nbytes, count + 1
        self._send_bucket(bucket, version, peers, last=count)
        return total

    def _send_bucket(self, bucket: list, version: int, peers: list[int], last: int | None) -> None:
        """One bucket's header and tensors to every peer; `last`: the version's tensor count, on its last bucket."""
        header = {
            "kind": "weights",
            "version": version,
            "count": last,
            "meta": [(name, tuple(t.shape), t.dtype) for name, t in bucket],
            "checksum": checksum(t for _, t in bucket),
        }
        for peer in peers:
            self.send(header, peer)
            for _, tensor in bucket:
                self.send_tensor(tensor, peer)

    def receive_weights(self, header: dict, peer: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs of the version whose first bucket `header` announces (already received),
        bucket by bucket: a bucket's tensors come only once its checksum matched, and the version's tensor
        count is checked at its last bucket. Read it to the end: the next message follows it on the link."""
        version, received = header["version"], 0
        while True:
            what = f"weights {version}"
            bucket = [
                (n, self.recv_tensor(torch.empty(shape, dtype=dtype), peer, what)) for n, shape, dtype in header["meta"]
            ]
            got = checksum(t for _, t in bucket)
            if got != header["checksum"]:
                raise LinkError(
                    f"weights of version {version} arrived damaged on link rank {self.rank}: a bucket of "
                    f"{len(bucket)} tensors has checksum {got!r} instead of {header['checksum']!r}"
                )
            yield from bucket
            received += len(bucket)
            if header["count"] is not None:
                if received != header["count"]:
                    raise LinkError(
                        f"weights of version {version} arrived incomplete on link rank {self.rank}: {received} "
                        f"tensors of {header['count']}"
                    )
                return
            header = self.recv(peer, what)
            if header.get("kind") != "weights" or header.get("version") != version:
                raise LinkError(f"link rank {self.rank}: weights {version} were cut off by a {header.get('kind')!r}")
