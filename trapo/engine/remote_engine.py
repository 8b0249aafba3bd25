"""The training ranks' `RolloutEngine` under `rollout.placement: separate`: the engines run on the rollout
ranks, this object sends them requests and weights over the link (trapo/engine/rollout_link.py).

Every training rank calls it as it would call its own engine (collectively, in the same order); training
rank 0 speaks for all of them: it gathers the ranks' prompts into one request, splits the request over the
rollout ranks, and hands every training rank its share of the answer.

Requests may be sent ahead (`submit`): `generate` then collects the answer of the request with the same
prompts, seeds and sampling settings instead of sending it again, which is how a round is generated while
the trainer still updates on the previous one (trapo/training/prefetch.py). Answers come back in request
order, each labelled with the version of the weights that generated it (`last_version`): version v is
the weights after v updates, 0 the model directory's. A rollout rank swaps new weights in between requests
only, never during one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pickle
from collections.abc import Iterable

import torch

from trapo.engine import dist
from trapo.engine.rollout import Rollout
from trapo.engine.rollout_engine import EngineSettings
from trapo.engine.rollout_link import LinkError, RolloutLink


def request_key(shares: list, params: dict) -> str:
    """The identity of a request: every training rank's (prompts, seeds) and the sampling settings."""
    return hashlib.blake2b(pickle.dumps((shares, sorted(params.items()))), digest_size=16).hexdigest()


def interleave(shares: list[list]) -> list:
    """One item of each share in turn (shares may differ in length by any amount)."""
    return [share[j] for j in range(max(map(len, shares), default=0)) for share in shares if j < len(share)]


def deinterleave(items: list, counts: list[int]) -> list[list]:
    """The shares `interleave` took `items` from, given their lengths."""
    shares, it = [[] for _ in counts], iter(items)
    for j in range(max(counts, default=0)):
        for share, count in zip(shares, counts):
            if j < count:
                share.append(next(it))
    return shares


