r"""Privacy loss distributions (PLD): tight (ε, δ) of composed mechanisms, under ``jit``.

The privacy loss of a dominating pair (P, Q) is :math:`L = \log(P(x)/Q(x))`, x ~ P; after
adaptive composition the losses add, and the hockey-stick divergence is
:math:`δ(ε) = E[(1 - e^{ε - L})_+]` (+ the mass of L = +∞). The PLD accountant discretises
each mechanism's L on a uniform grid, composes by FFT in the exponentially tilted domain and
reads δ(ε) and ε(δ) off the result. Every step runs under ``jax.jit`` and ``jax.vmap`` with
a **static** grid size; all values (noise multipliers, rates, counts, δ, ε) are traced.

Modules: ``_pld_curves`` (the mechanisms' hockey-stick curves and their discretisation),
``_pld_compose`` (plan, tilted FFT composition, read-outs), this one (the event layer, the
public functions, the RDP fallback).

Upper bound (``estimate="upper"``, the default; a proof sketch, see docs/pld.md):

1. *Connect-the-dots discretisation* (Doroshenko et al. 2022, Algorithm 1): grid masses
   whose hockey-stick curve interpolates the exact δ(ε_i) linearly in :math:`e^ε`; δ is
   convex in :math:`e^ε`, so the discrete pair dominates the true pair (their Theorem 4.2),
   also after any composition. Mass above a mechanism's grid goes to +∞ (into δ).
2. *Plan.* A coarse pass (1,024 bins per mechanism) gives the discrete log moment
   generating function Λ(θ); the Chernoff point, a saddle-point correction and the tilted
   spread place the window around the answer, its top at the Chernoff point at
   :math:`δ·10^{-4}`; its width and the tilt minimise the estimated sum of the error terms
   (the two circular folds, the round-off bound, the discretisation). The plan only makes
   the result tight, never valid.
3. *Tilted FFT composition.* Masses are tilted, :math:`p_i e^{λℓ_i - a}`, composed by FFT
   (powers and products of ``rfft``), untilted: :math:`r_ℓ = \tilde r_ℓ e^{Λ - λℓ}`. Mass
   folded in by the circular convolution is extra mass (δ only grows); the mass above the
   window is added to δ in full (Chernoff, from the discrete moment generating functions).
4. *Floating point.* The normwise FFT round-off bound (Higham 2002, §24.1) is added to every
   *tilted* bin before untilting, so each mass's error is relative to the hockey stick near
   the answer, whatever δ (a rounding model, not an interval-arithmetic proof).
5. Two directions for add/remove-one Poisson sampling, each planned and composed on its
   own; δ and ε are the larger (dp_accounting does the same). Both directions run through
   one traced body (``lax.scan`` over the direction's sign), so XLA compiles the plan and the
   upper bound's composition and read-out once, not twice (about half the program; the same
   arithmetic, XLA's fusion in the loop body moves some values in the last bits: docs/pld.md).

So ``delta(..., accountant="pld")`` is an upper bound on the true δ(ε) and
``epsilon(..., accountant="pld")`` (the exact root of δ(ε) = target on the discrete curve)
an upper bound on the true ε(δ). Where the grid cannot certify δ (the mass it places at
+∞ exceeds it) the RDP accountant's ε is returned instead (``fallback="rdp"``, the
default; eagerly with a ``UserWarning`` naming it); :func:`pld_epsilon_source` says which.

Lower bound (``estimate="lower"``): a dominated discrete pair, composed in the same tilted
domain; what the circular convolution folds in is subtracted (Chernoff bounds), and the
round-off bound too. For Gaussian and Poisson-sampled Gaussian mechanisms each bucket
(ε_i - h/2 + s, ε_i + h/2 + s] is merged (a post-processing; its loss log(P(B)/Q(B)) lies in
the bucket) and placed at ε_i where that loss is certified ≥ ε_i, else at ε_{i-1}: the loss
drops by about s ∈ {h/64, h/16} (chosen per mechanism) instead of h/2; for the other
kinds privacy buckets rounded down (Meiser & Mohammadi 2018).

Defaults: ``grid_size`` :data:`PLD_GRID_SIZE` = 3·2^13 = 24576 bins, ``tail_bound``
:data:`PLD_TAIL_BOUND` = 1e-6 (the plan leaves min(tail_bound, 1e-4·δ) outside the grid),
``stages`` :data:`PLD_STAGES` = 1 (``stages=2``: the two-stage composition of
``_pld_stages.py``, certified the same way, often tighter on long compositions, at about twice
the time).

Differentiable (``jax.grad``) in the noise multipliers and q (the plan is held fixed);
counts are integers (no gradient). At the kinks where the read-out moves to another bin the
derivative is one-sided. Second derivatives (``jax.hessian``, grad of grad, ``jacfwd`` of
``jacfwd``) raise :class:`PLDSecondDerivativeError`: the plan (window, spacing, tilt) moves
with σ, so the derivative of the fixed-plan gradient is not the curvature of ε (σ = 1.1,
q = 256/60000, T = 14040, δ = 1e-5: -91.3 against a difference quotient of the gradient of
6.27).

References:
  V. Doroshenko, B. Ghazi, P. Kamath, R. Kumar, P. Manurangsi, "Connect the Dots: Tighter
  Discrete Approximations of Privacy Loss Distributions", PoPETs 2022, Algorithm 1 and
  Theorem 4.2.
  S. Meiser, E. Mohammadi, "Tight on Budget? Tight Bounds for r-Fold Approximate
  Differential Privacy", CCS 2018 (privacy buckets).
  A. Koskela, J. Jälkö, A. Honkela, "Computing Tight Differential Privacy Guarantees Using
  FFT", AISTATS 2020 (FFT composition).
  I. Mironov, K. Talwar, L. Zhang, "Rényi Differential Privacy of the Sampled Gaussian
  Mechanism", arXiv:1908.10530 (the two directions).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._program_cache import persistent
from ._events import ApproxDP, Composed, Gaussian, Laplace, PoissonSampled, SelfComposed, check_event
from ._pld_compose import compose, delta_read, epsilon_read

# The public door is ``epsilon(event, delta, accountant="pld")`` / ``delta(...)`` (registered
# in _accountants.py); pld_epsilon and pld_delta stay for one release as deprecated names.
__all__ = [
    "PLD_GRID_SIZE",
    "PLD_TAIL_BOUND",
    "PLD_STAGES",
    "PLDBracket",
]

PLD_GRID_SIZE = 3 * 2**13
PLD_TAIL_BOUND = 1e-6
PLD_STAGES = 1
_STAGES = (1, 2)
_ESTIMATES = ("upper", "lower")
_FALLBACKS = ("rdp", "none")

class PLDBracket(NamedTuple):
    """ε from the optimistic and the pessimistic PLD: the true ε lies in [lower, upper]."""

    lower: jax.Array
    upper: jax.Array
    width: jax.Array


# =======================================================================================
# The event tree as a list of mechanisms with counts.
# =======================================================================================


def _f64(x):
    """A leaf as float64: a NumPy array where its value is known, else a traced ``f64``.

    The event's arithmetic below (counts rounded up, products of counts, σ/√k) then runs
    on the host when called eagerly: with ``jnp`` each operation compiles a small XLA
    program of its own, about 0.05 s apiece in a fresh process (NumPy's float64 ceil,
    product, quotient and square root are the same correctly rounded operations).
    """
    return np.asarray(x, dtype=np.float64) if _validate.is_concrete(x) else f64(x)


def _xp(*xs):
    """NumPy if every array is a host array, else ``jax.numpy``."""
    return np if all(isinstance(x, (np.ndarray, np.generic)) for x in xs) else jnp


def _ceil_count(c):
    """A count rounded up to an integer; NaN where it is negative."""
    xp = _xp(c)
    return xp.where(c >= 0, xp.ceil(xp.where(c >= 0, c, 0.0)), xp.nan)


def _components(event, count=None):
    """``[(kind, params, count)]`` of an event tree; kind static, params and counts leaves.

    Kinds (their curves in ``_pld_curves.curve``): ``gaussian`` (σ), ``laplace`` (b),
    ``approx_dp`` (ε, δ), and Poisson sampling (add/remove-one) of each:
    ``sampled_gaussian`` (q, σ), ``sampled_laplace`` (q, b), ``sampled_approx_dp`` (q, ε, δ).
    A sampled k-fold Gaussian is the sampled Gaussian of σ/√k (the k-fold Gaussian pair is
    the Gaussian pair of μ√k, exactly).
    """
    one = _f64(1.0) if count is None else count
    if isinstance(event, Gaussian):
        return [("gaussian", (_f64(event.noise_multiplier),), one)]
    if isinstance(event, Laplace):
        return [("laplace", (_f64(event.noise_multiplier),), one)]
    if isinstance(event, ApproxDP):
        return [("approx_dp", (_f64(event.epsilon), _f64(event.delta)), one)]
    if isinstance(event, PoissonSampled):
        inner, q = event.event, _f64(event.q)
        if isinstance(inner, SelfComposed) and isinstance(inner.event, Gaussian):
            k = _ceil_count(_f64(inner.count))
            sigma = _f64(inner.event.noise_multiplier)
            inner = Gaussian(sigma / _xp(sigma, k).sqrt(k), inner.event.relation)
        if isinstance(inner, (Gaussian, Laplace, ApproxDP)) and inner.relation == "add_remove":
            if isinstance(inner, Gaussian):
                return [("sampled_gaussian", (q, _f64(inner.noise_multiplier)), one)]
            if isinstance(inner, Laplace):
                return [("sampled_laplace", (q, _f64(inner.noise_multiplier)), one)]
            return [("sampled_approx_dp", (q, _f64(inner.epsilon), _f64(inner.delta)), one)]
        raise ValueError("the PLD accountant covers PoissonSampled(q, inner) of a Gaussian (also self-composed), "
                         "Laplace or ApproxDP event under add_remove only; got PoissonSampled("
                         f"{type(inner).__name__}, relation={getattr(inner, 'relation', None)!r}).")
    if isinstance(event, SelfComposed):
        k = _ceil_count(_f64(event.count))
        return _components(event.event, k * one if _xp(k, one) is np else jnp.multiply(k, one))
    if isinstance(event, Composed):
        out = []
        for e in event.events:
            out.extend(_components(e, one))
        return out
    raise ValueError(f"the PLD accountant does not cover {type(event).__name__} events "
                     "(Gaussian, Laplace, ApproxDP, their Poisson sampling and compositions only).")


def _valid(kind, params):
    """The parameter ranges of a kind (traced: NaN out of range under ``jit``)."""
    if kind in ("gaussian", "laplace"):
        return params[0] > 0
    if kind == "approx_dp":
        return (params[0] >= 0) & (params[1] >= 0) & (params[1] < 1)
    ok = (params[0] >= 0) & (params[0] <= 1)
    return ok & _valid(kind[len("sampled_"):], params[1:])



# =======================================================================================
# Public functions.
# =======================================================================================


def _grid_ok(n):
    """n = 2^a or 3·2^a: the sizes whose FFT round-off the certificate bounds (_pld_curves.fft_passes)."""
    m = n // 3 if n % 3 == 0 else n
    return m & (m - 1) == 0


def _check_options(grid_size, tail_bound, estimate, stages=PLD_STAGES):
    if isinstance(stages, bool) or stages not in _STAGES:
        raise ValueError(f"stages must be 1 or 2 (static); got {stages!r}.")
    if isinstance(grid_size, bool) or not isinstance(grid_size, (int, np.integer)) or grid_size < 64 \
            or grid_size > 2**24 or not _grid_ok(int(grid_size)):
        raise ValueError("grid_size must be a power of two or three times one (e.g. 16384, 24576), "
                         f"in [64, 2^24] (static); got {grid_size!r}.")
    if not (isinstance(tail_bound, (int, float)) and 0.0 < tail_bound < 1e-3):
        raise ValueError(f"tail_bound must be a float in (0, 1e-3) (static); got {tail_bound!r}.")
    _validate.check_static_choice("estimate", estimate, _ESTIMATES)


def _prepared(event):
    check_event(event)
    return _components(event)  # raises on what the PLD accountant does not cover


def _evaluate(event, query, grid_size, tail_bound, estimate, what, stages=PLD_STAGES):
    """Map the scalar evaluation over the broadcast batch of the event's leaves and ``query``."""
    comps = _prepared(event)
    kinds = tuple(kd for kd, _, _ in comps)
    vals = []
    for _, params, k in comps:
        vals.extend(params)
        vals.append(k)
    vals.append(f64(query))
    sizes = tuple(len(p) + 1 for _, p, _ in comps)
    if estimate == "upper" and stages == 2:
        estimate = "upper2"
    with _gc_paused():
        return _evaluate_jit(kinds, sizes, grid_size, tail_bound, estimate, what, *vals)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector paused for the block (where it was enabled).

    A first call traces and lowers the PLD's program: its short-lived Python objects set off
    ~80 collections of the young generations and a full one over the ~10^5 objects the imports
    left: 0.06-0.17 s of wall time at a load of 9 (session 20). Nothing is lost: cycles left
    behind are collected after the block, as they would have been. (Reference counting, which
    frees most objects, is not affected.)
    """
    was = gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


PLD_SECOND_DERIVATIVE_MESSAGE = (
    "second derivatives (jax.hessian, grad of grad, jacfwd of jacfwd) of the PLD accountant are not "
    "available: its grid plan (window, spacing, tilt) moves with the event, so differentiating its "
    "fixed-plan gradient does not give the curvature of epsilon. Use the RDP accountant "
    "(accountant='rdp'), or a difference quotient of jax.grad.")


class PLDSecondDerivativeError(NotImplementedError):
    """A second derivative of the PLD accountant's ε or δ was asked for (see :data:`PLD_SECOND_DERIVATIVE_MESSAGE`)."""


