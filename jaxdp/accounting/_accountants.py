r"""Accountants of privacy events: the registry, the RDP accountant, ``epsilon``/``delta``/``rdp``.

An accountant turns an event tree (``_events.py``) into ε or δ. Two are registered here:

* ``"rdp"`` (built in): RDP curves composed additively and converted once. Its traversal
  of the tree, :func:`_rdp_compose`, is written once: like dp_accounting's
  ``RdpAccountant._maybe_compose`` it checks support and builds the curve in the same walk
  (``compose=False`` only checks, eagerly, before the leaves are checked). A lone
  :class:`PNSGD` run gets its own (ε, δ) analyses, tighter than its curve.
* ``"pld"``: privacy loss distributions composed by FFT (``_pld.py``, which imports the
  event tree only), with its options ``grid_size``, ``tail_bound``, ``estimate`` and ``fallback``.

:func:`register_accountant` adds others. Per-record PNSGD ε (:func:`pnsgd_record_epsilon`)
is here too: the theorem functions receive the run's constants from the event by name
(:func:`_with_fields`), not through one adapter per argument order.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._program_cache import persistent
from . import _pld
from ._conversion import rdp_to_delta, rdp_to_epsilon
from ._dpsbcd import dpsbcd_rdp
from ._events import (
    DPSBCD,
    PNSGD,
    ApproxDP,
    Composed,
    Event,
    Gaussian,
    Laplace,
    PoissonSampled,
    SelfComposed,
    check_leaves,
    relation_of,
)
from ._rdp import DEFAULT_ORDERS, gaussian_rdp, laplace_rdp, sampled_gaussian_rdp

__all__ = ["rdp", "epsilon", "delta", "pnsgd_record_epsilon", "register_accountant", "pld_bracket"]


# =======================================================================================
# The run's record into the theorem functions.
# =======================================================================================


@functools.cache
def _field_params(fn: Callable, fields: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p in fields)


def _with_fields(fn: Callable, event: Event, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every field of ``event`` that ``fn`` names passed by name.

    A :class:`PNSGD` or :class:`DPSBCD` event is the record of its run's constants, and the
    theorem functions name those constants as the event does (``num_records``,
    ``lipschitz``, ``noise_std``, ...; the glossary's names), in whatever order and
    positional/keyword split each signature has. Arguments given explicitly win.
    """
    fields = tuple(f.name for f in dataclasses.fields(event) if f.name not in kwargs)
    return fn(*args, **{p: getattr(event, p) for p in _field_params(fn, fields)}, **kwargs)


# =======================================================================================
# The RDP accountant: one traversal (support and curve together).
# =======================================================================================


def _check_pnsgd_support(ev: PNSGD, path: str) -> None:
    if ev.sampling == "poisson":
        return  # add/remove, one fixed schedule: checked by the event itself
    if ev.relation != "replace_one":
        raise ValueError(
            f"{path}: the PNSGD analyses cover relation 'replace_one' only (records replaced in a fixed "
            f"order); got relation {ev.relation!r}."
        )
    if ev.schedule == "random_stop":
        if not ev.hidden:
            raise ValueError(
                f"{path}: PNSGD with schedule='random_stop' and hidden=False is not supported (releasing "
                "every iterate reveals the stopping time)."
            )
        if ev.passes != 1:
            raise ValueError(
                f"{path}: the random-stop PNSGD analyses cover one pass (passes=1); got passes={ev.passes}."
            )


def _loaded(name: str):
    """The analysis module ``jaxdp.accounting.<name>`` if it has been imported, else None.

    The RDP traversal imports no analysis it does not need (issue 21: a first ε of DP-SGD
    in a fresh process): the event classes of ``_sampling``, ``_allocation`` and ``_parity``
    exist only once their module is imported, so before that no event can be one of them;
    the PNSGD analyses are imported by the functions that run them.
    """
    return sys.modules.get(f"{__package__}.{name}")


