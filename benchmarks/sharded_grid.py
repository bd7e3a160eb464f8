"""Throughput of the streamed, sharded ε grid with 1, 2, 4 and 8 host devices; peak memory at 10^6.

Claim (issue 12): ``jaxdp grid`` / :func:`jaxdp.grids.epsilon_grid` split each chunk over all
devices with ``jax.sharding`` and give the single-device values; a 10^6-configuration grid
streams with bounded memory.

For each device count a subprocess starts with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the count is fixed when jax starts),
evaluates the same grid (first call: compilation + grid; then the grid again, timed) and
reports configurations per second and the largest difference from the 1-device values.
On a CPU the "devices" share the machine's cores: with more devices than cores this
measures the overhead of partitioning, not a speed-up.

``--million`` evaluates 100 × 100 × 10 × 10 = 10^6 configurations (default orders) into a
temporary folder, chunk by chunk, and reports the time and the peak resident memory
(``ru_maxrss``) next to the memory after importing jax and compiling one chunk.

Usage:
  python benchmarks/sharded_grid.py                 # 1, 2, 4, 8 devices, 65,536 configurations
  python benchmarks/sharded_grid.py --million       # the 10^6 grid: time and peak memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _axes(size: int):
    import numpy as np

    # size = 64 q × 32 noise multipliers × (size / 2048) steps values, δ = 1e-5.
    nt = max(1, size // 2048)
    return np.geomspace(1e-4, 0.1, 64), np.linspace(0.5, 5.0, 32), np.geomspace(100, 1e5, nt), [1e-5]


def child(size: int, chunk_size: int, out_path: str) -> None:
    import jax
    import numpy as np

    import jaxdp.grids as G

    axes = _axes(size)
    t0 = time.perf_counter()
    first = G.epsilon_grid(*axes, chunk_size=chunk_size)
    t1 = time.perf_counter()
    again = G.epsilon_grid(*axes, chunk_size=chunk_size)
    t2 = time.perf_counter()
    np.save(out_path, np.asarray(again.epsilon))
    n = again.epsilon.size
    print(json.dumps(dict(devices=jax.device_count(), configurations=n, first_s=t1 - t0, warm_s=t2 - t1,
                          per_s=n / (t2 - t1), same_as_first=bool(np.array_equal(first.epsilon, again.epsilon)))))


def million(chunk_size: int) -> None:
    import jax
    import numpy as np

    import jaxdp.grids as G

    axes = (np.geomspace(1e-5, 0.5, 100), np.linspace(0.3, 10.0, 100), np.geomspace(10, 1e6, 10),
            np.geomspace(1e-12, 1e-3, 10))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        G.epsilon_grid(axes[0][:1], axes[1][:1], axes[2][:1], axes[3][:1], chunk_size=chunk_size)  # compile only
        compile_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t1 = time.perf_counter()
        res = G.epsilon_grid(*axes, directory=tmp, chunk_size=chunk_size, progress=sys.stderr.isatty())
        t2 = time.perf_counter()
        csv = os.path.join(tmp, "epsilon_grid.csv")
        G.write_grid_csv(csv, res)
        t3 = time.perf_counter()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        eps = np.asarray(res.epsilon)
        print(json.dumps(dict(configurations=int(eps.size), chunk_size=chunk_size, devices=jax.device_count(),
                              first_chunk_s=t1 - t0, grid_s=t2 - t1, per_s=eps.size / (t2 - t1), csv_s=t3 - t2,
                              csv_mb=os.path.getsize(csv) / 2**20, rss_after_compile_mb=compile_rss,
                              peak_rss_mb=peak, nan=int(np.isnan(eps).sum()), inf=int(np.isinf(eps).sum()),
                              epsilon_min=float(eps.min()), epsilon_max=float(eps.max()))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=65536, help="configurations (multiple of 2048)")
    ap.add_argument("--chunk-size", type=int, default=16384)
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--million", action="store_true")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.million:
        million(args.chunk_size)
        return
    if args.child is not None:
        child(args.size, args.chunk_size, args.out)
        return
    import numpy as np

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(v) for v in args.devices.split(",")]:
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            out = os.path.join(tmp, f"eps{n}.npy")
            proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--size", str(args.size),
                                   "--chunk-size", str(args.chunk_size), "--out", out],
                                  capture_output=True, text=True, env=env, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            eps = np.load(out)
            ref = eps if ref is None else ref
            row["max_rel_diff_vs_first"] = float(np.max(np.abs(eps - ref) / np.maximum(np.abs(ref), 1e-300)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print("| devices | configurations | first call (compile + grid) | grid | configurations / s | vs 1 device |"
          " max rel. diff vs 1 device |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['devices']} | {r['configurations']:,} | {r['first_s']:.1f} s | {r['warm_s']:.2f} s | "
              f"{r['per_s']:,.0f} | {r['per_s'] / rows[0]['per_s']:.2f}× | {r['max_rel_diff_vs_first']:.1e} |")


if __name__ == "__main__":
    main()
