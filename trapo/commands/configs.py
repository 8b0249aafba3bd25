"""`configs`: the configs that ship with trapo, one line each; `configs show NAME` prints one to copy and edit.

    trapo configs                       # name and first comment line of every shipped config
    trapo configs show trapo_1k_3k      # the file itself:  trapo configs show trapo_1k_3k > mine.yaml
    trapo train --config trapo_1k_3k    # any of them by name, from any directory

A name is what `trapo train --config` takes. A file of that name in the working directory wins over the
shipped one (trapo/resources.py), so an edited copy saved as `trapo_1k_3k.yaml` is the one that runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from trapo import resources


def listing() -> str:
    found = resources.shipped_configs()
    width = max(len(name) for name, _ in found)
    lines = [f"  {name:<{width}}  {resources.describe(path)}".rstrip() for name, path in found]
    return (
        f"shipped configs ({resources.shipped('configs')}):\n"
        + "\n".join(lines)
        + "\n\ntrapo train --config NAME [key=value ...] runs one; trapo configs show NAME prints it"
    )


def write(text: str) -> int:
    """`text` to stdout; a reader that closed the pipe early (`trapo configs | head`) is not an error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")  # nothing more can reach the reader; the exit's flush must not fail
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=["list", "show"], default="list", help="default: list")
    parser.add_argument("name", nargs="?", help="show: a name from the list (trapo_1k_3k, deepspeed_zero3.json)")
    args = parser.parse_args(argv)
    if args.action == "list":
        if args.name:
            parser.error("list takes no name; to print one: trapo configs show NAME")
        return write(listing() + "\n")
    if not args.name:
        print("trapo configs show: give a NAME from `trapo configs`", file=sys.stderr)
        return 2
    names = dict(resources.shipped_configs())
    path = names.get(args.name) or names.get(args.name.removeprefix("configs/").removesuffix(".yaml"))
    if path is None:
        print(f"trapo configs show: no shipped config named {args.name}; `trapo configs` lists them", file=sys.stderr)
        return 2
    return write(path.read_text())