def _rdp_compose(event: Event, orders: np.ndarray, path: str = "event", compose: bool = True):
    """The RDP curve of an event tree, ``batch + (k,)``; raises ``ValueError`` on what it cannot analyse.

    With ``compose=False`` only the support is checked (eagerly, on the static structure)
    and ``None`` is returned, as dp_accounting's ``_maybe_compose(event, 0, False)``.
    """
    sampling, allocation, parity = _loaded("_sampling"), _loaded("_allocation"), _loaded("_parity")
    if sampling is not None and isinstance(event, sampling.SAMPLING_EVENTS):  # fixed-size and truncated sampling
        sampling.check_support(event, path)
        return sampling.rdp_curve(event, orders) if compose else None
    if allocation is not None and isinstance(event, allocation.RandomAllocation):  # balls-in-bins
        allocation.check_support(event, path)
        return allocation.rdp_curve(event, orders) if compose else None
    if parity is not None and isinstance(event, parity.PARITY_EVENTS):  # randomized response, zCDP, tree aggregation
        return parity.rdp_curve(event, orders) if compose else None
    if isinstance(event, Gaussian):
        return gaussian_rdp(orders, event.noise_multiplier) if compose else None
    if isinstance(event, Laplace):
        return laplace_rdp(orders, event.noise_multiplier) if compose else None
    if isinstance(event, PoissonSampled):
        inner = event.event
        if not isinstance(inner, Gaussian):
            raise ValueError(
                f"{path}: the RDP accountant supports PoissonSampled only of a Gaussian event (the sampled "
                f"Gaussian analysis); got PoissonSampled({type(inner).__name__})."
            )
        if inner.relation != "add_remove":
            raise ValueError(
                f"{path}: the Poisson-sampled Gaussian RDP analysis covers relation 'add_remove' only; got "
                f"relation {inner.relation!r}."
            )
        return sampled_gaussian_rdp(orders, event.q, inner.noise_multiplier) if compose else None
    if isinstance(event, SelfComposed):
        inner = _rdp_compose(event.event, orders, f"{path}.event", compose)
        if not compose:
            return None
        count = f64(event.count)
        n = jnp.ceil(jnp.where(count >= 0, count, 0.0))[..., None]
        # count = 0 composes nothing (0, even where the inner curve is +inf).
        out = jnp.where(n > 0, n * inner, 0.0)
        return jnp.where((count >= 0)[..., None], out, jnp.nan)
    if isinstance(event, Composed):
        parts = [_rdp_compose(e, orders, f"{path}.events[{i}]", compose) for i, e in enumerate(event.events)]
        if not compose:
            return None
        total = jnp.zeros((len(orders),))
        for part in parts:
            total = total + part
        return total
    if isinstance(event, ApproxDP):
        raise ValueError(f"{path}: an ApproxDP (epsilon, delta) guarantee has no RDP curve for delta > 0; use "
                         "accountant='pld'.")
    if isinstance(event, PNSGD):
        _check_pnsgd_support(event, path)
        return _pnsgd_rdp(event, orders) if compose else None
    if isinstance(event, DPSBCD):
        return _with_fields(dpsbcd_rdp, event, orders) if compose else None
    raise TypeError(f"{path}: not a privacy event: {type(event).__name__}")


def _pnsgd_step_ok(ev: PNSGD):
    eta, beta, rho = f64(ev.learning_rate), f64(ev.smoothness), f64(ev.strong_convexity)
    return (eta > 0) & (beta > 0) & (rho >= 0) & (rho <= beta) & (eta * (beta + rho) < 2.0)


