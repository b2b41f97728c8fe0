"""`shardwise run --ft --groups G -n N script.py`: a lighthouse and G replica groups, each its own torchrun launch.

Each group is a separate `torch.distributed.run` (its own rendezvous on a free local port,
its own world of N processes) with `--max-restarts`: when one of its processes fails,
torchrun ends and restarts that group's processes and no other group's, and the restarted
group heals from a live one through its `Manager`. The lighthouse runs in this process. The
groups find it, and their names, in `SHARDWISE_FT_LIGHTHOUSE` and `SHARDWISE_FT_REPLICA_ID`
(`group0`, `group1`, ...).

| option | meaning | default |
|---|---|---|
| `--groups G` | replica groups to launch | required |
| `--max-restarts R` | restarts of each group (torchrun's option) | 3 |
| `--min-replicas M` | groups a quorum needs | 1 |
| `--join-timeout S` | seconds a quorum waits for a live group that does not ask | 1.0 |
| `--heartbeat-timeout S` | seconds without a heartbeat before a group is not waited for | 1.0 |
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from ._launch import _valued_options, torchrun_args
from .ft import Lighthouse, QuorumRule

__all__ = ["launch_groups", "split_ft_args"]

_OPTIONS = {"--groups": int, "--max-restarts": int, "--min-replicas": int, "--join-timeout": float,
            "--heartbeat-timeout": float}


def split_ft_args(argv: Sequence[str]) -> tuple[dict[str, float], list[str]]:
    """(the fault-tolerance options, the rest for torchrun) of `argv` (after `--ft`), up to the
    script; ValueError naming a bad value.

    >>> split_ft_args(["--groups", "3", "-n", "2", "train.py", "--groups", "9"])
    ({'groups': 3, 'max_restarts': 3, 'min_replicas': 1, 'join_timeout': 1.0, 'heartbeat_timeout': 1.0}, ['-n', '2', 'train.py', '--groups', '9'])
    """
    found: dict[str, float] = {"max_restarts": 3, "min_replicas": 1, "join_timeout": 1.0, "heartbeat_timeout": 1.0}
    valued = _valued_options() | {"-n", "--nproc-per-node", "--nproc_per_node"}
    rest: list[str] = []
    args, i = list(argv), 0
    while i < len(args):
        name, _, value = args[i].partition("=")
        if name in _OPTIONS:
            if not value:
                if i + 1 >= len(args):
                    raise ValueError(f"{name} needs a value")
                value, i = args[i + 1], i + 1
            try:
                number = _OPTIONS[name](value)
            except ValueError:
                raise ValueError(f"{name}={value!r}: a number is expected") from None
            if number < (0 if name in ("--max-restarts", "--join-timeout") else 1):
                raise ValueError(f"{name}={value}: out of range")
            found[name[2:].replace("-", "_")] = number
        elif not args[i].startswith("-"):
            rest += args[i:]  # the script and its own arguments
            break
        else:
            takes_value = args[i] in valued and i + 1 < len(args)
            rest += args[i:i + 1 + takes_value]
            i += takes_value
        i += 1
    if "groups" not in found:
        raise ValueError("--ft needs --groups G: shardwise run --ft --groups 3 -n 2 train.py")
    return {k: found[k] for k in ("groups", *(k for k in found if k != "groups"))}, rest


def launch_groups(argv: Sequence[str]) -> int:
    """Run the lighthouse and the groups until every group ends; 0 if all ended well."""
    options, rest = split_ft_args(argv)
    torchrun = torchrun_args(rest)
    rule = QuorumRule(int(options["min_replicas"]), float(options["join_timeout"]))
    with Lighthouse(rule=rule, heartbeat_timeout=float(options["heartbeat_timeout"])) as lighthouse:
        print(f"shardwise run --ft: lighthouse at {lighthouse.address}, {int(options['groups'])} replica groups",
              flush=True)
        groups = []
        for g in range(int(options["groups"])):
            env = dict(os.environ, SHARDWISE_FT_LIGHTHOUSE=lighthouse.address, SHARDWISE_FT_REPLICA_ID=f"group{g}")
            env.setdefault("OMP_NUM_THREADS", "1")
            command = [sys.executable, "-m", "torch.distributed.run", f"--max-restarts={int(options['max_restarts'])}",
                       *torchrun]
            groups.append(subprocess.Popen(command, env=env))
        codes = [p.wait() for p in groups]
    failed = [f"group{g}" for g, code in enumerate(codes) if code != 0]
    if failed:
        print(f"shardwise run --ft: {', '.join(failed)} failed past --max-restarts; see the output above",
              file=sys.stderr)
    return 1 if failed else 0
