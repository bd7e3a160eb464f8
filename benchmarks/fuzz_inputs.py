"""The full-size input fuzzing of issue 26 (not run by CI; ``tests/test_fuzz.py`` runs it at smoke size).

Claim: every argument list given to ``jaxdp epsilon``, ``calibrate``, ``grid`` and ``pnsgd``
ends with a result (exit 0, every value valid by the oracles of ``tests/test_fuzz.py``) or
with exactly one line ``jaxdp: error: ...`` (exit 1 or 2); never a traceback, never exit 0
with an invalid value. Then the inputs of issue 26's item 7 and eight kinds of damaged
MNIST files through ``jaxdp train --data-path`` and ``jaxdp per-instance --data``.

Unlike the tests, a failed check does not stop the run: every finding is collected and
printed at the end (command, argument list, what was wrong), with the counts of exit
statuses. Exit status 1 when anything was found.

    python benchmarks/fuzz_inputs.py                     # 2,000 argument lists per command (~30-60 min)
    python benchmarks/fuzz_inputs.py --examples 200      # a quicker pass
    python benchmarks/fuzz_inputs.py --commands epsilon,grid
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hypothesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

COMMANDS = ("epsilon", "calibrate", "grid", "pnsgd")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="argument lists per command (default 2000)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="subset of " + ",".join(COMMANDS))
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    args = ap.parse_args()

    import tests.test_fuzz as F
    from jaxdp.cli import grid

    grid._heatmap = lambda *a, **k: None  # the drawing is not what is fuzzed; it costs a second per grid

    findings: list[tuple[str, object, str]] = []
    status = collections.Counter()
    tmp = tempfile.mkdtemp(prefix="jaxdp-fuzz-")
    start = time.perf_counter()

    for command in [c.strip() for c in args.commands.split(",") if c.strip()]:
        t0 = time.perf_counter()
        counter = [0]

        @hypothesis.seed(args.seed)
        @settings(max_examples=args.examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def run(data):
            # Full size: pnsgd's record count is fuzzed with valid values too (each compiles).
            argv, given_ = data.draw(F.argument_lists(command, structural_valid=True))
            counter[0] += 1
            out_dir = os.path.join(tmp, f"{command}-{counter[0]}")
            os.makedirs(out_dir, exist_ok=True)
            try:
                rc, err = F.fuzz_one(command, argv, given_, out_dir)
                status[(command, rc)] += 1
            except AssertionError as exc:
                findings.append((command, argv, str(exc).splitlines()[0][:300]))
            except Exception:  # the harness itself must not stop the run
                findings.append((command, argv, "harness: " + traceback.format_exc().splitlines()[-1]))

        run()
        print(f"{command}: {counter[0]} argument lists in {time.perf_counter() - t0:.0f} s", flush=True)

    # Issue 26, item 7: the listed inputs, and damaged MNIST files through both options.
    for argv, words in F.ISSUE_26_INPUTS:
        rc, out, err = F._run([*argv, "--out", os.path.join(tmp, "issue")] if argv[0] in ("grid", "audit") else argv)
        status[("issue-26", rc)] += 1
        if not (rc == 2 and err.count("\n") == 1 and words in err):
            findings.append(("issue-26", argv, err.strip()[:300]))
    from pathlib import Path

    import tests.data.test_data as D

    for kind in D.CORRUPT:
        folder = Path(tempfile.mkdtemp(dir=tmp))
        path, words = D._corrupt(kind, folder)
        for argv in (["train", "--dataset", "mnist", "--data-path", str(path), "--plot", "none"],
                     ["per-instance", "--checkpoint-dir", str(folder / "none"), "--data", str(path), "--out", "none",
                      "--histogram", "none"]):
            rc, out, err = F._run(argv)
            status[("data-files", rc)] += 1
            if not (rc == 2 and err.count("\n") == 1 and words in err and str(path) in err):
                findings.append(("data-files", argv, err.strip()[:300]))

    print(f"\n{sum(status.values())} runs in {time.perf_counter() - start:.0f} s; exit statuses:")
    for (command, rc), n in sorted(status.items()):
        print(f"  {command:<12} exit {rc}: {n}")
    print(f"{len(findings)} finding(s)")
    for command, argv, what in findings:
        print(f"  {command}: {argv!r}\n    {what}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
