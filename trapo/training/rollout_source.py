"""Where a step's rollouts come from: the trainer's `RolloutSource`, the rollout placement decided once, where
`open_rollout_source` builds it.

- colocated (`RolloutSource`): this rank's own engine (vLLM, or the policy itself with the hf backend), each
  round generated when its step asks for it, during generation's turn (the policy's movable states away).
- separate (`SeparateRolloutSource`): the rollout ranks' engines behind a `RemoteEngine`; the rounds are asked
  for ahead (`send_ahead`, the schedule of trapo/training/prefetch.py), each step's lag is logged and checked
  (`staleness`), and the rounds generated and not yet trained on go into the checkpoint (`state_dict`).

Either way a round's requests are seeded by the step that trains on it (`trapo.engine.rollout.request_seed`),
so a resumed run, or a round generated early, draws the same rollouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from trapo import console
from trapo.config import Config
from trapo.data import stop_token_ids
from trapo.engine import dist
from trapo.engine.policy import Policy, same_model
from trapo.engine.remote_engine import RemoteEngine
from trapo.engine.rollout import Rollout, request_seed
from trapo.engine.rollout_engine import RolloutEngine, open_engine
from trapo.training import prefetch
from trapo.training.curriculum import epoch_order
from trapo.training.inputs import RunInputs
from trapo.training.settings import engine_settings


class RolloutSource:
    """Colocated: this rank's own engine, a round generated when its step asks for it (the separate source
    shares the requests, the turn and the push, and adds the rounds asked for ahead)."""

    def __init__(
        self, cfg: Config, engine: RolloutEngine, policy: Policy, prompts: list[list[int]], *, rank: int, world: int
    ):
        self.cfg, self.engine, self.policy, self.prompts = cfg, engine, policy, prompts
        self.rank, self.world = rank, world  # this rank takes every world-th question of a batch

    def request(self, step: int, question_ids: list[int]) -> dict:
        """The generate arguments of 0-based step `step`'s rollouts of `question_ids`: seeded by that step."""
        r = self.cfg.rollout
        return dict(
            prompts=[self.prompts[i] for i in question_ids],
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
            min_tokens=r.min_tokens,
            seeds=[request_seed(self.cfg.seed, step, i) for i in question_ids],
        )

    def generate(self, step: int, question_ids: list[int]) -> list[list[Rollout]]:
        """G rollouts per question, [b][G]; on GPU the optimizer's states wait in host memory meanwhile."""
        with self.turn():
            return self.engine.generate(**self.request(step, question_ids))

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Generation's turn. vLLM on GPU: the trainer's movable states go to host memory first, so that the
        KV cache, woken by `generate`, fits beside what stays; vLLM sleeps (weights and KV cache released)
        before they come back. hf: the policy's ZeRO-3 parameters are gathered once for the whole turn."""
        self.policy.offload()
        try:
            with self.engine.turn():
                yield
        finally:
            self.policy.reload()

    @property
    def weights_asleep(self) -> bool:
        """The last turn released the engine's weights (vLLM's level-2 sleep): push before generating again."""
        return self.engine.weights_asleep

    def push_weights(self) -> int:
        """The policy's weights into the engine (gathered block by block); the bytes loaded, 0 for hf."""
        return self.engine.push_weights(self.policy.full_weights())

    def send_ahead(self, state, used: int | None = None) -> None:
        """Colocated: nothing is generated ahead of its step."""

    def staleness(self, step: int, totals: dict) -> dict:
        """Colocated: every round comes from the trainer's own weights; nothing to log."""
        return {}

    def state_dict(self) -> dict:
        """Colocated: nothing in flight for a checkpoint to keep."""
        return {}

    def restore(self, state: dict, step: int) -> None:
        """Colocated: nothing to take back from a checkpoint."""

    def close(self) -> None:
        """The colocated engine lives as long as the process."""


class SeparateRolloutSource(RolloutSource):
    """rollout.placement separate: the rollout ranks' engines behind a `RemoteEngine`, rounds asked for ahead."""

    engine: RemoteEngine

    def send_ahead(self, state, used: int | None = None) -> None:
        """Ask the rollout ranks for the rounds not asked for yet that this step (at its start) or the next
        (once this one `used` its batches) trains on (`prefetch.to_request`), from where the run's `RunState`
        (`state`, trapo/training/run_state.py) stands."""
        r = self.cfg.rollout
        if used is None:
            self.engine.step_versions = []  # the versions of this step's rounds, from here on
        args = state.step, state.cursor, r.max_staleness, r.dynamic_sampling, used, state.steps_per_epoch
        for step, at in prefetch.to_request(*args, state.finished):
            # with sampling.curriculum only the current epoch's plan is known (validation refuses it with s > 0)
            order, _ = epoch_order(self.cfg, state.tracker, at.epoch)
            self.engine.submit(**self.request(step, order[at.batch][self.rank :: self.world]))

    def staleness(self, step: int, totals: dict) -> dict:
        """The step's staleness and the stale-vs-current KL (`prefetch.step_values`)."""
        engine = self.engine
        return prefetch.step_values(
            step, min(engine.step_versions), self.cfg.rollout.max_staleness, totals, engine.last_generate_s
        )

    def state_dict(self) -> dict:
        """The rounds generated ahead and not yet trained on (rank 0 holds them)."""
        return {"rounds_in_flight": self.engine.in_flight()}

    def restore(self, state: dict, step: int) -> None:
        """The saved rounds come first; the next push is version `step`."""
        self.engine.restore(state.get("rounds_in_flight", []), step)

    def close(self) -> None:
        """The rollout ranks stop with the trainer."""
        self.engine.close()


def open_rollout_source(cfg: Config, policy: Policy, inputs: RunInputs, *, rank: int, world: int) -> RolloutSource:
    """This rank's rollouts, by rollout.placement: its own engine (colocated) or the rollout ranks' (separate),
    set up as `cfg` (planned: its auto settings decided) says for the policy's model. Collective. Says which
    engines run where, and checks that an engine with its own copy of the model runs what the policy runs."""
    model_dir, tokenizer = inputs.model_dir, inputs.tokenizer
    settings = engine_settings(cfg, rank=rank, world=world, overrides=policy.overrides)
    generation = getattr(policy.model, "generation_config", None)
    stops = stop_token_ids(tokenizer, generation and generation.eos_token_id)
    policy.hold_back(stops)  # the ids the engine holds back before rollout.min_tokens
    if cfg.rollout.placement == "separate":
        engine = RemoteEngine.connect(
            settings,
            model_dir,
            tokenizer=tokenizer,
            stop_token_ids=stops,
            rollout_ranks=cfg.rollout.ranks,
            timeout_s=cfg.dist_timeout_minutes * 60,
            rank=rank,
            world=world,
        )
        source = SeparateRolloutSource(cfg, engine, policy, inputs.prompts, rank=rank, world=world)
    else:
        engine = open_engine(settings, model_dir, tokenizer=tokenizer, stop_token_ids=stops, policy=policy)
        source = RolloutSource(cfg, engine, policy, inputs.prompts, rank=rank, world=world)
    if (engine_config := engine.effective_config()) is not None:  # a separate model must run the policy's
        console.say(same_model(policy.effective_config(), engine_config))
    console.say(engine.describe(dist.all_gather(engine.device())))
    return source
