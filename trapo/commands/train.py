"""`train`: one training run, from a YAML config and dotted overrides.

    deepspeed trapo_train.py --config configs/<exp>.yaml [dotted.key=value ...]
    python -m trapo train [--config FILE] [dotted.key=value ...]   # the same, one process
    python trapo_train.py                      # the embedded CPU default (configs/toy.yaml)
    trapo train --config trapo_1k_3k           # a shipped config by name, from any directory (trapo configs)

Without --config the embedded toy task runs: a tiny Qwen2 and synthetic
arithmetic built by the project, trained with the real stack (DeepSpeed
ZeRO-3, colocated vLLM or rollout.backend=hf, Math-Verify). Configuration errors exit with status 2
and a message naming the key, before anything is loaded.
"""

import argparse
import contextlib
import os
import sys
import traceback
from pathlib import Path

from trapo import runtime

DEFAULT_CONFIG = "toy"  # the shipped configs/toy.yaml (trapo/resources.py), unless ./toy.yaml is here


def _traceback_to_log(log: Path | None) -> None:
    """The current exception's traceback into log.txt (stderr once captured); the terminal gets one line.
    Not when nothing is captured (debug): stderr is the terminal then. The log's disk may be the full one."""
    if log is not None:
        with contextlib.suppress(OSError):
            traceback.print_exc(file=sys.stderr)


class _StartUp:
    """What start-up has made so far, for the one line a Ctrl-C ends in (KeyboardInterrupt: outside the
    training loop, where trapo/training/preemption.py turns SIGINT into a save and a stop instead)."""

    def __init__(self):
        self.run_dir: Path | None = None
        self.log: Path | None = None  # log.txt, once the libraries' output goes there
        self.entries: set[str] = set()  # the run directory's entries before this start
        self.metrics = 0  # metrics.jsonl's size before: larger at the interrupt, steps were taken
        self.toy: Path | None = None  # the toy's manifest, when the toy is on
        self.toy_mtime = 0.0

    def note(self, cfg) -> None:
        self.run_dir = Path(cfg.run_dir)
        self.entries = set(os.listdir(self.run_dir)) if self.run_dir.is_dir() else set()
        self.metrics = _size(self.run_dir / "metrics.jsonl")
        if cfg.toy.enabled:
            self.toy = Path(cfg.toy.asset_dir) / "manifest.json"
            self.toy_mtime = self.toy.stat().st_mtime if self.toy.is_file() else 0.0

    def interrupted(self) -> str:
        if self.run_dir is None:
            return "interrupted during start-up (before the first step): nothing written"
        if _size(self.run_dir / "metrics.jsonl") > self.metrics:
            return (
                f"interrupted after the training steps (final evaluation or summary): the steps and checkpoints "
                f"written are in {self.run_dir}; summary.json is not"
            )
        wrote = []
        if self.run_dir.is_dir():
            new = sorted(set(os.listdir(self.run_dir)) - self.entries)
            if new:
                wrote.append(f"{', '.join(new)} in {self.run_dir}")
        if self.toy is not None and self.toy.is_file() and self.toy.stat().st_mtime != self.toy_mtime:
            wrote.append(f"the toy's model and data in {self.toy.parent} (complete: a next run reuses them)")
        what = "nothing written but " + "; ".join(wrote) if wrote else "nothing written"
        return f"interrupted during start-up (before the first step): {what}; run the same command again to start"


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def main(argv: list[str] | None = None) -> int:
    """`_main`, with a Ctrl-C outside the training loop ending in one line and exit status 130 (SIGINT's)."""
    started = _StartUp()
    try:
        return _main(argv, started)
    except KeyboardInterrupt:
        from trapo import console

        _traceback_to_log(started.log)  # where it was, for a bug report; the terminal gets the one line
        if int(os.environ.get("RANK", "0")) == 0:
            console.say(started.interrupted())
        return 130


