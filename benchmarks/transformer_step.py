"""Benchmark: a DP-SGD step of a BERT-small-like encoder against the non-private step (time, memory).

The model (Flax NNX): token and position ``nnx.Embed``, ``--layers`` pre-norm blocks of
``nnx.LayerNorm`` → ``nnx.MultiHeadAttention`` (``--heads``) → ``nnx.LayerNorm`` → MLP
(``nnx.Linear`` width → 4·width → width, GELU), a final ``nnx.LayerNorm`` and a linear head
on the mean over the sequence; softmax cross-entropy, float32, synthetic token ids.
Every layer is on jaxdp's fast path (checked: the script refuses to run otherwise).

Contenders, all in this process, each one jitted step, timed after compilation (median
of ``--repeats`` blocks of ``--inner`` steps, wall clock):

* ``non-private``: gradient of the mean loss over the batch (a ``lax.scan`` over
  micro-batches summing gradients when the batch exceeds ``--micro``) and an SGD update;
* ``jaxdp DP-SGD``: :func:`jaxdp.training.dpsgd_step` on ``batch`` records with q = 1
  (every record sampled: the batch has exactly ``batch`` rows), micro-batches of
  ``--micro`` rows (``micro_batch_size``; none when batch = micro), the clipped sum on the
  fast path (ghost norms for the dense layers and attention projections, closed forms for the
  LayerNorms), Gaussian noise once, SGD;
* ``jaxdp vmap``: the same with ``use_fast_path=False`` (per-example gradients of the
  whole model, ``vmap(grad)``), at the first batch size only (``--no-vmap`` to skip);
* ``opacus ghost`` (only if torch and opacus are importable, in this interpreter or in
  ``--torch-python``, run as a child process): Opacus fast gradient clipping
  (``grad_sample_mode="ghost"``) on the equivalent ``torch.nn`` model (explicit attention
  of ``nn.Linear`` projections), the same batch; accumulation by Opacus' own
  ``BatchMemoryManager``-style loop of micro-batches (backward per micro-batch, one step).

Work (``--work``): XLA's flop count (``cost_analysis()``) of the first batch's gradient, of
``clipped_grad_sum`` and of its norms alone, which, unlike the times, does not move with the
machine's load (a whole step's count would include the overflow loop's body, which XLA counts
although it rarely runs).

Memory: XLA's planned peak of the compiled step (``memory_analysis()``: temporaries +
arguments + outputs), and, on a GPU, the device's ``peak_bytes_in_use`` after the
contender ran (cumulative over the run, so the order matters; the planned figure does not).

    python benchmarks/transformer_step.py              # CPU sizes (2 layers, width 128, seq 64)
    python benchmarks/transformer_step.py --full       # BERT-small sizes on CPU (slow)
    python benchmarks/transformer_step.py --gpu        # BERT-small sizes, batch 32 and 1024 (accumulated),
                                                       # at the default matmul precision and at float32
    python benchmarks/transformer_step.py --smoke      # seconds
    python benchmarks/transformer_step.py --compare-tree /tmp/main   # this tree against `git archive main`, alternated

Times are wall clock and CPU time of the process (all its threads; on a loaded machine the
CPU time moves less than the wall clock).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIZES = {  # layers, width, heads, seq, vocab, batches, micro
    "smoke": (1, 32, 2, 16, 512, (8, 32), 8),
    "cpu": (2, 128, 4, 64, 8192, (32, 256), 32),
    "full": (4, 256, 4, 128, 30522, (32, 256), 32),
    "gpu": (4, 256, 4, 128, 30522, (32, 1024), 32),
}


def build(layers, width, heads, seq, vocab):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(width, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class Encoder(nnx.Module):
        def __init__(self, rngs):
            self.tok = nnx.Embed(vocab, width, rngs=rngs)
            self.pos = nnx.Embed(seq, width, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.head = nnx.Linear(width, 2, rngs=rngs)

        def __call__(self, ids):
            h = self.tok(ids) + self.pos(jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape))
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h).mean(axis=1))

    return Encoder(nnx.Rngs(0))


def _time(fn, args, repeats, inner):
    """Median over ``repeats`` blocks of ``inner`` steps: (wall seconds, CPU seconds of this process) per step."""
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - t) / inner)
        cpus.append((time.process_time() - c) / inner)
    return statistics.median(walls), statistics.median(cpus)


def _planned_mb(compiled):
    """XLA's planned peak of a compiled function (temporaries + arguments + outputs), in MB."""
    m = compiled.memory_analysis()
    if m is None:
        return float("nan")
    return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) / 2**20


