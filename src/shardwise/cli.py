"""The `shardwise` command: `shardwise demo` (the main job) and `shardwise run` (a launcher).

    shardwise demo [--mesh 2x2] [--steps N] [--nproc N] [--device cpu|cuda] [--no-compare]
    shardwise run -n N [torchrun options] script.py [script args]
    shardwise run --ft --groups G -n N [options] script.py [script args]   (replica groups: shardwise.ft)
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after `run` belongs to the launcher and the script
        from ._launch import launch
        from ._launch_ft import launch_groups

        try:
            return launch_groups(argv[2:]) if argv[1:2] == ["--ft"] else launch(argv[1:])
        except ValueError as exc:
            print(f"shardwise run: {exc}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from .demo import add_arguments

    add_arguments(sub.add_parser("demo", help="train a small GPT on a (dp, tp) mesh of local processes"))
    sub.add_parser("run", help="launch N local processes of a script (torch.distributed.run underneath)")
    args = parser.parse_args(argv)
    from .demo import main as demo_main

    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
