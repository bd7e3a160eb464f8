"""Where the PLD upper bound's CPU time goes, by source line (issue 27's cost work).

Runs one vmapped ``epsilon(dpsgd_event(q, σ, T), δ, accountant="pld")`` over random DP-SGD
configurations (the grid of ``pld.py``: q in [1e-3, 1e-1], σ in [0.6, 3], 100 to 2·10⁴ steps),
traces a second call with ``jax.profiler`` and attributes each XLA kernel's time to the jaxdp
source line most of its fused operations come from (the compiled HLO's stack frames). Kernel
times are summed over both add/remove directions (the scan runs its body twice) and over XLA's
threads, so the shares, not the totals, are what to compare. On a shared machine, run it
twice and compare shares only within one run.

    PYTHONPATH=$PWD python benchmarks/pld_profile.py [--configs 200] [--grid-size 16384] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import numpy as np


def _frames(text):
    """stack_frame_id -> [(file, line), ...] innermost first, from the HLO text's tables."""
    files, funcs, locs, frames, sec = {}, {}, {}, {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            sec = line
            continue
        if sec and not line.strip():
            sec = None
            continue
        if sec == "FileNames":
            i, f = line.split(" ", 1)
            files[int(i)] = f.strip('"')
        elif sec == "FunctionNames":
            i, f = line.split(" ", 1)
            funcs[int(i)] = f.strip('"')
        elif sec == "FileLocations":
            m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+).*?line=(\d+)", line)
            if m:
                locs[int(m.group(1))] = (files[int(m.group(2))], int(m.group(4)), funcs.get(int(m.group(3)), ""))
        elif sec == "StackFrames":
            m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
            if m:
                frames[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))

    def chain(fid):
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            out.append(locs.get(loc))
            fid = parent
        return [x for x in out if x]

    return chain


# Small helpers whose time is attributed to their caller's line.
_HELPERS = ("lse", "safe_log", "by_direction", "sign_of")


def _attribute(text, chain):
    """kernel name -> the most frequent innermost jaxdp PLD source line of its operations."""
    bodies, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            bodies[cur] = []
        elif cur:
            bodies[cur].append(line)
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*%?([\w.\-]+) = (.*)", line)
        if not m:
            continue
        name, rest = m.groups()
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        body = bodies.get(called.group(1), []) if called else [line]
        count = collections.Counter()
        for op in body:
            f = re.search(r"stack_frame_id=(\d+)", op)
            if not f:
                continue
            # Innermost frame in a PLD module, skipping the direction scan's call site.
            pld = [(p, ln, fn) for p, ln, fn in chain(int(f.group(1)))
                   if os.path.basename(p).startswith("_pld") and "lax.scan" not in _source(p, ln)]
            outer = [x for x in pld if x[2] not in _HELPERS] or pld
            if outer:
                count[outer[0][:2]] += 1
        if count:
            out[name] = count.most_common(1)[0][0]
    return out


@functools.cache
def _lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _source(path, ln):
    lines = _lines(path)
    return lines[ln - 1].strip() if 0 < ln <= len(lines) else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=200)
    ap.add_argument("--grid-size", type=int, default=None)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    import jaxdp.accounting as A

    rng = np.random.default_rng(0)
    n = args.configs
    q = 10 ** rng.uniform(-3, -1, n)
    s = rng.uniform(0.6, 3, n)
    t = np.round(10 ** rng.uniform(2, 4.3, n))
    kw = {} if args.grid_size is None else {"grid_size": args.grid_size}
    fn = jax.jit(jax.vmap(lambda q, s, t: A.epsilon(A.dpsgd_event(q, s, t), args.delta, accountant="pld", **kw)))
    jax.block_until_ready(fn(q, s, t))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(fn(q, s, t))
        trace = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[0]
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    text = fn.lower(q, s, t).compile().as_text()
    where = _attribute(text, _frames(text))
    per_kernel = collections.Counter()
    for e in events:  # XLA's kernels (not the executor, Python frames, or loops that contain kernels)
        if e.get("ph") == "X" and not re.match(r"(Thunk|\$|Slinky|while|call|conditional)", e["name"]):
            per_kernel[e["name"]] += e["dur"]
    by_line = collections.Counter()
    for name, us in per_kernel.items():
        by_line[where.get(name, ("(unattributed) " + name, 0))] += us
    total = sum(by_line.values())
    print(f"{n} configurations, grid {args.grid_size or 'default'}: kernel time {total / 1e3:.0f} ms "
          f"(all threads, both directions)")
    for (path, ln), us in by_line.most_common(args.top):
        src = _source(path, ln)[:70] if ln else ""
        print(f"{us / 1e3:8.1f} ms {100 * us / total:5.1f}%  {os.path.basename(path)}:{ln}  {src}")


if __name__ == "__main__":
    main()
