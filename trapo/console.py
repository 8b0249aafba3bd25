"""What reaches the terminal, and what goes to the run's log file.

The terminal gets our own lines: one per start-up phase, the progress bar,
warnings that matter (each kind once), the summary. Everything the libraries
print (vLLM and DeepSpeed INFO logs, PyTorch FutureWarnings, C++ messages of
the CPU backend, Math-Verify workers) goes to `run_dir/log.txt`
(`log.rank-R.txt` on other ranks), which also gets a copy of our lines.
This is done at the file-descriptor level, so output written by C++ code and
by child processes is caught too. `log_level: debug` (or TRAPO_LOG_LEVEL=debug)
leaves the terminal alone and turns the libraries' INFO logs on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn, TextIO

_terminal: TextIO | None = None  # the real terminal's stderr once `capture` ran
_terminal_out: TextIO | None = None  # and its stdout
_warned: set[str] = set()
_rank = 0  # only rank 0 speaks: the launcher shows every rank's output on one terminal


def debug_requested(log_level: str) -> bool:
    return (os.environ.get("TRAPO_LOG_LEVEL") or log_level).lower() == "debug"


def capture(run_dir: Path, rank: int, debug: bool) -> Path | None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to the run's log file.

    Call before vLLM, DeepSpeed or torch.distributed start (their loggers keep the
    streams they saw). Returns the log path, or None in debug mode (nothing moved).
    """
    global _terminal, _terminal_out, _rank
    _rank = rank
    silence_benign_library_warnings()
    if debug:
        os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"  # read when vLLM is imported
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ("log.txt" if rank == 0 else f"log.rank-{rank}.txt")
    sys.stdout.flush()
    sys.stderr.flush()
    _terminal = os.fdopen(os.dup(2), "w", buffering=1)
    _terminal_out = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return path


def terminal() -> TextIO:
    """The user's terminal (stderr before `capture`), for the progress bar and the summary."""
    return _terminal or sys.stderr


def terminal_out() -> TextIO:
    """The user's terminal's stdout (sys.stdout before `capture`), for the end-of-run summary."""
    return _terminal_out or sys.stdout


def progress_bar(total: int, desc: str, enabled: bool = True, **options):
    """A tqdm bar on the user's terminal, for work a command does in a loop; off when `enabled` is False (the
    command's --no-progress), when the terminal is no tty (a log file, CI), or when there is nothing to do."""
    from tqdm import tqdm

    stream = terminal()
    shown = enabled and total > 0 and hasattr(stream, "isatty") and stream.isatty()
    return tqdm(total=total, desc=desc, file=stream, disable=not shown, dynamic_ncols=True, **options)


def say(message: str) -> None:
    """One of our lines (rank 0's): to the terminal, and to the log file when the terminal is elsewhere."""
    if _rank != 0:
        return
    line = f"[trapo] {message}"
    print(line, file=terminal(), flush=True)
    if _terminal is not None:
        with contextlib.suppress(OSError):  # the log's disk may be full; the terminal has the line
            print(line, file=sys.stderr, flush=True)


def warn_once(kind: str, message: str) -> None:
    """A warning that matters (truncation, a grading-timeout storm): shown the first time its kind occurs."""
    if kind not in _warned:
        _warned.add(kind)
        say(f"warning: {message}")


class _DropBenignReloadWarnings(logging.Filter):
    """vLLM's layer-wise reload warns "<layer>: Failed to load weights" at every push for two layers that
    receive no tensor by design:

    - RotaryEmbedding: no trained weights, only its cos/sin table, which depends on the RoPE theta and
      positions alone; checkpoints (and our push) do not carry it, so vLLM keeps the one it built at start-up.
    - ParallelLMHead of a model with tied embeddings (SmolLM2): the head is the embedding's tensor, which the
      push loads in place (checkpoints leave the head out), and the CPU backend's packed copy of it is made
      again after each push (vllm_rollout.repack_shared_weights). An untied head that received nothing is the
      push's own error (VllmEngine.push_weights: every engine parameter must come).

    Other layers' load failures still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        benign = ("RotaryEmbedding", "ParallelLMHead")
        return not (record.args and record.args[0] in benign and "Failed to load" in record.msg)


def silence_benign_library_warnings() -> None:
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropBenignReloadWarnings())


def exit_now(code: int) -> NoReturn:
    """End the process with `code`, skipping the interpreter's teardown. For a command's entry point once its
    work is closed: checkpoints and files written, loggers and the grading worker closed, every rank past
    its last collective.

    The teardown does nothing a finished command needs, and it is slow: seconds per process, for every rank
    of every run (measured: docs/upstream-notes.md). Python-level buffers are flushed here; the log file is
    written at the file-descriptor level, so nothing is lost."""
    for stream in (_terminal_out, _terminal, sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # a full disk or a closed stream: exit anyway
                stream.flush()
    logging.shutdown()
    os._exit(code)