def _cost(jitted, args):
    """XLA's ``cost_analysis`` of the compiled function: (GFLOP, GB accessed); ``jitted`` may be compiled already."""
    compiled = jitted if hasattr(jitted, "cost_analysis") else jitted.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) and cost else cost) or {}
    return cost.get("flops", float("nan")) / 1e9, cost.get("bytes accessed", float("nan")) / 1e9


_NOT_KERNELS = ("parameter(", "tuple(", "get-tuple-element(", "bitcast(", "constant(", "copy-start(", "copy-done(")


def _kernels(jitted, args):
    """Instructions of the compiled function's entry computation that launch work (fusions, dots, calls).

    On a GPU each is about one kernel launch, whose fixed cost (microseconds) dominates a
    small step; counted on the platform at hand (XLA on CPU fuses differently from GPU, so
    this is an indication of the extra launches, not their number on the GPU).
    """
    text = (jitted if hasattr(jitted, "as_text") else jitted.lower(*args).compile()).as_text()
    entry = text[text.index("ENTRY "):]
    entry = entry[:entry.index("\n}")]
    return sum(1 for line in entry.splitlines()[1:] if "=" in line and not any(k in line for k in _NOT_KERNELS))


def _gflop(jitted, args):
    """XLA's flop count of the compiled function (``cost_analysis``), in GFLOP."""
    return _cost(jitted, args)[0]