@jax.custom_jvp
def _first_order_only(x):
    """``x``, whose derivative raises: the PLD's first-derivative partials are not differentiated again."""
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise PLDSecondDerivativeError(PLD_SECOND_DERIVATIVE_MESSAGE)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _one(kinds, sizes, n, tau, estimate, what, *xs):
    return _one_value(kinds, sizes, n, tau, estimate, what, *xs)


@_one.defjvp
def _one_jvp(kinds, sizes, n, tau, estimate, what, primals, tangents):
    # Forward-mode partials, combined with products only: the linear program that reverse
    # mode transposes (possibly outside the float64 scope) then holds no FFT or complex op.
    f = functools.partial(_one_value, kinds, sizes, n, tau, estimate, what)
    out = f(*primals)
    # The partials hold the plan fixed: correct first derivatives, but their own derivative
    # is not the second derivative of ε (see the module docstring), so it raises.
    partials = _first_order_only(jax.jacfwd(f, argnums=tuple(range(len(primals))))(*primals))
    # Non-finite partials are 0 for the one-stage plan (flat pieces at ε = 0 or +inf). The
    # two-stage plan's forward derivative can be NaN under some XLA flags (docs/pld.md): it
    # stays NaN, never a silent 0.
    fill = jnp.nan if estimate == "upper2" else 0.0
    t_out = sum(jnp.where(jnp.isfinite(g), g, fill) * t for g, t in zip(partials, tangents))
    return out, t_out