class RemoteEngine:
    weights_asleep = False  # the rollout ranks keep their weights between requests

    def __init__(self, link: RolloutLink | None, opened: list[dict], *, rank: int, world: int):
        self.link, self.opened = link, opened  # link and the rollout ranks' opening answers: rank 0's
        self.rank, self.world = rank, world
        self.version = 0  # of the weights last pushed (0: the model directory the engines opened)
        self.last_version: int | None = None  # of the answer `generate` returned last
        self.step_versions: list[int] = []  # of the answers returned since the trainer last cleared it
        self.last_generate_s: float | None = None  # its generation time on the slowest rollout rank
        self.generate_s: dict[str, float] = {}  # key -> that time, for the answers received (rank 0)
        self.outstanding: list[str] = []  # keys of the requests sent and not answered yet, in order (rank 0)
        self.ready: dict[str, tuple[int, list]] = {}  # key -> (version, the request's rollouts), rank 0
        self.counts: dict[str, list[int]] = {}  # key -> each training rank's prompt count in it

    @classmethod
    def connect(
        cls,
        settings: EngineSettings,
        model_dir: str,
        *,
        tokenizer,
        stop_token_ids: list[int],
        rollout_ranks: int,
        timeout_s: float,
        rank: int,
        world: int,
    ) -> RemoteEngine:
        """Collective over the training ranks: rank 0 opens the link and has every rollout rank open its engine
        on `model_dir` (the settings, tokenizer and stop tokens of the run), computing its linear layers as
        ZeRO-3's replacement does when the policy's do (so `max_staleness` 0 samples what colocated samples)."""
        link, opened = None, []
        if rank == 0:
            import torch.nn.functional as F

            zero3_linear = getattr(F.linear, "__name__", "") == "zero3_linear_wrap"
            link = RolloutLink(0, rollout_ranks + 1, timeout_s)
            opening = dict(
                kind="open",
                settings=settings,
                model_dir=str(model_dir),
                tokenizer=tokenizer,
                stop_token_ids=list(stop_token_ids),
                zero3_linear=zero3_linear,
            )
            peers = list(range(1, rollout_ranks + 1))
            for peer in peers:
                link.send(opening, peer)
            opened = [link.recv(peer, "its engine opened") for peer in peers]
        opened = dist.all_gather(opened)[0]
        return cls(link, opened, rank=rank, world=world)

    # ------------------------------------------------------------------ RolloutEngine

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        max_tokens: int,
        seeds: list[int] | None = None,
        min_tokens: int = 0,
    ) -> list[list[Rollout]]:
        """This rank's answers, from a request sent ahead (`submit`) or sent now. Collective."""
        params = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, min_tokens=min_tokens)
        return self.collect(self.submit(prompts, seeds=seeds, **params))

    def submit(self, prompts: list[list[int]], *, seeds: list[int] | None, **params) -> str:
        """Send the request of every training rank's `prompts` now, unless it was sent already; its key.
        Collective over the training ranks."""
        shares = dist.all_gather((prompts, seeds))
        # round-robin over the ranks: a round's batch order (rank r holds batch[r::world]) whatever the world,
        # so the key, and a round saved in a checkpoint, do not depend on how many ranks share it
        everything = interleave([share for share, _ in shares])
        all_seeds = None if any(s is None for _, s in shares) else interleave([share for _, share in shares])
        key = request_key([everything, all_seeds], params)
        self.counts[key] = [len(share) for share, _ in shares]
        if self.rank == 0 and key not in self.ready and key not in self.outstanding:
            peers = list(range(1, self.link.size))
            for i, peer in enumerate(peers):  # contiguous parts, one per rollout rank
                lo, hi = len(everything) * i // len(peers), len(everything) * (i + 1) // len(peers)
                request = dict(
                    kind="generate", key=key, prompts=everything[lo:hi], seeds=all_seeds and all_seeds[lo:hi]
                )
                self.link.send({**request, **params}, peer)
            self.outstanding.append(key)
        return key

    def collect(self, key: str) -> list[list[Rollout]]:
        """This rank's share of request `key`'s answer, waiting for it. Collective over the training ranks."""
        answer = None
        if self.rank == 0:
            while key not in self.ready:
                self._receive_next()
            version, rollouts = self.ready.pop(key)
            shares = deinterleave(rollouts, self.counts[key])
            answer = (version, shares, self.generate_s.pop(key, None))  # None: a round from a checkpoint
        version, shares, self.last_generate_s = dist.all_gather(answer)[0]  # rank 0's: the shares in rank order
        del self.counts[key]
        self.last_version = version
        self.step_versions.append(version)
        return shares[self.rank]

    def _receive_next(self) -> None:
        key = self.outstanding.pop(0)
        rollouts, versions, seconds = [], set(), 0.0
        for peer in range(1, self.link.size):
            answer = self.link.recv(peer, "a round of rollouts")
            if answer["key"] != key:
                raise LinkError(f"{self.link.name(peer)} answered request {answer['key']} instead of {key}")
            rollouts += answer["rollouts"]
            versions.add(answer["version"])
            seconds = max(seconds, answer["generate_s"])
        self.generate_s[key] = seconds
        if len(versions) != 1:
            raise LinkError(f"the rollout ranks generated request {key} with different weights: {sorted(versions)}")
        self.ready[key] = (versions.pop(), rollouts)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The next version's weights to every rollout rank (sent, not awaited); every training rank reads the
        iterator (the ZeRO-3 gather is collective). The bytes sent to one rollout rank."""
        self.version += 1
        if self.rank != 0:
            for _ in named_tensors:
                pass
            return 0
        return self.link.send_weights(named_tensors, self.version, list(range(1, self.link.size)))

    def turn(self):
        return contextlib.nullcontext(self)

    def effective_config(self) -> dict | None:
        return self.opened[0].get("effective_config") if self.opened else None

    def device(self) -> str:
        return "no engine (rollout ranks generate)"

    def describe(self, devices: list[str]) -> str:
        engines = ", ".join(f"rollout rank {i} {o['backend']} on {o['device']}" for i, o in enumerate(self.opened))
        return f"separate rollout ranks: {len(devices)} training rank(s) without an engine; {engines}"

    # ------------------------------------------------------------------ rounds in flight across a restart

    def in_flight(self) -> list[tuple[str, int, list]]:
        """Every answer not yet used, the outstanding ones waited for: [[key, version, the request's rollouts as
        plain dicts]] (rank 0; [] elsewhere). What a checkpoint keeps so a resume, on any number of training
        ranks, loses no round."""
        if self.rank != 0:
            return []
        while self.outstanding:
            self._receive_next()
        return [
            [key, version, [[dataclasses.asdict(r) for r in group] for group in groups]]
            for key, (version, groups) in self.ready.items()
        ]

    def restore(self, rounds: list[tuple[str, int, list]], version: int) -> None:
        """A resume: the saved answers become ready, and the next push is labelled `version` (the step's)."""
        if self.rank == 0:
            self.ready = {key: (v, [[Rollout(**r) for r in group] for group in groups]) for key, v, groups in rounds}
        self.version = version - 1

    def close(self) -> None:
        """Collect what is in flight, tell the rollout ranks to stop, and wait until they were told."""
        if self.rank != 0:
            return
        with contextlib.suppress(LinkError, RuntimeError):  # a dead rollout rank has no answer to collect
            while self.outstanding:
                self._receive_next()
            for peer in range(1, self.link.size):
                self.link.send(dict(kind="stop"), peer)
            self.link.flush()