def work_split(model, x, y):
    """XLA's flops of the batch's gradient, of ``clipped_grad_sum``, of its norms alone; the noise draw's cost.

    Unlike times, flop counts do not move with the load. The norms-only figure is the
    clipped sum with each layer's sum replaced by zeros (the δ's, norms and factors are
    still formed): the clipped sum's extra work over the gradient is then the norms' part.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdp.models import softmax_cross_entropy_loss as loss
    from jaxdp.training import _ghost, clipped_grad_sum

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grad(p):
        return jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), x, y).sum())(p)

    def clipped(p):
        out = clipped_grad_sum(lambda m, a, b: loss(m, a, b), nnx.merge(graphdef, p, rest), (x, y), 1.0)
        return out.grad_sum, out.norms

    grad_c, clipped_c = jax.jit(grad).lower(params).compile(), jax.jit(clipped).lower(params).compile()
    (g, gb), (c, cb) = _cost(grad_c, (params,)), _cost(clipped_c, (params,))
    saved = _ghost._layer_grad_sum, _ghost._closed_grad_sum
    def zeros(rec, *_):
        return {k: jnp.zeros_like(v) for k, v in rec["recorder"].params.items()}

    _ghost._layer_grad_sum, _ghost._closed_grad_sum = zeros, zeros
    try:
        n, nb = _cost(jax.jit(lambda p: clipped(p)), (params,))
    finally:
        _ghost._layer_grad_sum, _ghost._closed_grad_sum = saved
    print(f"  work at batch {x.shape[0]} (XLA flops): gradient {g:.3f} GFLOP; clipped_grad_sum {c:.3f} GFLOP "
          f"({c / g:.2f}x, {c - g:.3f} more); its norms without the sums {n:.3f} GFLOP (the sums: "
          f"{c - n:.3f})", flush=True)
    gk, ck = _kernels(grad_c, (params,)), _kernels(clipped_c, (params,))
    print(f"  top-level operations of the compiled function (about one kernel launch each): gradient {gk}, "
          f"clipped_grad_sum {ck} ({ck / gk:.2f}x)", flush=True)
    print(f"  memory traffic (XLA bytes accessed): gradient {gb:.3f} GB; clipped_grad_sum {cb:.3f} GB "
          f"({cb / gb:.2f}x, {cb - gb:.3f} more); its norms without the sums {nb:.3f} GB (the sums: {cb - nb:.3f})",
          flush=True)
    # The noise: one normal draw per trainable parameter and step, whatever the batch.
    size = sum(v.size for v in jax.tree.leaves(params))
    draw = jax.jit(lambda k: jax.random.normal(k, (size,), jnp.float32))
    t, c = _time(draw, (jax.random.key(0),), 5, 2)
    print(f"  the noise of a step ({size / 1e6:.2f} M float32 normals): {_gflop(draw, (jax.random.key(0),)):.3f} "
          f"GFLOP, {1e3 * t:.1f} ms wall, {1e3 * c:.1f} ms CPU", flush=True)


def memory_split(model, x, y, timing=None):
    """XLA's planned memory of the DP-SGD step built up part by part, against the non-private step (MB).

    With ``timing=(repeats, inner)`` the same compiled parts are timed instead (wall ms per
    step): where a GPU spends the DP step's extra time.

    Each figure is one compiled function (planned temporaries + arguments + outputs): the
    non-private step; ``clipped_grad_sum`` and SGD with the per-example norms replaced by
    constants (what keeping the output gradients for the clipped sum costs); with the norms
    (their temporaries); with the noise of :func:`jaxdp.training.dpsgd`; the whole
    :func:`jaxdp.training.dpsgd_step` (its sampling and the overflow ``while_loop``; it ties the
    noise's keys to the clipped sum, so the threefry bits are drawn after the sum instead of
    being held through its peak, which the line with the noise alone still shows).
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxdp.models import softmax_cross_entropy_loss as loss
    from jaxdp.training import _ghost, clipped_grad_sum, dpsgd, dpsgd_step

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    b = x.shape[0]
    tx = dpsgd(optax.sgd(0.1), 1.0, 1.0, float(b), jax.random.key(1))
    opt = tx.init(params)

    def nonprivate(p):
        g = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), x, y).sum())(p)
        return jax.tree.map(lambda p, g: p - 0.1 * g / b, p, g)

    def clipped_sgd(p, loss_fn=loss):
        out = clipped_grad_sum(loss_fn, nnx.merge(graphdef, p, rest), (x, y), 1.0, mask=jnp.ones(b, bool))
        return jax.tree.map(lambda p, g: p - 0.1 * g / b, p, out.grad_sum)

    def clipped_noise(p, s):
        out = clipped_grad_sum(loss, nnx.merge(graphdef, p, rest), (x, y), 1.0, mask=jnp.ones(b, bool))
        u, s = tx.update(out.grad_sum, s, p)
        return optax.apply_updates(p, u), s

    def step(p, s, k):
        return dpsgd_step(loss, graphdef, rest, tx, p, s, k, x, y, 1.0, 1.0, b)[:2]

    def planned(f, *args):  # a fresh function object each time: no tracing cache shared between variants
        compiled = jax.jit(lambda *a: f(*a)).lower(*args).compile()
        return _planned_mb(compiled) if timing is None else 1e3 * _time(compiled, args, *timing)[0]

    base = planned(nonprivate, params)
    full = planned(clipped_sgd, params), planned(clipped_noise, params, opt), planned(step, params, opt,
                                                                                      jax.random.key(2))
    # Last, with a loss function of its own: clipped_grad_sum reuses a trace for the same loss
    # function and shapes, and the replaced norms must neither reuse nor be reused.
    saved = _ghost._layer_sq_norm, _ghost._closed_sq_norm
    _ghost._layer_sq_norm = lambda rec, d: (jnp.ones(d.shape[0], jnp.float32), saved[0](rec, d)[1])
    _ghost._closed_sq_norm = lambda rec, d, xhat=None: (jnp.ones(d.shape[0], jnp.float32), saved[1](rec, d, xhat)[1])
    try:
        no_norms = planned(lambda p: clipped_sgd(p, lambda m, a, c: loss(m, a, c)), params)
    finally:
        _ghost._layer_sq_norm, _ghost._closed_sq_norm = saved
    parts = [("non-private step", base), ("clipped sum + SGD, norms replaced by constants", no_norms),
             ("clipped sum + SGD", full[0]), ("clipped sum + noise + SGD", full[1]),
             ("dpsgd_step (sampling, overflow loop)", full[2])]
    what, unit = ("planned memory", "MB") if timing is None else ("wall time per step", "ms")
    print(f"  {what} at batch {b}, built up ({unit}; each line adds a part of the DP-SGD step):", flush=True)
    last = base
    for name, mb in parts:
        print(f"    {name:<48s} {mb:8.2f} {unit} ({mb / base:.2f}x; {mb - last:+.2f})", flush=True)
        last = mb