def _last_batch(ev: PNSGD) -> int:
    n, b = ev.num_records, ev.batch_size
    return n - (-(-n // b) - 1) * b


def _stop_rdp(ev: PNSGD, orders, batches):
    """Feldman et al.'s Theorem 26 RDP of a random-stop run (the ``logmeanexp`` form) at batch indices.

    Batches are the steps: m = ⌈n/b⌉ steps with Lipschitz constant L/b_min (as :func:`pnsgd_privacy`).
    """
    from ._iteration import stop_pnsgd_iteration_rdp  # PNSGD analyses: on first use (see _loaded)
    from ._pnsgd import stop_geometry  # on first use, as above

    m, b_min = stop_geometry(ev.num_records, ev.batch_size)
    return stop_pnsgd_iteration_rdp(orders, m, f64(ev.lipschitz) / b_min, ev.noise_std, positions=batches,
                                    form="logmeanexp")


def _pnsgd_rdp(ev: PNSGD, orders: np.ndarray):
    from . import _pnsgd_poisson, _pnsgd_shuffle  # PNSGD analyses: on first use (see _loaded)
    from ._iteration import pnsgd_iteration_rdp  # on first use, as above
    from ._shifted import pnsgd_shifted_gdp  # on first use, as above

    if ev.sampling == "poisson":
        return _pnsgd_poisson.event_rdp(ev, orders)
    if ev.sampling == "shuffle":
        return jnp.where(_pnsgd_step_ok(ev)[..., None], _pnsgd_shuffle.event_rdp(ev, orders), jnp.nan)
    n = ev.num_records
    if ev.schedule == "random_stop":
        curve = _stop_rdp(ev, orders, 1)
    elif ev.hidden:
        # The last record is the worst for both curves (each is non-decreasing in the
        # position); at each order the smaller of two valid RDP bounds is valid.
        curve = _with_fields(pnsgd_iteration_rdp, ev, orders, n)
        mu = _with_fields(pnsgd_shifted_gdp, ev, n)
        curve = jnp.minimum(curve, 0.5 * f64(orders) * (mu**2)[..., None])
    else:
        # Every iterate released: the record's k steps, each a Gaussian mechanism with
        # sensitivity 2L/b_n over noise σ, compose to one with ratio r = 2L√k/(b_n σ).
        r = 2.0 * f64(ev.lipschitz) * math.sqrt(ev.passes) / (_last_batch(ev) * f64(ev.noise_std))
        ok = (f64(ev.lipschitz) >= 0) & (r >= 0) & jnp.isfinite(r)
        curve = jnp.where(ok[..., None], f64(orders) * (0.5 * jnp.where(ok, r, 0.0) ** 2)[..., None], jnp.nan)
    return jnp.where(_pnsgd_step_ok(ev)[..., None], curve, jnp.nan)


@float64
def rdp(event: Event, orders=DEFAULT_ORDERS) -> jax.Array:
    r"""The RDP curve of an event: :math:`ε(α)` at each order, composed additively.

    Gaussian: :math:`α/(2σ^2)`; Laplace: :func:`laplace_rdp`; Poisson-sampled Gaussian
    (add/remove-one only): :func:`sampled_gaussian_rdp`; ``SelfComposed``: ⌈count⌉ times
    the inner curve; ``Composed``: the sum (Mironov 2017, Proposition 1); PNSGD: the
    worst record's curve (see :class:`PNSGD`).

    Args:
      event: a privacy event (a batch if its leaves have leading axes; they broadcast).
      orders: Rényi orders > 1, a concrete 1-D sequence (static), default dp_accounting's 156.

    Returns:
      float64 array of shape ``batch + (k,)``; NaN under ``jit`` for invalid leaves.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> [round(float(v), 6) for v in A.rdp(A.SelfComposed(A.Gaussian(2.0), 3), [2.0, 8.0])]
      [0.75, 3.0]
    """
    _prepare(event, _BUILTIN_RDP)
    orders_np = _validate.concrete_orders(orders)
    return _rdp_compose(event, orders_np)


def _map_pnsgd(fn, ev: PNSGD, *args):
    """Apply ``fn(ev, *args)`` (scalar leaves) over the broadcast batch of ``ev`` and ``args``."""
    leaves, treedef = jax.tree_util.tree_flatten(ev)
    vals = [f64(x) for x in leaves] + [f64(a) for a in args]
    shape = jnp.broadcast_shapes(*(v.shape for v in vals))
    if shape == ():
        return fn(jax.tree_util.tree_unflatten(treedef, vals[: len(leaves)]), *vals[len(leaves):])
    flat = [jnp.broadcast_to(v, shape).reshape(-1) for v in vals]

    def one(*xs):
        return fn(jax.tree_util.tree_unflatten(treedef, list(xs[: len(leaves)])), *xs[len(leaves):])

    out = jax.vmap(one)(*flat)
    return out.reshape(shape + out.shape[1:])


def _pnsgd_record_eps(ev: PNSGD, target_delta, positions, orders):
    """ε of one (scalar) PNSGD run for the records at ``positions``: ``best`` of :func:`pnsgd_privacy`."""
    from ._pnsgd import run_privacy  # PNSGD analyses: on first use (see _loaded)

    res = run_privacy(ev, target_delta, positions=positions, orders=orders)
    if ev.schedule == "random_stop":
        return jnp.where(_pnsgd_step_ok(ev), res.best, jnp.nan)
    return res.best


def _pnsgd_epsilon_one(ev: PNSGD, target_delta, orders):
    """ε of the worst record of one (scalar) PNSGD run.

    Fixed schedule: the last record (every analysis is non-decreasing in the position).
    Random stop: the larger of the first and the last record. The stop analyses are
    non-increasing in the position and composition is the same for every full batch, so
    no record of a full batch is worse than the first; the last batch may be smaller.
    """
    if ev.schedule == "random_stop":
        return jnp.max(_pnsgd_record_eps(ev, target_delta, jnp.asarray([1.0, float(ev.num_records)]), orders))
    return _pnsgd_record_eps(ev, target_delta, jnp.asarray([float(ev.num_records)]), orders)[0]


def _pnsgd_delta_one(ev: PNSGD, target_epsilon, orders):
    # PNSGD analyses: on first use (see _loaded).
    from ._contraction import pnsgd_contraction_delta, step_contraction, stop_pnsgd_contraction_delta
    from ._hockey_stick import gaussian_hockey_stick  # on first use, as above
    from ._iteration import linear_rdp_delta, pnsgd_iteration_rdp  # on first use, as above
    from ._pnsgd import stop_geometry  # on first use, as above
    from ._shifted import pnsgd_shifted_gdp  # on first use, as above

    n = ev.num_records
    m_c = _with_fields(step_contraction, ev)
    if ev.schedule == "random_stop":
        # The first and the last batch (see _pnsgd_epsilon_one): Theorem 5, Theorem 26 and composition.
        m, b_min = stop_geometry(n, ev.batch_size)
        ends = jnp.asarray([1.0, float(m)])
        d_c = stop_pnsgd_contraction_delta(target_epsilon, m, f64(ev.lipschitz) / b_min, ev.noise_std,
                                           ev.learning_rate, ev.diameter, m_c, positions=ends)
        d_r = rdp_to_delta(_stop_rdp(ev, orders, ends), orders, target_epsilon).delta
        b_ends = jnp.asarray([float(min(ev.batch_size, n)), float(_last_batch(ev))])
        d_g = gaussian_hockey_stick(target_epsilon, 2.0 * f64(ev.lipschitz) / (b_ends * f64(ev.noise_std)))
        out = jnp.max(jnp.minimum(jnp.minimum(d_c, d_r), d_g))
    else:
        r = 2.0 * ev.lipschitz * math.sqrt(ev.passes) / (_last_batch(ev) * ev.noise_std)
        d_g = gaussian_hockey_stick(target_epsilon, r)  # composition: every iterate released
        if ev.hidden:
            d_c = _with_fields(pnsgd_contraction_delta, ev, target_epsilon, n, contraction=m_c)
            # Feldman et al.'s RDP is linear in the order: the classic conversion at the best
            # continuous order, and the improved one on the orders grid.
            curve = _with_fields(pnsgd_iteration_rdp, ev, orders, n)
            coef = _with_fields(pnsgd_iteration_rdp, ev, np.array([2.0]), n)[..., 0] / 2.0
            d_i = jnp.minimum(linear_rdp_delta(target_epsilon, coef), rdp_to_delta(curve, orders, target_epsilon).delta)
            # Shifted interpolation: μ-GDP, exact δ(ε) = θ_{e^ε}(μ).
            d_s = gaussian_hockey_stick(target_epsilon, _with_fields(pnsgd_shifted_gdp, ev, n))
            out = jnp.minimum(jnp.minimum(jnp.minimum(d_c, d_i), d_g), d_s)
        else:
            out = d_g
    return jnp.where(_pnsgd_step_ok(ev), out, jnp.nan)


def _rdp_epsilon(event: Event, target_delta, orders: np.ndarray):
    if isinstance(event, PNSGD) and event.sampling == "sequential":
        # A lone PNSGD run gets its own (ε, δ) analyses, tighter than its RDP curve.
        _check_pnsgd_support(event, "event")
        return _map_pnsgd(lambda ev, d: _pnsgd_epsilon_one(ev, d, orders), event, target_delta)
    if isinstance(event, PNSGD) and event.sampling == "shuffle":
        # Shuffled batches: the RDP curve and the hockey-stick mixture of the same shift bound.
        _check_pnsgd_support(event, "event")
        from . import _pnsgd_shuffle  # PNSGD analyses: on first use (see _loaded)

        eps = _pnsgd_shuffle.event_epsilon(event, target_delta, orders)
        return jnp.where(_pnsgd_step_ok(event), eps, jnp.nan)
    allocation = _loaded("_allocation")  # random allocation: fewer quadratures
    curve = None if allocation is None else allocation.pruned_curve(event, orders, target_delta)
    if curve is not None:
        return rdp_to_epsilon(curve, orders, target_delta).epsilon
    return rdp_to_epsilon(_rdp_compose(event, orders), orders, target_delta).epsilon


def _rdp_delta(event: Event, target_epsilon, orders: np.ndarray):
    if isinstance(event, PNSGD) and event.sampling == "sequential":
        _check_pnsgd_support(event, "event")
        return _map_pnsgd(lambda ev, e: _pnsgd_delta_one(ev, e, orders), event, target_epsilon)
    if isinstance(event, PNSGD) and event.sampling == "shuffle":
        _check_pnsgd_support(event, "event")
        from . import _pnsgd_shuffle  # PNSGD analyses: on first use (see _loaded)

        return jnp.where(_pnsgd_step_ok(event), _pnsgd_shuffle.event_delta(event, target_epsilon, orders), jnp.nan)
    return rdp_to_delta(_rdp_compose(event, orders), orders, target_epsilon).delta


# =======================================================================================
# The registry.
# =======================================================================================


class _Accountant(NamedTuple):
    epsilon: Callable  # epsilon(event, delta, orders, **options)
    delta: Callable  # delta(event, epsilon, orders, **options)
    check: Callable | None = None  # eager support check of the tree, before its leaves are checked
    options: tuple[str, ...] = ()  # the keyword options of epsilon/delta it takes


_BUILTIN_RDP = _Accountant(_rdp_epsilon, _rdp_delta, check=functools.partial(_rdp_compose, orders=None, compose=False))
_ACCOUNTANTS: dict[str, _Accountant] = {
    "rdp": _BUILTIN_RDP,
    # Privacy loss distributions composed by FFT; it checks its own support (_pld._components).
    "pld": _Accountant(_pld.accountant_epsilon, _pld.accountant_delta, options=_pld.ACCOUNTANT_OPTIONS),
}
_BUILTIN = ("rdp", "pld")


def register_accountant(name: str, *, epsilon: Callable, delta: Callable) -> None:
    """Make an accountant available to :func:`epsilon` and :func:`delta` as ``accountant=name``.

    Args:
      name: the accountant's name (a new one; ``"rdp"`` and ``"pld"`` are built in and
        cannot be replaced).
      epsilon: ``epsilon(event, delta, orders) -> ε`` (δ broadcast against the event batch).
      delta: ``delta(event, epsilon, orders) -> δ``.

    Each function receives a validated event (relations consistent, concrete leaves in
    range) and must raise ``ValueError`` naming any event type or relation it does not
    cover. It should return +inf (ε) or 1 (δ) where it cannot certify a bound.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> A.register_accountant("pure", epsilon=lambda ev, d, o: 1.0 / ev.noise_multiplier,
      ...                       delta=lambda ev, e, o: 0.0)
      >>> float(A.epsilon(A.Laplace(2.0), 1e-5, accountant="pure"))
      0.5
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string; got {name!r}.")
    if name in _BUILTIN:
        raise ValueError(f"accountant {name!r} is built in and cannot be replaced.")
    if not (callable(epsilon) and callable(delta)):
        raise TypeError("epsilon and delta must be callables.")
    _ACCOUNTANTS[name] = _Accountant(epsilon, delta)


def _lookup(accountant: str, **options) -> tuple[_Accountant, dict]:
    """The registered accountant and the options given for it (``None``: its default)."""
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(repr(k) for k in _ACCOUNTANTS)}; got {accountant!r}.")
    acc = _ACCOUNTANTS[accountant]
    given = {k: v for k, v in options.items() if v is not None}
    for k in given:
        if k not in acc.options:
            owners = [n for n, a in _ACCOUNTANTS.items() if k in a.options]
            raise ValueError(f"{k} is an option of accountant={owners[0]!r}; accountant={accountant!r} does not "
                             "take it.")
    return acc, given


def _prepare(event: Event, acc: _Accountant) -> None:
    if not isinstance(event, Event):
        raise TypeError(f"event must be a privacy event (Gaussian, PoissonSampled, ...); got {type(event).__name__}.")
    relation_of(event)
    if acc.check is not None:
        acc.check(event)
    check_leaves(event)


@float64
def epsilon(event: Event, delta, *, orders=DEFAULT_ORDERS, accountant: str = "rdp", grid_size: int | None = None,
            tail_bound: float | None = None, estimate: str | None = None, fallback: str | None = None,
            stages: int | None = None) -> jax.Array:
    r"""ε at which the event is (ε, δ)-DP under its neighbouring relation.

    With ``accountant="rdp"`` (default): the RDP curves of the tree compose additively and
    convert once, :math:`ε = \min_α \mathrm{conv}_δ(\sum ε_i(α))` (:func:`rdp_to_epsilon`,
    the improved conversion); a lone :class:`PNSGD` event uses its own analyses (see
    there). ``epsilon(dpsgd_event(q, s, T), δ) == dpsgd_epsilon(q, s, T, δ)``.

    With ``accountant="pld"``: the privacy loss distribution composed by FFT,
    :math:`ε = \min\{ε ≥ 0 : δ_ω(ε) ≤ δ\}` for the composed discrete PLD ω, a certified
    upper bound by default (connect-the-dots, Doroshenko et al. 2022; see
    ``docs/pld.md``). It covers ``Gaussian``, ``Laplace``, ``ApproxDP`` (external (ε, δ)
    guarantees), ``PoissonSampled(q, inner)`` (add/remove-one) of a ``Gaussian`` (also
    self-composed), ``Laplace`` or ``ApproxDP``, and their compositions; where
    the grid cannot certify δ, the RDP accountant's ε (``fallback="rdp"``, eagerly with a
    ``UserWarning``). Both bounds at once: :func:`pld_bracket`.

    Args:
      event: a privacy event (a batch of events if its leaves have leading axes).
      delta: target δ in (0, 1), broadcast against the batch.
      orders: Rényi orders (static), default the 156 of dp_accounting (``"rdp"``; the
        ``"pld"`` accountant does not use them).
      accountant: a registered accountant name (static): ``"rdp"`` (default), ``"pld"``,
        or one added by :func:`register_accountant`.
      grid_size: ``"pld"`` only: static number of loss bins, a power of two or three times one (default
        :data:`PLD_GRID_SIZE` = 3·2^13 = 24576); the upper bound's error shrinks like 1/n², time
        grows like n log n.
      tail_bound: ``"pld"`` only: static cap on the mass the plan leaves outside the grid
        (default :data:`PLD_TAIL_BOUND` = 1e-6, used as min(tail_bound, 1e-4·δ)); the
        mass actually outside is certified and added to δ.
      estimate: ``"pld"`` only: ``"upper"`` (default, a certified upper bound on ε) or
        ``"lower"`` (a certified lower bound from a dominated discrete pair: merged buckets
        for Gaussian and Poisson-sampled Gaussian mechanisms, buckets rounded down otherwise).
      fallback: ``"pld"`` only: ``"rdp"`` (default; where the grid cannot certify δ, the
        RDP accountant's ε, eagerly with a ``UserWarning``) or ``"none"`` (+inf there,
        eagerly a ``ValueError``).
      stages: ``"pld"`` only, upper bound: 1 (default, :data:`PLD_STAGES`) or 2 (the
        two-stage composition: blocks of steps on a finer grid first; also certified,
        often tighter on long compositions, about twice the time; see :func:`pld_epsilon`).

    Returns:
      float64 ε ≥ 0 of the broadcast batch shape. Unsupported event types or relations
      raise ``ValueError`` (also under ``jit``: they are structural); invalid leaf values
      raise ``ValueError`` naming the field when concrete, and give NaN under ``jit``.
      An option the accountant does not take raises ``ValueError``.

    References:
      I. Mironov, "Rényi Differential Privacy", CSF 2017, Proposition 1 (composition);
      C. Canonne, G. Kamath, T. Steinke, NeurIPS 2020, Proposition 12 (conversion);
      V. Doroshenko et al., "Connect the Dots", PoPETs 2022, Algorithm 1 (PLD).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> ev = A.Composed((A.dpsgd_event(0.01, 1.0, 1000), A.Gaussian(10.0)))
      >>> round(float(A.epsilon(ev, 1e-5)), 4)
      2.1404
      >>> e = A.epsilon(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5, accountant="pld", grid_size=2**12)
      >>> round(float(e), 3)  # exact (μ = 1 Gaussian DP): 4.377
      4.377
    """
    acc, options = _lookup(accountant, grid_size=grid_size, tail_bound=tail_bound, estimate=estimate,
                           fallback=fallback, stages=stages)
    _prepare(event, acc)
    _validate.check_delta(delta)
    orders_np = _validate.concrete_orders(orders)
    if acc is _BUILTIN_RDP:  # validated above: one compiled program (see _rdp_jit)
        return _rdp_jit(event, f64(delta), tuple(orders_np.tolist()), "epsilon")
    out = acc.epsilon(event, f64(delta), orders_np, **options)
    if accountant == "pld" and options.get("fallback", "rdp") == "rdp" and options.get("estimate", "upper") == "upper":
        out = _pld_rdp_fallback(event, delta, out, orders)
        _pld._refuse_uncertified(out, delta)  # still +inf: an event the RDP accountant does not cover
    return out


def _pld_rdp_fallback(event, delta, out, orders):
    """The PLD's +inf (its grid cannot certify δ) replaced by the RDP accountant's ε, with a warning."""
    if _validate.is_concrete(out) and not np.any(np.isposinf(np.asarray(out))):
        return out  # (tested on the host: no eager XLA program)
    fell = jnp.isposinf(out)
    try:
        rdp = epsilon(event, delta, orders=orders)
    except ValueError:  # an event the RDP accountant does not cover (ApproxDP, sampled Laplace)
        return out
    if _validate.is_concrete(out):
        warnings.warn("epsilon(accountant='pld'): the PLD grid cannot certify this delta for some "
                      "configurations; the RDP accountant's epsilon (also an upper bound) is returned there.",
                      UserWarning, stacklevel=3)
    return jnp.where(fell, rdp, out)


@float64
def delta(event: Event, epsilon, *, orders=DEFAULT_ORDERS, accountant: str = "rdp", grid_size: int | None = None,
          tail_bound: float | None = None, estimate: str | None = None, stages: int | None = None) -> jax.Array:
    r"""δ at which the event is (ε, δ)-DP for the given ε (the inverse of :func:`epsilon`).

    With ``accountant="rdp"``: :func:`rdp_to_delta` of the composed RDP curve; a lone
    :class:`PNSGD` event takes the smallest δ of its analyses (contraction, composition,
    and the RDP analyses converted on the ``orders`` grid; the strongly convex analysis is
    not inverted). Where :func:`epsilon` took a PNSGD ε from an RDP bound optimised over
    continuous orders or from the strongly convex analysis, δ at that ε can exceed the
    target slightly: each value is a valid bound, the pair is not an exact inverse.

    With ``accountant="pld"``: :math:`δ = \sum_i ω_i (1 - e^{ε - ℓ_i})_+ + ω_∞` of the
    composed discrete PLD, plus the certified tail and rounding terms (an upper bound by
    default; see :func:`epsilon`).

    Args:
      event: a privacy event (batches broadcast).
      epsilon: ε ≥ 0.
      orders, accountant, grid_size, tail_bound, estimate, stages: as in :func:`epsilon`.

    Returns:
      float64 δ in [0, 1], batch shape (NaN under ``jit`` for invalid leaves).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> float(A.delta(A.dpsgd_event(256 / 60000, 1.1, 14040), 2.594364)) <= 1e-5
      True
      >>> d = A.delta(A.SelfComposed(A.Gaussian(2.0), 4), 1.0, accountant="pld", grid_size=2**12)
      >>> f"{float(d):.4e}"  # an upper bound of the exact 1.2694e-01
      '1.2702e-01'
    """
    acc, options = _lookup(accountant, grid_size=grid_size, tail_bound=tail_bound, estimate=estimate, stages=stages)
    _prepare(event, acc)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    orders_np = _validate.concrete_orders(orders)
    if acc is _BUILTIN_RDP:
        return _rdp_jit(event, f64(epsilon), tuple(orders_np.tolist()), "delta")
    return acc.delta(event, f64(epsilon), orders_np, **options)


@persistent("event_rdp", static_argnums=(2, 3))
@functools.partial(jax.jit, static_argnums=(2, 3))
def _rdp_jit(event: Event, value, orders_key: tuple, which: str):
    # The built-in RDP accountant as one compiled program per event structure and orders
    # grid: an eager call then compiles once instead of dispatching (and compiling) each
    # operation separately (first call 3.5 s -> under 2 s). The event was validated eagerly
    # by the caller; inside a caller's jit/vmap/grad this jit is inlined.
    orders = np.asarray(orders_key, dtype=np.float64)
    return (_rdp_epsilon if which == "epsilon" else _rdp_delta)(event, value, orders)


@float64
def pnsgd_record_epsilon(event: PNSGD, delta, *, orders=DEFAULT_ORDERS) -> jax.Array:
    """ε of every record position 1..n of a PNSGD run (the per-record vector).

    The analyses are those of :class:`PNSGD`; the last entry (fixed schedule) or the first
    (random stop) is the worst record, which :func:`epsilon` reports.

    Args:
      event: a :class:`PNSGD` event (a batch if its leaves have leading axes).
      delta: target δ in (0, 1).
      orders: Rényi orders (static), used by the random-stop RDP analysis.

    Returns:
      float64 array ``batch + (num_records,)``.

    Examples:
      >>> import jaxdp
      >>> ev = jaxdp.accounting.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=40)
      >>> e = jaxdp.accounting.pnsgd_record_epsilon(ev, 1e-5)
      >>> [round(float(e[i]), 6) for i in (0, 38, 39)]
      [0.0, 2.754009, 4.377178]
    """
    if not isinstance(event, PNSGD):
        raise ValueError(f"pnsgd_record_epsilon needs a PNSGD event; got {type(event).__name__}.")
    _prepare(event, _BUILTIN_RDP)
    _validate.check_delta(delta)
    orders_np = _validate.concrete_orders(orders)
    positions = jnp.arange(1, event.num_records + 1, dtype=jnp.float64)
    return _map_pnsgd(lambda ev, d: _pnsgd_record_eps(ev, d, positions, orders_np), event, f64(delta))


@float64
def pld_bracket(event, delta, *, grid_size: int = _pld.PLD_GRID_SIZE,
                tail_bound: float = _pld.PLD_TAIL_BOUND, stages: int = _pld.PLD_STAGES) -> _pld.PLDBracket:
    """Both PLD estimates of ε: the true ε(δ) lies in ``[lower, upper]``.

    ``upper`` is ``epsilon(event, delta, accountant="pld")``, ``lower`` the same with
    ``estimate="lower"``.

    Args:
      event, delta, grid_size, tail_bound, stages: as in :func:`epsilon` with ``accountant="pld"``
        (``stages`` applies to the upper bound; the lower bound is single-stage).

    Returns:
      ``PLDBracket(lower, upper, width)``, float64, batch shape.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> b = A.pld_bracket(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5, grid_size=2**12)
      >>> bool(b.lower <= 4.3771 <= b.upper)
      True
    """
    up = epsilon(event, delta, accountant="pld", grid_size=grid_size, tail_bound=tail_bound, estimate="upper",
                 stages=stages)
    lo = epsilon(event, delta, accountant="pld", grid_size=grid_size, tail_bound=tail_bound, estimate="lower")
    return _pld.PLDBracket(lo, up, up - lo)
