"""`python -m trapo <command> [args]`: the project's one entry point (`python -m trapo --help` lists them).

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
    "prepare": ("trapo.commands.prepare", "build training files from local copies of the public datasets"),
    "doctor": ("trapo.commands.doctor", "preflight: versions, devices, a two-step trial run, the memory plan"),
    "report": ("trapo.commands.report", "plots and report.md of a run directory"),
    "reproduce": ("trapo.commands.reproduce", "the paper's claims on the toy task (make reproduce-toy)"),
    "readme": ("trapo.commands.readme", "rewrite the generated blocks of README.md and docs/ from outputs"),
    "gpu-kit": ("trapo.commands.gpu_kit", "wheels a lent GPU machine lacks, for an offline install (make gpu-kit)"),
    "gpu-check": ("trapo.commands.gpu_check", "what works on this GPU, in parts of < 9 minutes (make gpu-check)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()]
    return "usage: python -m trapo <command> [args]   (python -m trapo <command> --help)\n\ncommands:\n" + "\n".join(
        lines
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    while args and args[0].startswith("--local_rank"):  # the launcher's, before the command
        args = args[2:] if args[0] == "--local_rank" else args[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"python -m trapo: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"python -m trapo {name}"  # argparse's default prog: every command's usage line names itself
    return importlib.import_module(COMMANDS[name][0]).main(rest)


if __name__ == "__main__":
    from trapo import console

    console.exit_now(main())  # the command's work is closed: no interpreter teardown (see exit_now)
