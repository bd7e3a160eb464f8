"""Per-point clipped norms for 60,000 MNIST-shaped records: time and peak memory.

``per_point_clipped_norms`` (jaxdp.training) on synthetic MNIST-shaped data (60,000 × 784
float32, 10 classes) with an MLP 784-256-10 at its initialisation, one checkpoint. Each
configuration runs in a fresh process, so that its peak resident set size (``ru_maxrss``)
is its own: the dense-layer fast path and the ``vmap(grad)`` path, at two chunk sizes.
The peer is a plain ``vmap(grad)`` over all 60,000 records at once (no chunks), the
memory that chunking avoids; it is only estimated (60,000 × 203,530 × 4 bytes = 45 GiB),
not run.

    python benchmarks/per_point_norms.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CONFIGS = [("fast", 1024), ("fast", 4096), ("vmap", 256), ("vmap", 1024)]


def one(path: str, chunk: int) -> dict:
    import resource
    import time

    import numpy as np
    from flax import nnx

    from jaxdp.models import MLP, softmax_cross_entropy_loss
    from jaxdp.training import per_point_clipped_norms

    rng = np.random.default_rng(0)
    x = rng.random((60_000, 784), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y = rng.integers(0, 10, 60_000)
    model = MLP((784, 256, 10), rngs=nnx.Rngs(0))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t = time.perf_counter()
    r = per_point_clipped_norms(softmax_cross_entropy_loss, model, (x, y), 1.0, chunk_size=chunk,
                                use_fast_path=(path == "fast"))
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"path": path, "chunk_size": chunk, "seconds": seconds, "rss_before_gib": base, "peak_rss_gib": peak,
            "median_r": float(np.median(r))}


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(one(sys.argv[1], int(sys.argv[2]))))
        return
    print("path  chunk  seconds (incl. compile)  RSS before  peak RSS (GiB)  median r")
    for path, chunk in CONFIGS:
        out = subprocess.run([sys.executable, __file__, path, str(chunk)], capture_output=True, text=True, check=True)
        d = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{d['path']:<5} {d['chunk_size']:>5}  {d['seconds']:>8.1f}  {d['rss_before_gib']:>10.2f}  "
              f"{d['peak_rss_gib']:>10.2f}  {d['median_r']:.4f}")


if __name__ == "__main__":
    main()
