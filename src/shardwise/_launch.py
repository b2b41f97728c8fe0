"""`shardwise run -n N script.py [args]`: N local processes through PyTorch's own launcher.

The launcher is `torch.distributed.run` (what `torchrun` is), so everything it offers for
many machines (`--nnodes`, `--node-rank`, `--master-addr`, `--rdzv-endpoint`, ...) passes
straight through, and a script that works here works under `torchrun` on a cluster. The
only additions: `-n N` for `--nproc-per-node N`, and `--standalone` (a free local port)
when no rendezvous is given, so two local runs never fight over port 29500.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["launch", "torchrun_args", "usage"]

# options that say where the other machines are: with any of them, no --standalone
_RENDEZVOUS = ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr",
               "--master-port", "--master_port", "--standalone", "--rdzv-backend", "--rdzv_backend")


def torchrun_args(argv: Sequence[str]) -> list[str]:
    """Translate `shardwise run` arguments into `torch.distributed.run` arguments.

    >>> torchrun_args(["-n", "2", "train.py", "--lr", "3e-4"])
    ['--standalone', '--nproc-per-node=2', 'train.py', '--lr', '3e-4']
    >>> torchrun_args(["-n4", "--nnodes", "2", "--node-rank=1", "--master-addr=head", "t.py"])
    ['--nproc-per-node=4', '--nnodes', '2', '--node-rank=1', '--master-addr=head', 't.py']
    """
    args = list(argv)
    out: list[str] = []
    nproc: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-n", "--nproc-per-node", "--nproc_per_node"):
            if i + 1 >= len(args):
                raise ValueError(f"{a} needs a number of processes: shardwise run -n 4 script.py")
            nproc, i = args[i + 1], i + 2
            continue
        if a.startswith("-n") and not a.startswith("--") and len(a) > 2:
            nproc, i = a[2:], i + 1
            continue
        if a.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            nproc, i = a.split("=", 1)[1], i + 1
            continue
        if not a.startswith("-"):
            script = args[i:]  # the script and its own arguments
            break
        takes_value = a in _valued_options()
        out += args[i : i + 1 + takes_value]
        i += 1 + takes_value
    else:
        raise ValueError(f"no script to run in {list(argv)}: shardwise run -n 4 script.py [args]")
    if nproc is None:
        raise ValueError(f"say how many processes: shardwise run -n 4 {' '.join(argv)}")
    if not nproc.isdigit() or int(nproc) < 1:
        raise ValueError(f"-n takes a positive number of processes per node, got {nproc!r}")
    head = [f"--nproc-per-node={nproc}"]
    if not any(a.split("=", 1)[0] in _RENDEZVOUS for a in out):
        head.insert(0, "--standalone")
    return head + out + script


def _valued_options() -> set[str]:
    """torchrun's options that take a value as the next argument (`--nnodes 2`)."""
    from torch.distributed.run import get_args_parser

    return {o for action in get_args_parser()._actions if action.nargs is None for o in action.option_strings}


def usage() -> str:
    """`shardwise run --help`: its own usage, then the torchrun options that pass through."""
    from torch.distributed.run import get_args_parser

    text = get_args_parser().format_help()
    torchrun = text[text.find("options:"):] if "options:" in text else text
    return (
        "usage: shardwise run -n N [torchrun options] script.py [script args]\n\n"
        "Runs N local processes of script.py through torch.distributed.run (torchrun):\n"
        "  -n N, --nproc-per-node N   processes per node\n"
        "  (no rendezvous option given: --standalone, a free local port)\n"
        "  -h, --help                 this message (after the script, --help is the script's)\n\n"
        "torchrun's options, passed through as they are:\n" + torchrun
    )


def _asks_for_help(argv: Sequence[str]) -> bool:
    """`-h` / `--help` before the script (after it, it belongs to the script)."""
    valued = _valued_options() | {"-n", "--nproc-per-node", "--nproc_per_node"}
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-h", "--help"):
            return True
        elif not a.startswith("-"):
            return False
        else:
            skip = a in valued
    return False


def launch(argv: Sequence[str]) -> int:
    """Run torch.distributed.run with the translated arguments; its exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    if _asks_for_help(argv):
        print(usage())
        return 0
    args = torchrun_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
    try:
        torchrun_main(args)
    except ChildFailedError as exc:
        print(f"shardwise run: {exc.name} failed on {len(exc.failures)} process(es); see the output above")
        return 1
    return 0