def _one_value(kinds, sizes, n, tau, estimate, what, *xs):
    params, counts, i = [], [], 0
    for s in sizes:
        params.append(tuple(xs[i:i + s - 1]))
        counts.append(xs[i + s - 1])
        i += s
    query = xs[-1]
    valid = jnp.all(jnp.stack([jnp.isfinite(x) for x in xs[:-1]]))
    for kd, p_, k in zip(kinds, params, counts):
        valid &= _valid(kd, p_) & (k >= 0)
    # "upper2": the two-stage upper bound (``stages=2``, _pld_stages.py).
    stages, estimate = (2, "upper") if estimate == "upper2" else (1, estimate)
    if what == "delta":
        read = functools.partial(delta_read, eps=query, estimate=estimate)
    else:
        read = functools.partial(epsilon_read, target=query, estimate=estimate)
    res = compose(kinds, params, counts, n, tau, estimate, query, what, stages, read)
    out = res[0] if len(res) == 1 else jnp.maximum(res[0], res[1])
    return jnp.where(valid, out, jnp.nan)


def _quick(kinds, sizes, n, tau, estimate, what, *vals) -> bool:
    """A small eager evaluation (configurations × grid size ≤ 2^18: 10 configurations at the default
    24,576, 16 at 2^14, one up to 2^18): compiled for a short compile rather than a fast run
    (jaxdp._program_cache). At 2^14 the first call's compile is ~0.8 s shorter and each
    configuration runs ~10 ms longer."""
    shape = np.broadcast_shapes(*(tuple(getattr(v, "shape", np.shape(v))) for v in vals))
    return int(np.prod(shape, dtype=np.int64)) * int(n) <= 2**18


