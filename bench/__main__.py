"""`python -m bench`: the benchmark suite's entry point (see bench/run.py)."""

from bench.run import main

__all__: list[str] = []

raise SystemExit(main())
