"""Regenerate tests/opinfo_results.json: run the OpInfo sweep on meshes (2,) and (2, 2) and record every op's outcome.

Usage (from the repository root)::

    .venv/bin/python scripts/update_opinfo_results.py            # both meshes, rewrite the JSON
    .venv/bin/python scripts/update_opinfo_results.py --check    # print the changes, write nothing

This is the only place ops are promoted: `tests/ops/test_opinfo_sweep.py` fails when a
recorded `pass` regresses or any op gives a wrong value, and never rewrites the file.
The script refuses to write while any op is a `mismatch` unless `--allow-mismatch` is
given (a recorded mismatch must be a decision, not an accident). It prints what changed
against the previous file: promotions, regressions and the new counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, ROOT)
    from tests.opinfo_sweep import MESHES, RESULTS_PATH, diff_lines, dump, load, mesh_name, run_sweep, summary

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print the changes, do not write the JSON")
    parser.add_argument("--allow-mismatch", action="store_true", help="write even if some op gives a wrong value")
    parser.add_argument("--out", default=RESULTS_PATH, help="where to write (default: tests/opinfo_results.json)")
    args = parser.parse_args(argv)

    old = load(RESULTS_PATH) if os.path.exists(RESULTS_PATH) else None
    new: dict[str, dict[str, dict[str, object]]] = {}
    seconds: dict[str, float] = {}
    for mesh_shape, samples in MESHES:
        t0 = time.monotonic()
        results, _ = run_sweep(mesh_shape, samples, verbose=True)
        seconds[mesh_name(mesh_shape)] = time.monotonic() - t0
        new[mesh_name(mesh_shape)] = results
    for name, results in new.items():
        print(summary(name, results, seconds[name]))
        if old is not None:
            for line in diff_lines(old.get(name, {}), results):
                print("  " + line)
    mismatched = sorted({k for results in new.values() for k, r in results.items() if r["status"] == "mismatch"})
    if args.check:
        return 0
    if mismatched and not args.allow_mismatch:
        print(f"not written: {len(mismatched)} ops give wrong values ({', '.join(mismatched)}); fix them or pass --allow-mismatch")
        return 1
    dump(new, args.out)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
