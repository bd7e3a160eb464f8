"""The first answer of a fresh process: jaxdp against dp_accounting, wall time, medians and ratios.

Each case is a new Python process (``python -c``), timed from start to exit, so imports,
tracing, compilation and the run are all in. jaxdp runs with its program cache
(``JAXDP_CACHE_DIR``) empty (a new temporary folder per run) and warm (a folder filled by
one earlier process); dp_accounting has no cache. The cases alternate jaxdp and
dp_accounting run by run, so that load on a shared machine hits both alike; the ratios
are the figures to compare (the load average is printed with them).

    python benchmarks/first_answer.py            # 3 runs per case
    python benchmarks/first_answer.py --runs 5
    python benchmarks/first_answer.py --compare-tree /tmp/old   # before/after, alternated

Targets (issue 21): cold ≤ 1.5x dp_accounting, warm ≤ 1.0x, for DP-SGD, the event path and
PLD; ``jaxdp --help`` and an argument error < 0.5 s on an idle machine; ``jaxdp epsilon``
with a warm cache ≤ dp_accounting's fresh process.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 14040, 1e-5

JAXDP_DPSGD = f"import jaxdp.accounting as A; print(float(A.dpsgd_epsilon({Q!r}, {SIGMA}, {STEPS}, {DELTA})))"
JAXDP_EVENT = (f"import jaxdp.accounting as A; "
               f"print(float(A.epsilon(A.dpsgd_event({Q!r}, {SIGMA}, {STEPS}), {DELTA})))")
JAXDP_PLD = (f"import jaxdp.accounting as A; "
             f"print(float(A.epsilon(A.dpsgd_event({Q!r}, {SIGMA}, {STEPS}), {DELTA}, accountant='pld')))")
_DP_EVENT = (f"from dp_accounting import dp_event as E; "
             f"ev = E.SelfComposedDpEvent(E.PoissonSampledDpEvent({Q!r}, E.GaussianDpEvent({SIGMA})), {STEPS}); ")
DPA_RDP = _DP_EVENT + ("from dp_accounting.rdp import rdp_privacy_accountant as R; "
                       f"a = R.RdpAccountant(); a.compose(ev); print(a.get_epsilon({DELTA}))")
DPA_PLD = _DP_EVENT + ("from dp_accounting.pld import pld_privacy_accountant as P; "
                       f"a = P.PLDAccountant(); a.compose(ev); print(a.get_epsilon({DELTA}))")
CLI_EPSILON = ["-m", "jaxdp", "epsilon", "--q", repr(Q), "--noise-multiplier", str(SIGMA), "--num-steps", str(STEPS),
               "--delta", str(DELTA)]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(cache: str, root: str = ROOT) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    env["JAXDP_CACHE_DIR"] = cache
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return env


class _Seconds(float):
    """A process's wall time, with its CPU time (user + system) as ``.cpu``: under load the CPU
    time moves less than the wall time, so both ratios are printed."""

    cpu: float


def _wall(argv: list[str], cache: str, expect_rc: int = 0, root: str = ROOT) -> _Seconds:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=_env(cache, root),
                          cwd=root)
    wall = _Seconds(time.perf_counter() - t)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall.cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != expect_rc:
        raise RuntimeError(f"{argv}: exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return wall


def _cpu(times: list[_Seconds]) -> float:
    return statistics.median(t.cpu for t in times)


def _jaxdp(argv: list[str], warm: bool, tmp: str, root: str = ROOT) -> float:
    """One fresh jaxdp process, with an empty program cache or one filled by an earlier process."""
    cache = tempfile.mkdtemp(dir=tmp)
    if warm:
        _wall(argv, cache, root=root)
    return _wall(argv, cache, root=root)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="fresh processes per case (median reported)")
    p.add_argument("--skip-pld", action="store_true", help="leave out the PLD pair (the slowest)")
    p.add_argument("--compare-tree", default=None,
                   help="also run jaxdp from this source tree (e.g. `git archive` of an older commit), alternated "
                        "with the others, and print its ratios: a before/after under the same load")
    p.add_argument("--skip-command", action="store_true", help="leave out `jaxdp epsilon`, --help and errors")
    args = p.parse_args(argv)
    import platform

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    pairs = [("DP-SGD, dpsgd_epsilon vs RdpAccountant", ["-c", JAXDP_DPSGD], ["-c", DPA_RDP]),
             ("event, epsilon(dpsgd_event) vs RdpAccountant", ["-c", JAXDP_EVENT], ["-c", DPA_RDP])]
    if not args.skip_pld:
        pairs.append(("PLD, epsilon(accountant='pld') vs PLDAccountant", ["-c", JAXDP_PLD], ["-c", DPA_PLD]))
    if not args.skip_command:
        pairs.append(("command, jaxdp epsilon vs RdpAccountant", CLI_EPSILON, ["-c", DPA_RDP]))
    other = os.path.abspath(args.compare_tree) if args.compare_tree else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, mine, peer in pairs:
            cold, warm, theirs, cold_o, warm_o = [], [], [], [], []
            for _ in range(args.runs):  # alternated, so that load changes hit both sides
                theirs.append(_wall(peer, "off"))
                cold.append(_jaxdp(mine, False, tmp))
                warm.append(_jaxdp(mine, True, tmp))
                if other:
                    cold_o.append(_jaxdp(mine, False, tmp, other))
                    warm_o.append(_jaxdp(mine, True, tmp, other))
            c, w, d = (statistics.median(x) for x in (cold, warm, theirs))
            rows.append((name, c, w, d))
            print(f"{name:<46} jaxdp cold {c:6.2f} s ({c / d:4.2f}x)   warm {w:6.2f} s ({w / d:4.2f}x)   "
                  f"dp_accounting {d:6.2f} s   [CPU: cold {_cpu(cold):5.2f} s ({_cpu(cold) / _cpu(theirs):4.2f}x), "
                  f"warm {_cpu(warm):5.2f} s ({_cpu(warm) / _cpu(theirs):4.2f}x), dp_accounting "
                  f"{_cpu(theirs):5.2f} s]", flush=True)
            if other:
                co, wo = statistics.median(cold_o), statistics.median(warm_o)
                print(f"{'  the --compare-tree':<46} jaxdp cold {co:6.2f} s ({co / d:4.2f}x)   warm {wo:6.2f} s "
                      f"({wo / d:4.2f}x)   [CPU: cold {_cpu(cold_o):5.2f} s ({_cpu(cold_o) / _cpu(theirs):4.2f}x), "
                      f"warm {_cpu(warm_o):5.2f} s ({_cpu(warm_o) / _cpu(theirs):4.2f}x)]", flush=True)
        if not args.skip_command:
            helps = [_wall(["-m", "jaxdp", "--help"], "off") for _ in range(args.runs)]
            errors = [_wall(["-m", "jaxdp", "epsilon", "--q", "2", "--noise-multiplier", "1", "--num-steps", "10",
                             "--delta", "1e-5"], "off", expect_rc=2) for _ in range(args.runs)]
            usage = [_wall(["-m", "jaxdp", "epsilon", "--q", "0.5"], "off", expect_rc=2) for _ in range(args.runs)]
            print(f"{'jaxdp --help':<46} {statistics.median(helps):6.2f} s (target < 0.5 s idle)")
            print(f"{'jaxdp epsilon --q 2 ... (range error)':<46} {statistics.median(errors):6.2f} s "
                  "(target < 0.5 s idle)")
            print(f"{'jaxdp epsilon --q 0.5 (missing options)':<46} {statistics.median(usage):6.2f} s "
                  "(target < 0.5 s idle)")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
