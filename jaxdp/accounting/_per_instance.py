r"""Per-instance (data-dependent) privacy accounting for DP-SGD with the sum rule.

Two analyses of the same per-step quantity, the per-instance Rényi DP of one Poisson-sampled
Gaussian step for a point whose clipped gradient norm over the clipping norm is ``r``:

* :func:`per_instance_dpsgd_privacy`: Thudi et al. 2024, Theorem 3.3 (Hölder composition
  for Markov chains) over a whole run, from the per-step ``r`` of one or more recorded
  training runs. Its expectations over training trajectories are estimated from the
  runs given, so the result is an **estimate**, not a certified bound.
* :func:`individual_filter_privacy` / :func:`individual_filter_step`: Feldman and Zrnic
  2021, individual privacy accounting with a Rényi filter. It is a certified guarantee
  under fully adaptive composition, on condition that training enforced the filter
  (in :mod:`._individual_filter`, on this module's per-step RDP).

Neither is differential privacy: both are bounds for one fixed point and one fixed data
set, and the values themselves depend on the data.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64, read_only, take
from ._conversion import rdp_to_epsilon
from ._per_instance_rdp import PerInstancePrivacy, _check_common, _pi_rdp

__all__ = [
    "PER_INSTANCE_ORDERS",
    "per_instance_composition_orders",
    "per_instance_dpsgd_privacy",
]

PER_INSTANCE_ORDERS: np.ndarray = np.array(
    [1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 64.0], dtype=np.float64
)
PER_INSTANCE_ORDERS.setflags(write=False)
"""A compact default grid of 17 Rényi orders for per-instance accounting (each order of a
composition is evaluated at up to five inflated orders at every checkpoint, so the grid is
kept smaller than ``DEFAULT_ORDERS``)."""

_ROUND_UP = 1.0 + 1e-13  # relative nudge so that float rounding never rounds an order down
_INT_ORDER_FROM = 8.0  # composition orders ≥ this are rounded up to integers (cheap, exact path)
_FRAC_STEP = 0.25  # below it, up to a multiple of 1/4
_ROUNDINGS = ("levels", "ceil")


# --------------------------------------------------------------------------------------
# Thudi et al. Theorem 3.3
# --------------------------------------------------------------------------------------


def _default_p(num_steps: int) -> float:
    return 3.0 * num_steps


def per_instance_composition_orders(orders, num_steps: int, p: float | None = None) -> np.ndarray:
    r"""The orders at which Theorem 3.3 of Thudi et al. evaluates each step.

    Step t (1-based, of n) sits :math:`i = n - t` steps from the end and is evaluated at
    :math:`β_i = g_p^{i}(α) = 1 + (p/(p-1))^{i}(α - 1)` with the map
    :math:`g_p(α) = \frac{p}{p-1}α - \frac{1}{p-1}` that the theorem's proof requires (the
    statement prints :math:`-1/p`, a typo). For p = 3n every order is below
    :math:`1 + e^{1/3}(α - 1)`.

    Args:
      orders: Rényi orders α > 1 (concrete), length k.
      num_steps: number of steps n ≥ 1.
      p: Hölder exponent in (1, ∞]; default 3n. p = ∞ gives β_i = α.

    Returns:
      NumPy float64 array ``(k, n)``; column t - 1 is the order of step t.

    References:
      Thudi et al. 2024 (arXiv:2307.00310), Theorem 3.3 and its proof (after Eq. 3).

    Examples:
      >>> import jaxdp
      >>> b = jaxdp.accounting.per_instance_composition_orders([8.0], 10, 30.0)
      >>> round(float(b[0, 0]), 8), float(b[0, -1])
      (10.49745734, 8.0)
    """
    orders_np = _validate.concrete_orders(orders)
    n = _check_num_steps(num_steps)
    p = _check_p(p, n)
    i = np.arange(n - 1, -1, -1, dtype=np.float64)
    rho = 1.0 if math.isinf(p) else p / (p - 1.0)
    return 1.0 + (orders_np[:, None] - 1.0) * rho ** i[None, :]


def _check_num_steps(num_steps) -> int:
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1; got {num_steps!r}.")
    return int(num_steps)


def _check_p(p, n: int) -> float:
    if p is None:
        return _default_p(n)
    if not isinstance(p, (int, float, np.floating, np.integer)) or not (p > 1):
        raise ValueError(f"p must be a number in (1, inf] (static); got {p!r}.")
    return float(p)


def _round_up_order(v: float) -> float:
    v = v * _ROUND_UP
    if v >= _INT_ORDER_FROM:
        return float(math.ceil(v))
    return math.ceil(v / _FRAC_STEP) * _FRAC_STEP


@dataclasses.dataclass(frozen=True)
class _Plan:
    grid: np.ndarray  # (G,) orders at which the per-step RDP is evaluated
    # Blocks of checkpoints that need the same orders: (checkpoint columns, orders). The
    # evaluated values are laid out block after block, checkpoint-major within a block.
    blocks: tuple[tuple[np.ndarray, np.ndarray], ...]
    starts: tuple[int, ...]  # group slice per order α (groups sorted by α)
    stops: tuple[int, ...]
    flat: np.ndarray  # (M,) index into the evaluated values, per group
    count: np.ndarray  # (M,) steps in the group
    lam: np.ndarray  # (M,) largest λ_i in the group (inf for p = ∞)
    first: np.ndarray  # (k,) flat index of step 1 for each α
    max_rounding: float  # largest ratio (evaluated order - 1)/(β_i - 1), for the report


@functools.cache
def _plan(orders_key, num_steps, ckpt_key, p, rounding, levels) -> _Plan:
    orders = np.asarray(orders_key, dtype=np.float64)
    n = num_steps
    ckpt = np.asarray(ckpt_key, dtype=np.int64)
    t = np.arange(1, n + 1)
    # Step t starts from the model after t - 1 steps; take the nearest checkpoint (ties: earlier).
    c_of_t = np.argmin(np.abs(ckpt[None, :] - (t - 1)[:, None]), axis=1)
    i = n - t
    finite = not math.isinf(p)
    rho = p / (p - 1.0) if finite else 1.0
    evals = np.empty((len(orders), n))
    band_of_step = None
    lams = np.empty((len(orders), n))
    for a, alpha in enumerate(orders):
        beta = 1.0 + (alpha - 1.0) * rho ** i.astype(np.float64)
        lams[a] = p * (beta - 1.0) if finite else np.inf
        if rounding == "ceil":
            ev = np.ceil(beta * _ROUND_UP)
        else:
            # Level j covers the steps with i ≤ (n - 1) j / J: e_j = β at that (fractional) i.
            js = np.arange(levels + 1)
            e = 1.0 + (alpha - 1.0) * rho ** ((n - 1) * js / levels) if n > 1 else np.full(levels + 1, alpha)
            e = np.array([alpha] + [_round_up_order(float(v)) for v in e[1:]])
            j = -(-levels * i // max(n - 1, 1))  # ceil(J i / (n - 1)) in integers
            ev = e[j]
            band_of_step = j if finite else None
        # The last step is at α itself, and so is every step for p = ∞ (no rounding needed).
        ev = np.full(n, alpha) if not finite else np.where(i == 0, alpha, ev)
        evals[a] = ev
    grid = np.unique(evals)
    g_of = np.searchsorted(grid, evals)
    n_grid = len(grid)
    # Only the (checkpoint, order) pairs some step uses are evaluated. With "levels", the
    # steps of level j need the k orders of that level only, at the checkpoints they use
    # (a checkpoint's steps fall in one or two levels), so each level is one block: a
    # J+1-fold saving for J+1 compiled copies of the per-step accountant. Otherwise one
    # block holds every checkpoint at every order.
    band = band_of_step if band_of_step is not None else np.zeros(n, dtype=np.int64)
    flat_all = np.full((len(orders), n), -1, dtype=np.int64)
    blocks, off = [], 0
    for b in np.unique(band):
        steps = np.nonzero(band == b)[0]
        cs = np.unique(c_of_t[steps])
        gs = np.unique(g_of[:, steps])
        lut = np.full((len(ckpt), n_grid), -1, dtype=np.int64)
        lut[cs[:, None], gs[None, :]] = off + np.arange(len(cs) * len(gs)).reshape(len(cs), len(gs))
        flat_all[:, steps] = lut[c_of_t[steps][None, :], g_of[:, steps]]
        off += len(cs) * len(gs)
        blocks.append((cs, grid[gs]))
    assert np.all(flat_all >= 0)
    ratio = np.max((evals - 1.0) / (1.0 + (orders[:, None] - 1.0) * rho ** i[None, :].astype(np.float64) - 1.0))
    starts, stops, flats, counts, lam_g = [], [], [], [], []
    for a in range(len(orders)):
        keys = flat_all[a, 1:]  # steps t ≥ 2; step 1 is deterministic (fixed initial model)
        lam_a = lams[a, 1:]
        uniq, inv = np.unique(keys, return_inverse=True)
        cnt = np.bincount(inv, minlength=len(uniq)).astype(np.float64)
        lmax = np.full(len(uniq), -np.inf)
        np.maximum.at(lmax, inv, lam_a)
        starts.append(sum(len(f) for f in flats))
        flats.append(uniq)
        counts.append(cnt)
        lam_g.append(lmax)
        stops.append(starts[-1] + len(uniq))
    return read_only(_Plan(  # cached: shared by later calls
        grid=grid,
        blocks=tuple(blocks),
        starts=tuple(starts),
        stops=tuple(stops),
        flat=np.concatenate(flats).astype(np.int64),
        count=np.concatenate(counts),
        lam=np.concatenate(lam_g),
        first=flat_all[:, 0].astype(np.int64),
        max_rounding=float(ratio),
    ))


def _grid_index(r, r_grid: int):
    """Index j of the smallest grid point j / r_grid ≥ r, and whether r is in [0, 1]."""
    valid = (r >= 0) & (r <= 1)
    rs = jnp.where(valid, r, 0.0)
    j = jnp.ceil(rs * r_grid)
    # j / r_grid is exact (a power of 2): one comparison makes sure the grid point is not
    # below r even if the product r * r_grid was rounded down.
    j = jnp.clip(jnp.where(j / r_grid < rs, j + 1, j), 0, r_grid).astype(jnp.int32)
    return j, valid


def _block_values(plan: _Plan, r, values_of):
    """Per-step RDP of every block for a chunk ``r`` (P, R, C), laid out as ``_compose_values`` needs."""
    parts = []
    for b, (cols, orders) in enumerate(plan.blocks):
        vals = values_of(b, orders, take(r, cols, axis=-1))  # (P, R, C_b, k_b)
        parts.append(vals.reshape(r.shape[:2] + (-1,)))
    return jnp.concatenate(parts, axis=-1)  # (P, R, Σ_b C_b G_b)


def _compose_values(plan: _Plan, e):
    """Theorem 3.3 from the per-step values ``e`` (P, R, Σ_b C_b G_b) of a chunk: RDP (P, k)."""
    n_runs = e.shape[1]
    out = []
    vals = take(e, plan.flat, axis=-1) if plan.flat.size else None  # (P, R, M)
    if vals is not None:
        lam = plan.lam
        if n_runs == 1:
            soft = vals[:, 0, :]
        elif np.all(np.isinf(lam)):
            soft = jnp.max(vals, axis=1)
        else:
            # (1/λ) log mean_runs exp(λ ε): the Hölder term of the theorem. λ up to ~1e5, so
            # it is a log-sum-exp in λε. It is nondecreasing in λ (a power mean), which is
            # why a group of steps may use its largest λ.
            lam_s = np.where(np.isinf(lam), 1.0, lam)
            lse = jax.scipy.special.logsumexp(vals * lam_s, axis=1)
            soft = (lse - math.log(n_runs)) / lam_s
            soft = jnp.where(np.isinf(lam), jnp.max(vals, axis=1), soft)
        contrib = soft * plan.count
    first = jnp.max(take(e, plan.first, axis=-1), axis=1)  # (P, k): the same model in every run
    for a, (s, t) in enumerate(zip(plan.starts, plan.stops)):
        tot = first[:, a]
        if t > s:
            tot = tot + jnp.sum(contrib[:, s:t], axis=-1)
        out.append(tot)
    return jnp.stack(out, axis=-1)


def _compose_chunk(plan: _Plan, q, noise_multiplier, r):
    """Theorem 3.3 for a chunk of points, every r evaluated exactly. ``r``: (P, R, C). Returns RDP (P, k)."""
    return _compose_values(plan, _block_values(plan, r, lambda b, orders, rb: _pi_rdp(orders, q, noise_multiplier, rb)))


def _compose_grid(plan: _Plan, r_grid: int, q, noise_multiplier, chunks):
    """Theorem 3.3 with every r rounded up to the grid: one table per block, then lookups.

    The tables (the per-step RDP at r = j / r_grid, j = 0..r_grid) are computed once for
    all chunks. Derivatives in q and σ come from a ``custom_jvp``: its rule tabulates the
    partials too and carries the tangent as partial × tangent through the composition, so
    no gather is ever differentiated (reverse mode would transpose one into a scatter onto
    zeros made outside the float64 scope, float32 with x64 off). Without differentiation
    only the value table is computed. r itself gets no derivative (the rounding is
    piecewise constant).
    """
    # A NumPy constant (a custom_jvp closes over no traced values); exact: r_grid is a power of 2.
    grid = np.arange(r_grid + 1, dtype=np.float64) / r_grid

    def table(orders, q_, s_):
        return _pi_rdp(orders, q_, s_, grid)  # (r_grid + 1, k_b)

    def values_of(tables):
        def lookup(b, orders, rb):
            j, valid = _grid_index(rb, r_grid)
            return jnp.where(valid[..., None], tables[b][j], jnp.nan)
        return lookup

    @jax.custom_jvp
    def run(q_, s_, chunks_):
        tables = [table(orders, q_, s_) for _, orders in plan.blocks]
        return jax.lax.map(lambda x: _compose_values(plan, _block_values(plan, x, values_of(tables))), chunks_)

    @run.defjvp
    def run_jvp(primals, tangents):
        q_, s_, chunks_ = primals
        q_dot, s_dot, _ = tangents
        tables, d_q, d_s = [], [], []
        for _, orders in plan.blocks:
            # One primal evaluation, two tangent directions (unit q, unit σ).
            value, partials = jax.vmap(
                lambda t, orders=orders: jax.jvp(lambda a, c: table(orders, a, c), (q_, s_), (t[0], t[1])),
                out_axes=(None, 0))(jnp.eye(2, dtype=jnp.float64))
            tables.append(value)
            d_q.append(partials[0])
            d_s.append(partials[1])

        def chunk(x):
            e = _block_values(plan, x, values_of(tables))
            e_dot = (q_dot * jnp.where(jnp.isfinite(e), _block_values(plan, x, values_of(d_q)), 0.0)
                     + s_dot * jnp.where(jnp.isfinite(e), _block_values(plan, x, values_of(d_s)), 0.0))
            return jax.jvp(lambda v: _compose_values(plan, v), (e,), (e_dot,))

        return jax.lax.map(chunk, chunks_)

    return run(q, noise_multiplier, chunks)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7, 8))
def _compose_jit(
    orders_key, num_steps, ckpt_key, p, rounding, levels, chunk_size, method, r_grid, q, noise_multiplier, r, delta
):
    plan = _plan(orders_key, num_steps, ckpt_key, p, rounding, levels)
    batch = r.shape[:-2]
    n_pts = math.prod(batch)
    rf = r.reshape((n_pts,) + r.shape[-2:])
    chunk = max(1, min(chunk_size, n_pts))
    n_pad = -(-n_pts // chunk) * chunk
    if n_pad > n_pts:  # pad by concatenation (see _rdp._sgm_rdp_jit for why not jnp.pad)
        rf = jnp.concatenate([rf, jnp.zeros((n_pad - n_pts,) + rf.shape[1:], rf.dtype)])
    chunks = rf.reshape((n_pad // chunk, chunk) + rf.shape[1:])
    if r_grid is None:
        rdp = jax.lax.map(lambda x: _compose_chunk(plan, q, noise_multiplier, x), chunks)
    else:
        rdp = _compose_grid(plan, r_grid, q, noise_multiplier, chunks)
    rdp = rdp.reshape(n_pad, -1)[:n_pts].reshape(batch + (len(orders_key),))
    eps = rdp_to_epsilon(rdp, np.asarray(orders_key), delta, method=method)
    return rdp, eps.epsilon, eps.order


@float64
def per_instance_dpsgd_privacy(
    orders,
    q,
    noise_multiplier,
    r,
    delta,
    *,
    num_steps: int | None = None,
    checkpoint_steps=None,
    runs: bool = False,
    p: float | None = None,
    order_rounding: str = "levels",
    order_levels: int = 4,
    chunk_size: int = 256,
    method: str = "improved",
    r_grid: int | None = None,
) -> PerInstancePrivacy:
    r"""Per-point RDP and ε of a DP-SGD run by Theorem 3.3 of Thudi et al. (an estimate).

    For a Markov chain of n steps, the Rényi divergence of the whole trajectory is bounded
    by (Theorem 3.3, rewritten with :math:`λ_i = p(β_i - 1)`)

    .. math::
        D_α \le \sum_{i=0}^{n-2} \frac{1}{λ_i}\log \mathbb{E}\big[e^{λ_i ε_{n-i}(β_i)}\big]
                + ε_1(β_{n-1}),\qquad β_i = 1 + \Big(\frac{p}{p-1}\Big)^{i}(α - 1),

    where :math:`ε_t(β)` is the per-instance RDP of step t at the model it starts from
    (:func:`per_instance_sampled_gaussian_rdp`) and the expectation is over training
    trajectories drawn on the first-argument data set. Here the expectation is replaced by
    the mean over the ``R`` recorded runs (``R = 1`` by default: the observed run), the
    first step (fixed initial model) takes the largest value over runs, and each order
    :math:`β_i` is rounded **up** (Rényi divergences are nondecreasing in the order):

    * ``order_rounding="levels"`` (default): to :math:`1 + (α-1)(p/(p-1))^{(n-1)j/J}`, the
      order of the first step of level j = ⌈J i/(n-1)⌉, J = ``order_levels``, then to the
      next multiple of 1/4 (or integer from 8 on). The last step keeps α.
    * ``order_rounding="ceil"``: to ⌈β_i⌉, as in the paper.

    Steps sharing a checkpoint and a rounded order are summed with their largest
    :math:`λ_i` (the Hölder term is nondecreasing in λ), which is exact for ``R = 1``.
    The result is converted per point with :func:`rdp_to_epsilon` over ``orders``.

    Args:
      orders: target Rényi orders α > 1 (static); ``None`` for :data:`PER_INSTANCE_ORDERS`.
      q: Poisson sampling rate in [0, 1] (scalar, the same for every step).
      noise_multiplier: noise std over the clipping norm, > 0 (scalar).
      r: clipped gradient norm over C, in [0, 1], shape ``points + (T,)``, or
        ``points + (R, T)`` with ``runs=True``. T is the number of steps, or of checkpoints
        when ``checkpoint_steps`` is given. ``points`` may be empty.
      delta: δ in (0, 1) for the conversion.
      num_steps: n, the number of steps of the run (static); default T.
      checkpoint_steps: concrete, strictly increasing integers in [0, n - 1]: ``r[..., c]``
        was measured at the model after ``checkpoint_steps[c]`` steps. Step t then uses
        the checkpoint nearest to t - 1 (ties: the earlier). Default: every step, 0..n-1.
      runs: whether axis -2 of ``r`` indexes independent training runs from the same
        initial model (Monte Carlo samples of the trajectory).
      p: Hölder exponent in (1, ∞] (static), default 3n (the paper's choice; then every
        order is below :math:`1 + 1.3957(α - 1)`). ``p = inf`` gives per-step worst case
        over the runs at order α.
      order_rounding: ``"levels"`` or ``"ceil"`` (static).
      order_levels: J ≥ 1 for ``"levels"`` (static).
      chunk_size: points evaluated at once (static): the values held per chunk are about
        ``chunk_size * R * T * 2k * 8`` bytes (each checkpoint needs the orders of the one
        or two levels its steps fall in), plus the sampled-Gaussian work arrays.
      method: RDP → DP conversion, ``"improved"`` (default) or ``"classic"``.
      r_grid: ``None`` (default: every r is evaluated exactly) or a power of two M ≥ 2
        (static): each r is first rounded **up** to the next multiple of 1/M, and the
        per-step RDP is read from a table of the M + 1 grid values at every evaluation
        order. The per-step RDP is nondecreasing in r (a larger σ/r is a post-processing
        of a smaller one), so the result is an upper bound of the exact estimate; the
        table costs M + 1 evaluations per order level, the lookup about 50× less than an
        exact evaluation, which pays from about M/10 points on (M = 2^14: ε larger by
        at most about 1e-3 relative on the benchmark's norms; docs/per_instance.md).
        Gradients flow through q and the noise multiplier (from tables of the partials,
        computed only when differentiating), not through r (the rounding is piecewise
        constant).

    Returns:
      :class:`PerInstancePrivacy` with ``epsilon``/``order`` of shape ``points``, ``rdp``
      of shape ``points + (k,)``, ``halt_step=None``, the analysis name and assumptions.
      Under ``jit``, invalid values give NaN.

    Assumptions (also in the result): add/remove neighbours, Poisson sampling, sum rule
    with per-example clipping at C and noise :math:`N(0, σ^2C^2)`; Markov training (the
    state includes optimiser buffers, the learning-rate schedule is fixed in advance) from a
    fixed initial model; ``r`` measured on runs over the first-argument data set of the
    divergence (the per-instance guarantee is the larger of both directions, each needing
    its own runs). **It is an estimate**: the plug-in mean over R runs is biased low
    (Jensen), and with checkpoints the steps between them are filled in by the nearest
    checkpoint, an unverified assumption. It is data-dependent and is not DP.

    References:
      A. Thudi, H. Jia, C. Meehan, I. Shumailov, N. Papernot, "Gradients Look Alike:
      Sensitivity is Often Overestimated in DP-SGD", USENIX Security 2024
      (arXiv:2307.00310), Theorems 3.2 and 3.3.

    Examples:
      >>> import jaxdp, numpy as np
      >>> r = np.full((2, 10), [[1.0], [0.2]])  # two points, ten steps
      >>> res = jaxdp.accounting.per_instance_dpsgd_privacy([2.0, 8.0], 0.01, 1.0, r, 1e-5, p=np.inf)
      >>> res.epsilon.shape, bool(res.epsilon[1] < res.epsilon[0])
      ((2,), True)
    """
    orders_np = _validate.concrete_orders(PER_INSTANCE_ORDERS if orders is None else orders)
    _check_common(q, noise_multiplier, r)
    _validate.check_delta(delta)
    _validate.check_static_choice("order_rounding", order_rounding, _ROUNDINGS)
    _validate.check_static_choice("method", method, ("improved", "classic"))
    if isinstance(order_levels, bool) or int(order_levels) != order_levels or order_levels < 1:
        raise ValueError(f"order_levels must be an integer >= 1; got {order_levels!r}.")
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1; got {chunk_size!r}.")
    if r_grid is not None and (
        isinstance(r_grid, bool) or int(r_grid) != r_grid or r_grid < 2 or int(r_grid) & (int(r_grid) - 1)
    ):
        raise ValueError(f"r_grid must be None or a power of two >= 2 (static); got {r_grid!r}.")
    r_grid = None if r_grid is None else int(r_grid)
    for name, v in (("q", q), ("noise_multiplier", noise_multiplier)):
        if np.ndim(v) != 0:
            raise ValueError(f"{name} must be a scalar (the same for every step); got shape {np.shape(v)}.")
    r = f64(r)
    if r.ndim < 1 or (runs and r.ndim < 2):
        raise ValueError(f"r must have a step axis{' and a runs axis' if runs else ''}; got shape {r.shape}.")
    if not runs:
        r = r[..., None, :]
    n_cols = r.shape[-1]
    n = _check_num_steps(n_cols if num_steps is None else num_steps)
    if checkpoint_steps is None:
        if n_cols != n:
            raise ValueError(f"r has {n_cols} steps but num_steps={n}; pass checkpoint_steps for checkpoints.")
        ckpt = np.arange(n)
    else:
        if not _validate.is_concrete(checkpoint_steps):
            raise TypeError("checkpoint_steps must be concrete (a list or NumPy array of step counts).")
        ckpt = np.asarray(checkpoint_steps)
        if (
            ckpt.ndim != 1
            or ckpt.size != n_cols
            or not np.all(ckpt == np.round(ckpt))
            or np.any(ckpt < 0)
            or np.any(ckpt > n - 1)
            or np.any(np.diff(ckpt) <= 0)
        ):
            raise ValueError(
                f"checkpoint_steps must be {n_cols} strictly increasing integers in [0, num_steps - 1] = "
                f"[0, {n - 1}] (one per column of r); got {ckpt!r}."
            )
        ckpt = ckpt.astype(np.int64)
    p_val = _check_p(p, n)
    n_runs = r.shape[-2]
    key = (tuple(orders_np.tolist()), n, tuple(ckpt.tolist()), p_val, order_rounding, int(order_levels))
    max_rounding = _plan(*key).max_rounding
    rdp, eps, order = _compose_jit(
        *key,
        int(chunk_size),
        method,
        r_grid,
        f64(q),
        f64(noise_multiplier),
        r,
        f64(delta),
    )
    every_step = checkpoint_steps is None
    assumptions = (
        "Thudi et al. 2024 Theorem 3.3 with the per-step bound of Theorem 3.2 (sum rule): add/remove neighbours, "
        "Poisson sampling at rate q, per-example clipping at C, noise N(0, (noise_multiplier*C)^2) on the sum.",
        "Markov training from a fixed initial model: each step depends only on the previous state (optimiser "
        "buffers included), with a learning-rate schedule fixed in advance.",
        "r was measured on training runs over the first-argument data set of the divergence; the per-instance "
        "guarantee is the larger of the two directions, each needing its own runs.",
        f"ESTIMATE: expectations over training trajectories are replaced by the mean over {n_runs} recorded "
        f"run(s) (plug-in, biased low); this is not a certified bound.",
        "r known at every step." if every_step else (
            f"ESTIMATE: r known only at {n_cols} checkpoints of {n} steps; every other step uses the nearest "
            "checkpoint (ties: the earlier), an unverified assumption."
        ),
        f"Hoelder exponent p = {p_val:g}; per-step orders rounded up ({order_rounding}"
        + (f", {order_levels} levels" if order_rounding == "levels" else "")
        + f"; (order - 1) inflated by at most {float(max_rounding):.4g}x over the theorem's).",
        *(() if r_grid is None else (
            f"Each r rounded up to the next multiple of 1/{r_grid} before evaluation (an upper bound: the per-step "
            "RDP is nondecreasing in r).",)),
        "Data-dependent: a bound for this point and this data set, not differential privacy; the values "
        "themselves depend on the data.",
    )
    return PerInstancePrivacy(eps, order, rdp, None, "thudi2024_theorem_3.3_estimate", assumptions)
