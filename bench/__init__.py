"""Side-by-side benchmarks of shardwise against torch.distributed.tensor: `make bench` or `python -m bench`.

One module per benchmark (overhead, redistribute, steps, memory), each with a `run(settings)`
that returns tables; `run.py` is the entry point. Not part of the installed library: it
imports torch's DTensor, which the library itself never does.
"""

__all__: list[str] = []
