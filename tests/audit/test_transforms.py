"""The audit statistics under jit and vmap with the x64 flag on and off.

With x64 off under a trace they are computed on the host in float64 and rounded to
float32 in the safe direction (lower bounds down, upper bounds and p-values up).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import audit


def test_jit_vmap_x64_off_rounds_safely():
    assert not jax.config.jax_enable_x64
    k = jnp.array([5.0, 6.0])
    lo, hi = jax.jit(jax.vmap(audit.clopper_pearson, in_axes=(0, None, None)))(k, 100.0, 0.95)
    # eager float64 at the same inputs (jit passes the confidence as float32(0.95))
    ref_lo, ref_hi = audit.clopper_pearson(np.array([5, 6]), 100, float(np.float32(0.95)))
    assert lo.dtype == jnp.float32
    assert np.all(np.asarray(lo, np.float64) <= np.asarray(ref_lo))
    assert np.all(np.asarray(hi, np.float64) >= np.asarray(ref_hi))
    np.testing.assert_allclose(lo, ref_lo, rtol=1e-6)
    eps = jax.jit(lambda r, v: audit.one_run_epsilon_lower_bound(100, r, v))(50, 50)
    ref = float(audit.one_run_epsilon_lower_bound(100, 50, 50))
    assert float(eps) <= ref and ref - float(eps) <= 2 * np.spacing(np.float32(ref))


def test_jit_x64_on_matches_eager():
    with jax.enable_x64(True):
        lo, hi = jax.jit(audit.clopper_pearson)(5.0, 100.0, 0.95)
        ref_lo, ref_hi = audit.clopper_pearson(5, 100, 0.95)
        assert lo.dtype == jnp.float64
        assert float(lo) == float(ref_lo) and float(hi) == float(ref_hi)