def _device_peak_mb():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 2**20


def bench_jax(size, batches, micro, repeats, inner, vmap):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxdp.models import softmax_cross_entropy_loss as loss
    from jaxdp.training import dpsgd, dpsgd_step, fast_path_supported

    layers, width, heads, seq, vocab = size
    model = build(layers, width, heads, seq, vocab)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, vocab, (max(batches), seq)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, 2, max(batches)), jnp.int32)
    if not fast_path_supported(loss, model, (ids[:2], labels[:2])):
        raise SystemExit("the encoder is not on the fast path: the benchmark would not measure it")
    rows = []
    for b in batches:
        x, y = ids[:b], labels[:b]
        m = min(micro, b)
        k = b // m

        def nonprivate(p, x=x, y=y, m=m, k=k):
            def grad(xb, yb):
                return jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), xb, yb).sum())(p)

            if k == 1:
                g = grad(x, y)
            else:
                xs, ys = x.reshape(k, m, *x.shape[1:]), y.reshape(k, m)
                zero = jax.tree.map(jnp.zeros_like, p)
                g = jax.lax.scan(lambda acc, xy: (jax.tree.map(jnp.add, acc, grad(*xy)), None), zero, (xs, ys))[0]
            return jax.tree.map(lambda p, g: p - 0.1 * g / b, p, g)

        tx = dpsgd(optax.sgd(0.1), 1.0, 1.0, float(b), jax.random.key(1))
        opt = tx.init(params)

        def private(p, s, key, x=x, y=y, m=m, b=b, fast=None):
            return dpsgd_step(loss, graphdef, rest, tx, p, s, key, x, y, 1.0, 1.0, b, use_fast_path=fast,
                              micro_batch_size=None if m == b else m)[:2]

        contenders = [("non-private", jax.jit(nonprivate), (params,)),
                      ("jaxdp DP-SGD", jax.jit(private), (params, opt, jax.random.key(2)))]
        if vmap and b == batches[0]:
            contenders.append(("jaxdp vmap", jax.jit(lambda p, s, k: private(p, s, k, fast=False)),
                               (params, opt, jax.random.key(2))))
        for label, fn, args in contenders:
            compiled = fn.lower(*args).compile()  # once: measured and timed (a GPU compile takes seconds)
            planned = _planned_mb(compiled)
            t, c = _time(compiled, args, repeats, inner)
            rows.append({"batch": b, "micro": m, "contender": label, "ms": 1e3 * t, "cpu_ms": 1e3 * c,
                         "planned_mb": planned, "device_peak_mb": _device_peak_mb()})
            print(f"  {label:14s} batch {b:5d} (micro {m:3d}): {1e3 * t:9.1f} ms (CPU {1e3 * c:9.1f} ms), "
                  f"planned {planned:8.1f} MB", flush=True)
    return rows, n_params