# Compiled once per event structure and static options; called eagerly it costs one dispatch.
@persistent("pld", static_argnums=(0, 1, 2, 3, 4, 5), quick=_quick)
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _evaluate_jit(kinds, sizes, n, tau, estimate, what, *vals):
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in vals))
    fn = functools.partial(_one, kinds, sizes, n, tau, estimate, what)
    if shape == ():
        return fn(*vals)
    flat = [jnp.broadcast_to(v, shape).reshape(-1) for v in vals]
    return jax.vmap(fn)(*flat).reshape(shape)


def _refuse_uncertified(eps, delta) -> None:
    if _validate.is_concrete(eps) and _validate.is_concrete(delta):
        e = np.asarray(eps)
        if np.any(np.isposinf(e)):
            raise ValueError(
                f"the PLD grid cannot certify delta={np.ravel(np.broadcast_to(np.asarray(delta), e.shape))[np.argmax(np.ravel(np.isposinf(e)))]:g}: "
                "the mass it cannot place (tails, +inf loss, rounding) already exceeds it; increase grid_size "
                "or tail_bound's precision (smaller tail_bound), or use a larger delta.")


@float64
def pld_epsilon(event, delta, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND,
                estimate: str = "upper", fallback: str = "rdp", stages: int = PLD_STAGES) -> jax.Array:
    r"""ε at which the event is (ε, δ)-DP, from its privacy loss distribution (FFT).

    The public door is ``epsilon(event, delta, accountant="pld", ...)``; the name
    ``jaxdp.accounting.pld_epsilon`` is deprecated and warns.

    :math:`ε = \min\{ε ≥ 0 : δ_ω(ε) ≤ δ\}` for the composed discrete PLD ω, with
    :math:`δ_ω(ε) = \sum_i ω_i (1 - e^{ε - ℓ_i})_+ + ω_∞`; see the module docstring for
    the discretisation (connect-the-dots, an upper bound) and its certificate.

    Args:
      event: a privacy event built from ``Gaussian``, ``Laplace``,
        ``PoissonSampled(q, Gaussian(...))`` (add/remove-one), ``SelfComposed`` and
        ``Composed`` (a batch if its leaves have leading axes).
      delta: target δ in (0, 1), broadcast against the batch.
      grid_size: static number of loss bins n (a power of two or three times one, default 3·2^13 = 24576): the
        error of the upper bound shrinks like 1/n², time grows like n log n.
      tail_bound: static cap on the mass the grid plan leaves outside the window and above
        each mechanism's grid (default 1e-6; the plan uses min(tail_bound, 1e-4·δ)); the
        mass actually outside is certified and added to δ.
      estimate: ``"upper"`` (default, a certified upper bound on ε) or ``"lower"`` (a
        certified lower bound from a dominated discrete pair: merged buckets for Gaussian
        and Poisson-sampled Gaussian mechanisms, privacy buckets rounded down otherwise).
      fallback: ``"rdp"`` (default): where the PLD grid cannot certify δ (the mass it
        places at +∞ exceeds it), the upper bound is the RDP accountant's ε (also
        certified; eagerly a ``UserWarning`` says so); ``"none"``: +inf there (eagerly a
        ``ValueError``). Ignored for ``"lower"`` (0 is returned where nothing is certified).
      stages: static, for ``"upper"``: 1 (default, :data:`PLD_STAGES`: one tilted FFT of
        ``grid_size`` bins) or 2 (blocks of ⌊k/m⌋ steps composed on a finer grid first,
        then the blocks, ``_pld_stages.py``): also certified; its error is about
        Σ_c (k_c h₁² + m h₂²) instead of Σ_c k_c h², often tighter on long compositions, at about
        twice the time. The lower bound is single-stage.

    Returns:
      float64 ε ≥ 0 of the broadcast batch shape. Invalid leaves: ``ValueError`` eagerly,
      NaN under ``jit``.

    References:
      Doroshenko et al., PoPETs 2022, Algorithm 1; Koskela et al., AISTATS 2020.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> e = A.epsilon(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5, accountant="pld", grid_size=2**12)
      >>> round(float(e), 3)  # exact (μ = 1 Gaussian DP): 4.377
      4.377
    """
    _check_options(grid_size, tail_bound, estimate, stages)
    _validate.check_static_choice("fallback", fallback, _FALLBACKS)
    _validate.check_delta(delta)
    out = _evaluate(event, delta, int(grid_size), float(tail_bound), estimate, "epsilon", int(stages))
    if estimate == "upper" and fallback == "rdp":
        return out  # +inf where uncertified: the accountant door (_accountants.epsilon) puts RDP's ε there
    _refuse_uncertified(out, delta)
    return out