def _main(argv: list[str] | None, started: _StartUp) -> int:
    runtime.configure()  # before vLLM or torch is imported: see trapo/runtime.py
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="YAML experiment config: a file, or a shipped config by name (`trapo configs`); default: the toy task",
    )
    parser.add_argument("--list-configs", action="store_true", help="list the shipped configs (as `trapo configs`)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. loss.clip_eps=0.28")
    args = parser.parse_args(argv)
    if args.list_configs:
        from trapo.commands.configs import listing, write

        return write(listing() + "\n")

    from trapo.config import ConfigError, load_config, read_deepspeed_config
    from trapo.data import DataError

    try:
        cfg = load_config(args.config, args.overrides)
        read_deepspeed_config(cfg.train.deepspeed_config)  # a missing or broken JSON: now, not after the toy's build
        started.note(cfg)
        from trapo.engine.rollout import require_backend

        # No vLLM for backend vllm: stop before anything is built (one that fails to import: the trainer, later).
        # auto passes here (hf needs no vLLM); the trainer chooses and says which (run_record.resolve_backend).
        require_backend(cfg.rollout.backend, load=False)
        from trapo.algorithm.rewards.verifiers import require_verifier

        require_verifier(cfg.reward.verifier)  # a task verifier that cannot be imported: one line, now
        if int(os.environ.get("RANK", "0")) == 0:  # one run per directory, claimed before its log is opened
            from trapo.engine.checkpoint import check_run_dir, resolve
            from trapo.training.run_record import claim

            claim(cfg.run_dir)
            # a resume_from that is no checkpoint, or another run's logs this run would not resume: now, not
            # after the toy's build (the trainer checks again, for every entry point)
            resolve(cfg.resume_from, cfg.run_dir / "checkpoints")
            check_run_dir(cfg.run_dir, cfg.resume_from)
    except (ConfigError, FileNotFoundError) as err:
        print(f"trapo_train: {err}", file=sys.stderr)
        return 2
    from trapo import console

    # From here on the libraries' output goes to run_dir/log.txt; our own lines to the terminal.
    try:
        log = console.capture(cfg.run_dir, int(os.environ.get("RANK", "0")), console.debug_requested(cfg.logging.level))
    except OSError as err:  # rank 0 claimed (and made) the directory; another rank may see another filesystem
        print(f"trapo_train: run directory {cfg.run_dir}: cannot write its log ({err.strerror})", file=sys.stderr)
        return 2
    started.log = log
    from trapo.commands import toy
    from trapo.engine.checkpoint import CheckpointError
    from trapo.engine.grading.verifier import GraderStartError
    from trapo.engine.rollout_link import split_world
    from trapo.training.rollout_worker import serve
    from trapo.training.trainer import Preempted, TrainingError, run

    try:
        # rollout.placement separate: the last rollout.ranks processes serve rollouts, the others train
        role, link_rank = split_world(cfg.rollout.placement, cfg.rollout.ranks)
        if role == "rollout":
            serve(cfg, link_rank)
            return 0
        toy.prepare(cfg)  # the embedded task's model and data, built once (rank 0) before the trainer reads them
        run(cfg)
    except (DataError, ConfigError, FileNotFoundError) as err:
        _traceback_to_log(log)  # where it was raised, for a bug report; the terminal gets the one line
        console.say(f"input error: {err}")
        return 2
    except CheckpointError as err:  # a full or failing disk, a damaged checkpoint: the cause and the fix
        _traceback_to_log(log)
        console.say(str(err))
        return CheckpointError.EXIT_CODE
    except Preempted as err:
        console.say(str(err))
        return Preempted.EXIT_CODE
    except TrainingError as err:
        console.say(str(err))
        return 3
    except GraderStartError as err:  # a broken installation: the cause and the fix, the traceback in log.txt
        _traceback_to_log(log)
        console.say(str(err))
        return 3
    except Exception as err:
        from trapo.engine.dist import timeout_message

        message = timeout_message(err, cfg.dist_timeout_minutes)
        if message is not None:  # another rank died or hangs: one line here, the traceback in log.txt
            _traceback_to_log(log)
            console.say(message)
            return 3
        # A crash: its traceback belongs on the terminal, not only in the log.
        traceback.print_exc(file=console.terminal())
        if log is not None:
            print(f"trapo_train: the libraries' output before the error is in {log}", file=console.terminal())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