TORCH_SCRIPT = r'''
import json, sys, time, statistics, warnings
import numpy as np, torch
from torch import nn
from opacus import PrivacyEngine
layers, width, heads, seq, vocab, batches, micro, repeats, inner = json.loads(sys.argv[1])
torch.manual_seed(0)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # torch's default: full float32 matmuls
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

class Attention(nn.Module):
    def __init__(s):
        super().__init__()
        s.q, s.k, s.v, s.o = (nn.Linear(width, width) for _ in range(4))
    def forward(s, x):
        b, t, _ = x.shape
        sp = lambda z: z.view(b, t, heads, width // heads).transpose(1, 2)
        a = torch.softmax(sp(s.q(x)) @ sp(s.k(x)).transpose(-1, -2) / (width // heads) ** 0.5, -1)
        return s.o((a @ sp(s.v(x))).transpose(1, 2).reshape(b, t, width))

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.attn, s.ln2 = nn.LayerNorm(width), Attention(), nn.LayerNorm(width)
        s.up, s.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    def forward(s, x):
        x = x + s.attn(s.ln1(x))
        return x + s.down(nn.functional.gelu(s.up(s.ln2(x))))

class Encoder(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok, s.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        s.blocks = nn.Sequential(*[Block() for _ in range(layers)])
        s.norm, s.head = nn.LayerNorm(width), nn.Linear(width, 2)
    def forward(s, ids):
        h = s.tok(ids) + s.pos(torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous())
        return s.head(s.norm(s.blocks(h)).mean(1))

rng = np.random.default_rng(0)
ids = torch.from_numpy(rng.integers(0, vocab, (max(batches), seq))).to(dev)
y = torch.from_numpy(rng.integers(0, 2, max(batches))).to(dev)
rows = []
for b in batches:
    m = min(micro, b)
    model = Encoder().to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:m], y[:m]), batch_size=m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm, popt, crit, _ = PrivacyEngine().make_private(module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(),
            data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
    def step():
        popt.zero_grad()
        for i in range(0, b, m):
            crit(pm(ids[i:i + m]), y[i:i + m]).backward()
            if i + m < b:
                popt.signal_skip_step(do_skip=True)
                popt.step()
        popt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
        sync()
        ts, cs = [], []
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            for _ in range(inner):
                step()
            sync()
            ts.append((time.perf_counter() - t) / inner)
            cs.append((time.process_time() - c) / inner)
    rows.append({"batch": b, "micro": m, "contender": "opacus ghost", "ms": 1e3 * statistics.median(ts),
                 "cpu_ms": 1e3 * statistics.median(cs), "planned_mb": float("nan"),
                 "device_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else float("nan")})
print(json.dumps(rows))
'''


def bench_opacus(size, batches, micro, repeats, inner, python):
    cmd = [python, "-c", TORCH_SCRIPT, json.dumps([*size, list(batches), micro, repeats, inner])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"  opacus: not run ({type(err).__name__})")
        return []
    if proc.returncode != 0:
        print(f"  opacus: not run ({(proc.stderr.strip().splitlines() or ['?'])[-1][:200]})")
        return []
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_trees(which, other, rounds, repeats, inner, precision=None):
    """This tree's jaxdp and ``other``'s (e.g. ``git archive main``), each in a child process, alternated.

    Each round runs one child per tree (this script with ``--child-json``: non-private and
    DP-SGD at every batch size, compiled and timed in that child), so that a change of the
    machine's load hits both trees; the ratios are formed within each child (its own
    non-private step), then the median over rounds.
    """
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    trees = {"this tree": os.path.abspath(here), "other tree": os.path.abspath(other)}
    got = {name: [] for name in trees}
    for r in range(rounds):
        for name, tree in trees.items():
            cmd = [sys.executable, os.path.abspath(__file__), f"--{which}" if which != "cpu" else "--cpu-size",
                   "--child-json", tree, "--repeats", str(repeats), "--inner", str(inner), "--no-vmap"]
            cmd += ["--matmul-precision", precision] if precision else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{name} ({tree}) failed: {proc.stderr.strip()[-2000:]}")
            rows = json.loads(proc.stdout.strip().splitlines()[-1])
            got[name].append(rows)
            print(f"  round {r + 1}, {name}: " + "; ".join(
                f"batch {x['batch']} {x['contender']} {x['ms']:.0f} ms (CPU {x['cpu_ms']:.0f})" for x in rows),
                  flush=True)
    print(f"\nmedian over {rounds} rounds of the DP-SGD step / non-private step in the same child "
          "(wall, CPU time), and the DP-SGD step's own medians:")
    for name, runs in got.items():
        for b in sorted({x["batch"] for x in runs[0]}):
            ratio, ratio_cpu, ms, cpu, mem = [], [], [], [], []
            for rows in runs:
                base = next(x for x in rows if x["batch"] == b and x["contender"] == "non-private")
                dp = next(x for x in rows if x["batch"] == b and x["contender"] == "jaxdp DP-SGD")
                ratio.append(dp["ms"] / base["ms"])
                ratio_cpu.append(dp["cpu_ms"] / base["cpu_ms"])
                ms.append(dp["ms"])
                cpu.append(dp["cpu_ms"])
                mem.append(dp["planned_mb"] / base["planned_mb"])
            print(f"  {name:10s} batch {b:5d}: {statistics.median(ratio):.2f}x wall, "
                  f"{statistics.median(ratio_cpu):.2f}x CPU; DP step {statistics.median(ms):.0f} ms wall, "
                  f"{statistics.median(cpu):.0f} ms CPU; "
                  f"planned memory {statistics.median(mem):.2f}x  (per round: "
                  f"{' '.join(f'{v:.2f}' for v in ratio)})")
    return got