@float64
def pld_delta(event, epsilon, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND,
              estimate: str = "upper", stages: int = PLD_STAGES) -> jax.Array:
    r"""δ(ε) of the event from its privacy loss distribution (an upper bound by default).

    The public door is ``delta(event, epsilon, accountant="pld", ...)``; the name
    ``jaxdp.accounting.pld_delta`` is deprecated and warns.

    :math:`δ = \sum_i ω_i (1 - e^{ε - ℓ_i})_+ + ω_∞` + the certified tail and rounding
    terms (see :func:`pld_epsilon` and the module docstring).

    Args:
      event: as in :func:`pld_epsilon`.
      epsilon: ε ≥ 0, broadcast against the batch.
      grid_size, tail_bound, estimate, stages: as in :func:`pld_epsilon`.

    Returns:
      float64 δ in [0, 1] of the broadcast batch shape (NaN under ``jit`` for invalid leaves).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> d = A.delta(A.SelfComposed(A.Gaussian(2.0), 4), 1.0, accountant="pld", grid_size=2**12)
      >>> 0.126936 <= float(d) <= 0.1272  # exact: 0.1269359...
      True
    """
    _check_options(grid_size, tail_bound, estimate, stages)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    return _evaluate(event, epsilon, int(grid_size), float(tail_bound), estimate, "delta", int(stages))


# =======================================================================================
# The "pld" accountant of the event layer: epsilon(event, delta, accountant="pld").
# =======================================================================================


ACCOUNTANT_OPTIONS = ("grid_size", "tail_bound", "estimate", "fallback", "stages")


def accountant_epsilon(event, delta, orders, **options):
    """``epsilon(event, delta, accountant="pld", **options)`` (``orders`` is not used)."""
    return pld_epsilon(event, delta, **options)


def accountant_delta(event, epsilon, orders, **options):
    """``delta(event, epsilon, accountant="pld", **options)`` (``orders`` is not used)."""
    return pld_delta(event, epsilon, **options)