def _torch_python(given):
    if given:
        return given
    probe = subprocess.run([sys.executable, "-c", "import torch, opacus"], capture_output=True, check=False)
    return sys.executable if probe.returncode == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    for name in ("smoke", "full", "gpu"):
        group.add_argument(f"--{name}", action="store_true", help=f"the {name} size set")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--inner", type=int, default=2)
    ap.add_argument("--no-vmap", action="store_true", help="skip the vmap(grad) contender")
    ap.add_argument("--torch-python", default=None, help="a Python with torch and opacus (default: this one, if it has them)")
    ap.add_argument("--no-opacus", action="store_true", help="skip Opacus")
    ap.add_argument("--work", action="store_true", help="also print XLA's flops of the gradient, the clipped sum "
                                                          "and its norms at the first batch size")
    ap.add_argument("--time-split", action="store_true", help="also time the same parts as --memory-split "
                    "(wall ms per step at the first batch size)")
    ap.add_argument("--memory-split", action="store_true", help="also print XLA's planned memory of the DP-SGD "
                                                                  "step built up part by part at the first batch size")
    ap.add_argument("--compare-tree", default=None, metavar="DIR",
                    help="also time DIR's jaxdp (e.g. `git archive main`) against this tree's, alternated in child "
                         "processes for --rounds rounds (DP-SGD and non-private only)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --compare-tree")
    ap.add_argument("--matmul-precision", default=None, choices=("float32", "tensorfloat32", "bfloat16"),
                    help="jax_default_matmul_precision for every contender (default: the platform's; on recent "
                         "GPUs float32 matmuls then run in TF32, while jaxdp's norms and clipped sums ask for "
                         "HIGHEST); float32 compares both at full float32")
    ap.add_argument("--precisions", default=None, metavar="LIST",
                    help="comma-separated matmul precisions to run the jaxdp contenders under, one after the other "
                         "in this process ('default' the platform's or --matmul-precision's; e.g. "
                         "'default,float32'); default: 'default,float32' with --gpu, else 'default'")
    ap.add_argument("--cpu-size", action="store_true", help=argparse.SUPPRESS)  # the default size set, explicitly
    # Time TREE's jaxdp and print the rows as JSON (a child of --compare-tree).
    ap.add_argument("--child-json", default=None, metavar="TREE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    which = next((n for n in ("smoke", "full", "gpu") if getattr(args, n)), "cpu")
    if args.matmul_precision:
        import jax

        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    if args.child_json:
        sys.path.insert(0, os.path.abspath(args.child_json))
        import jaxdp

        assert os.path.abspath(jaxdp.__file__).startswith(os.path.abspath(args.child_json)), jaxdp.__file__
        layers, width, heads, seq, vocab, batches, micro = SIZES[which]
        repeats, inner = (2, 1) if args.smoke else (args.repeats, args.inner)
        with contextlib.redirect_stdout(sys.stderr):
            rows, _ = bench_jax((layers, width, heads, seq, vocab), batches, micro, repeats, inner, False)
        print(json.dumps(rows))
        return 0
    layers, width, heads, seq, vocab, batches, micro = SIZES[which]
    repeats, inner = (2, 1) if args.smoke else (args.repeats, args.inner)

    import jax

    from benchmarks.dpsgd_step import _cpu_model

    dev = jax.devices()[0]
    print(f"size set '{which}': {layers} layers, width {width}, {heads} heads, sequence {seq}, vocabulary {vocab}; "
          f"batches {batches} in micro-batches of {micro}")
    print(f"machine: {_cpu_model()}, {os.cpu_count()} CPU cores, device {dev.device_kind} ({jax.default_backend()}), "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; jax {jax.__version__}; default matmul "
          f"precision {jax.config.jax_default_matmul_precision or 'the platform default'}", flush=True)
    size = (layers, width, heads, seq, vocab)
    if args.compare_tree:
        compare_trees(which, args.compare_tree, args.rounds, repeats, inner, args.matmul_precision)
        print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n", flush=True)
    if args.work:
        import jax.numpy as jnp

        rng = np.random.default_rng(0)
        work_split(build(*size), jnp.asarray(rng.integers(0, vocab, (batches[0], seq)), jnp.int32),
                   jnp.asarray(rng.integers(0, 2, batches[0]), jnp.int32))
    for on, timing in ((args.memory_split, None), (args.time_split, (repeats, max(inner, 5)))):
        if on:
            import jax.numpy as jnp

            rng = np.random.default_rng(0)
            memory_split(build(*size), jnp.asarray(rng.integers(0, vocab, (batches[0], seq)), jnp.int32),
                         jnp.asarray(rng.integers(0, 2, batches[0]), jnp.int32), timing)
    precisions = (args.precisions or ("default,float32" if which == "gpu" else "default")).split(",")
    rows = []
    for i, precision in enumerate(precisions):
        if precision != "default":
            print(f"  matmul precision {precision}:", flush=True)
        ctx = contextlib.nullcontext() if precision == "default" else jax.default_matmul_precision(precision)
        with ctx:  # vmap(grad) under the first precision only (it is not what the GPU question is about)
            got, n_params = bench_jax(size, batches, micro, repeats, inner, not args.no_vmap and i == 0)
        rows += [{**r, "precision": precision} for r in got]
    python = None if args.no_opacus else _torch_python(args.torch_python)
    if args.no_opacus:
        print("  opacus: skipped (--no-opacus)")
    elif python is not None:  # on a GPU, torch's own (CUDA) device; torch's default: full float32 matmuls
        rows += [{**r, "precision": "torch"} for r in bench_opacus(size, batches, micro, repeats, inner, python)]
    elif python is None:
        print("  opacus: torch/opacus not importable: skipped")
    base = {(r["batch"], r["precision"]): r for r in rows if r["contender"] == "non-private"}
    print(f"\n{n_params / 1e6:.2f} M parameters. Ratios against the non-private step of the same batch and micro-batch "
          f"(and matmul precision; Opacus against jax's non-private step at '{precisions[0]}').")
    print(f"{'batch':>6} {'micro':>6} {'precision':<9} {'contender':<14} {'ms/step':>9} {'x time':>7} {'CPU ms':>9} "
          f"{'x CPU':>6} {'planned MB':>11} {'x mem':>6} {'device peak MB':>15}")
    for r in rows:
        nb = base.get((r["batch"], r["precision"]), base[(r["batch"], precisions[0])])
        print(f"{r['batch']:>6} {r['micro']:>6} {r['precision']:<9} {r['contender']:<14} {r['ms']:>9.1f} "
              f"{r['ms'] / nb['ms']:>7.2f} "
              f"{r['cpu_ms']:>9.1f} {r['cpu_ms'] / nb['cpu_ms']:>6.2f} "
              f"{r['planned_mb']:>11.1f} {r['planned_mb'] / nb['planned_mb']:>6.2f} {r['device_peak_mb']:>15.1f}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
