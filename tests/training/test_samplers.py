"""DP-SGD's samplers: fixed shapes, marginal inclusion probabilities, exactly-once epochs, and the runs they drive.

References: the exact marginal inclusion probability of each scheme (closed forms; for
truncated Poisson :math:`E[\\min(S, B)]/N` with :math:`S \\sim \\mathrm{Bin}(N, q)` from
SciPy's binomial pmf), and dp_accounting 0.6.0's ``RdpAccountant`` for the ε of the
Poisson, fixed-size and shuffled runs (the trainer's ε is checked against it, not against
jaxdp's own accountant alone).

Statistical tolerance: every record's inclusion frequency over R draws is within
:math:`5\\sqrt{p(1-p)/R}` of its probability p (a false alarm per record has probability
below 6e-7; with at most 30 records and 6 schemes, below 1e-4 per run; seeds are fixed).
"""

from __future__ import annotations

import hashlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.stats import binom

import jaxdp.accounting as A
from jaxdp.data import load_digits
from jaxdp.models import SoftmaxRegression
from jaxdp.training import DPSGDMechanism, RunOptions, train
from jaxdp.training import samplers as S

N = 30
DRAWS = 4000

SAMPLERS = {
    "poisson": S.Poisson(0.2),
    "truncated-poisson": S.TruncatedPoisson(4, q=0.2),
    "fixed-size": S.FixedSize(7),
    "fixed-size-replace": S.FixedSize(7, replace=True),
    "balls-in-bins": S.BallsInBins(4),
    "shuffle": S.Shuffle(7),
}


def _draws(sampler, steps):
    """indices, sizes of ``steps`` consecutive steps from one key chain (as the trainer calls it)."""
    def body(key, step):
        key, idx, size = sampler.sample(key, step)
        return key, (idx, size)

    key = sampler.init_key(jax.random.key(1))
    _, (idx, size) = jax.jit(lambda k: jax.lax.scan(body, k, jnp.arange(steps, dtype=jnp.int32)))(key)
    return np.asarray(idx), np.asarray(size)


def _counts(idx, size, n):
    """Per step, how many times each record is in the batch (padding excluded)."""
    valid = np.arange(idx.shape[1])[None, :] < size[:, None]
    out = np.zeros((idx.shape[0], n), np.int64)
    rows = np.repeat(np.arange(idx.shape[0]), idx.shape[1])
    np.add.at(out, (rows[valid.ravel()], idx.ravel()[valid.ravel()]), 1)
    return out


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_shapes_masks_and_marginal_inclusion(name):
    s = SAMPLERS[name].bind(N)
    idx, size = _draws(s, DRAWS)
    assert idx.dtype == np.int32 and size.dtype == np.int32
    assert idx.ndim == 2 and idx.shape[1] >= s.capacity  # one static shape for every step
    assert np.all((idx >= 0) & (idx < N)) and np.all((size >= 0) & (size <= idx.shape[1]))
    counts = _counts(idx, size, N)
    if name not in ("fixed-size-replace",):
        assert counts.max() <= 1  # a record at most once per batch
    # The marginal expected count per record and step (per position in the epoch for the epoch schemes).
    if name == "poisson":
        p = np.full(DRAWS, 0.2)
    elif name == "truncated-poisson":
        k = np.arange(N + 1)
        p = np.full(DRAWS, float(np.sum(np.minimum(k, 4) * binom.pmf(k, N, 0.2))) / N)
    elif name.startswith("fixed-size"):
        p = np.full(DRAWS, 7 / N)
        assert np.all(size == 7)
    elif name == "balls-in-bins":
        p = np.full(DRAWS, 1 / 4)
    else:  # shuffle: batches of 7, 7, 7, 7 and the last 2 of 30
        sizes = np.array([7, 7, 7, 7, 2])
        p = sizes[np.arange(DRAWS) % 5] / N
        assert np.array_equal(size, sizes[np.arange(DRAWS) % 5])
    freq = counts.mean(axis=0)
    mean_p = p.mean()
    var = (7 / N) * (1 - 1 / N) / DRAWS if name == "fixed-size-replace" else mean_p * (1 - mean_p) / DRAWS
    assert np.all(np.abs(freq - mean_p) <= 5 * math.sqrt(var)), (freq, mean_p)
    # The batch the step divides by: the mean batch (shuffle: the full batch b; truncation: q·N, before the cap).
    want = {"shuffle": 7.0, "truncated-poisson": 0.2 * N}.get(name, mean_p * N)
    assert s.expected_batch_size == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["balls-in-bins", "shuffle"])
def test_every_record_exactly_once_per_epoch(name):
    s = SAMPLERS[name].bind(N)
    m = s.steps_per_pass
    idx, size = _draws(s, 3 * m)
    counts = _counts(idx, size, N)
    epochs = counts.reshape(3, m, N)
    assert np.all(epochs.sum(axis=1) == 1)  # each record in exactly one step of every epoch
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh assignment each epoch


def test_k_of_t_each_record_in_exactly_k_steps_uniformly():
    """Random allocation, 2 of 5 steps: every record in exactly 2 steps of each epoch, its pair uniform.

    Chi-square of the 10 possible pairs over 30 records × 40 epochs (1,200 draws, 9
    degrees of freedom): a false alarm at the 33.7 threshold has probability 1e-4. The
    pairs of two records are independent: the 100 joint cells of records 0 and 1 (40
    epochs are too few; pooled over the 15 disjoint record pairs: 600 draws, 99 degrees of
    freedom, threshold 158, false alarm 1e-4).
    """
    from scipy.stats import chi2

    s = S.BallsInBins(5, selected=2).bind(N)
    assert (s.steps_per_pass, s.expected_batch_size, s.spec()["selected"]) == (5, 2 * N / 5, 2)
    epochs = 40
    idx, size = _draws(s, 5 * epochs)
    counts = _counts(idx, size, N).reshape(epochs, 5, N)  # (epoch, step, record)
    assert counts.max() <= 1 and np.all(counts.sum(axis=1) == 2)  # exactly 2 of the 5 steps, each once
    code = {pair: i for i, pair in enumerate((a, b) for a in range(5) for b in range(a + 1, 5))}
    steps = np.argsort(-counts, axis=1, kind="stable")[:, :2, :]  # (epoch, 2, record): the two steps
    pair = np.vectorize(lambda a, b: code[(min(a, b), max(a, b))])(steps[:, 0, :], steps[:, 1, :])  # (epoch, record)
    obs = np.bincount(pair.ravel(), minlength=10)
    expect = pair.size / 10
    assert np.sum((obs - expect) ** 2 / expect) < chi2.ppf(1 - 1e-4, 9), obs
    joint = np.bincount((10 * pair[:, 0::2] + pair[:, 1::2]).ravel(), minlength=100)
    expect = joint.sum() / 100
    assert np.sum((joint - expect) ** 2 / expect) < chi2.ppf(1 - 1e-4, 99), joint
    # The event is random allocation's, k = 1 is balls-in-bins, and the sizes follow k.
    assert repr(s.event(1.3, 12)) == repr(A.random_allocation_event(1.3, 5, 2, 3))
    assert repr(S.BallsInBins(5).bind(N).event(1.3, 12)) == repr(A.balls_in_bins_event(1.3, 5, 3))
    assert "selected" not in S.BallsInBins(5).bind(N).spec()  # k = 1: the spec of before
    assert S.from_spec(s.spec()) == s
    assert S.BallsInBins(selected=3).bind(N, 10).steps_per_pass == 9  # ⌈kN/b⌉: a mean batch of at most b
    with pytest.raises(ValueError, match="selected must be <= steps_per_pass"):
        S.BallsInBins(2, selected=3)
    with pytest.raises(ValueError, match="selected must be an integer >= 1"):
        S.BallsInBins(4, selected=0)


def test_samplers_validate_their_arguments():
    with pytest.raises(ValueError, match="q must be a number in"):
        S.Poisson(1.5)
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        S.TruncatedPoisson(0)
    with pytest.raises(ValueError, match="batch_size must be <= the number of training examples"):
        S.Shuffle(40).bind(N)
    with pytest.raises(ValueError, match="sampler must be one of"):
        S.by_name("cyclic")
    with pytest.raises(ValueError, match="both set the batch"):
        DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, learning_rate=0.1, batch_size=32, sampler=S.Shuffle(16))
    with pytest.raises(ValueError, match="sampler must be a jaxdp.training.samplers sampler"):
        DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, learning_rate=0.1, sampler="shuffle")
    assert S.from_spec(S.FixedSize(3, replace=True).bind(N).spec()) == S.FixedSize(3, replace=True).bind(N)


# ----------------------------------------------------------------------------------------
# Runs on the bundled digits.
# ----------------------------------------------------------------------------------------

QUIET = RunOptions(progress=False)
BATCH = 128  # 1,438 training records: 12 steps per pass


def _hash(res) -> str:
    h = hashlib.sha256()
    for a in jax.tree.leaves(res.state.params):
        h.update(np.asarray(a).tobytes())
    return h.hexdigest()[:16]


def _run(sampler=None, options=QUIET, passes=1, **kw):
    kw = {"noise_multiplier": 1.1, **kw}
    mech = DPSGDMechanism(clip_norm=1.0, learning_rate=0.5, batch_size=BATCH, passes=passes, sampler=sampler, **kw)
    return train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), load_digits(), mech, noise_seed=3, options=options)


# Recorded on main (c1032d6, before samplers; CPU) with _run(passes=2): the parameters' hash, by the
# XLA_FLAGS it ran under (the optimisation level changes the last bits of the floats; the suite's
# default, tests/conftest.py, adds the classic fusion emitters, which give level 0's bits here).
MAIN_POISSON_HASH = {"--xla_backend_optimization_level=0": "15f0a45b80af4a4d", "": "8a777754b9c18792",
                     "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false": "15f0a45b80af4a4d"}


def test_default_poisson_is_unchanged():
    default = _run(passes=2)
    explicit = _run(S.Poisson(), passes=2)
    assert _hash(default) == _hash(explicit)
    assert default.ledger == explicit.ledger and default.ledger.sampler is None
    flags = os.environ.get("XLA_FLAGS", "")
    if jax.default_backend() == "cpu" and flags in MAIN_POISSON_HASH:
        assert _hash(default) == MAIN_POISSON_HASH[flags]
    n = len(load_digits().x_train)
    eps = default.privacy.summary()["worst"]
    assert abs(eps - float(A.dpsgd_epsilon(BATCH / n, 1.1, 2 * math.ceil(n / BATCH), 1e-5))) <= 1e-12 * eps


# Integer orders: dp_accounting's fractional-order series may fail to converge and drop an order.
INT_ORDERS = tuple(float(a) for a in range(2, 257))


def _dpa_epsilon(name, n, nu, steps, steps_per_pass):
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import rdp_privacy_accountant as R

    replace = dpa.NeighboringRelation.REPLACE_ONE
    if name == "poisson":
        acc = R.RdpAccountant(orders=INT_ORDERS)
        ev = dpa.PoissonSampledDpEvent(BATCH / n, dpa.GaussianDpEvent(nu))
    elif name == "fixed-size":
        acc = R.RdpAccountant(orders=INT_ORDERS, neighboring_relation=replace)
        ev = dpa.SampledWithoutReplacementDpEvent(n, BATCH, dpa.GaussianDpEvent(nu / 2))
    else:  # shuffle: one Gaussian of sensitivity 2C per epoch started
        acc = R.RdpAccountant(orders=INT_ORDERS, neighboring_relation=replace)
        ev, steps = dpa.GaussianDpEvent(nu / 2), -(-steps // steps_per_pass)
    acc.compose(dpa.SelfComposedDpEvent(ev, steps))
    return acc.get_epsilon(1e-5)


RUN_SAMPLERS = {
    "poisson": S.Poisson(),
    "truncated-poisson": S.TruncatedPoisson(140),
    "fixed-size": S.FixedSize(),
    "balls-in-bins": S.BallsInBins(),
    "random-allocation-2": S.BallsInBins(selected=2),  # 2 of ⌈2N/b⌉ = 23 steps per epoch
    "shuffle": S.Shuffle(),
}


class _Crash(Exception):
    pass


@pytest.mark.parametrize("name", sorted(RUN_SAMPLERS))
def test_run_reaches_target_reports_its_scheme_and_resumes_bit_identically(name, tmp_path):
    sampler = RUN_SAMPLERS[name]
    target = 3.0
    ck = tmp_path / "ck"

    def crash(state, ledger):
        if int(state.step) >= 17:
            raise _Crash

    opts = dict(checkpoint_dir=str(ck), checkpoint_every=5, steps_per_call=5, progress=False)
    with pytest.raises(_Crash):
        _run(sampler, RunOptions(**opts, callback=crash), passes=2, noise_multiplier=None, target_epsilon=target)
    resumed = _run(sampler, RunOptions(**opts, resume=True), passes=2, noise_multiplier=None, target_epsilon=target)
    whole = _run(sampler, RunOptions(steps_per_call=5, progress=False), passes=2, noise_multiplier=None,
                 target_epsilon=target)
    assert _hash(resumed) == _hash(whole)
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
        a, b = (jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v for v in (a, b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.ledger == whole.ledger

    led, rep = whole.ledger, whole.privacy
    eps = rep.summary()["worst"]
    nu = whole.mechanism.noise_multiplier
    assert 0.98 * target <= eps <= target  # target_epsilon reached, from below
    # The reported ε is the scheme's event's ε (and dp_accounting's where it has the analysis).
    n = led.records
    bound = sampler.bind(n, BATCH)
    assert led.total_steps == 2 * bound.steps_per_pass
    event = bound.event(nu, led.total_steps, n)
    assert eps == pytest.approx(float(A.epsilon(event, 1e-5)), rel=1e-12)
    if name in ("poisson", "fixed-size", "shuffle"):  # the event is the scheme's: dp_accounting's own analysis
        eps_int = float(A.epsilon(event, 1e-5, orders=INT_ORDERS))
        assert eps <= eps_int * (1 + 1e-12)
        assert eps_int == pytest.approx(_dpa_epsilon(name, n, nu, led.total_steps, bound.steps_per_pass), rel=1e-6)
    lines = rep.table().splitlines()
    assert lines[0].startswith("NOT PRIVATE")  # a fixed noise seed
    if name == "shuffle":
        assert "no amplification is certified; ε below is the bound without amplification" in lines[1]
        # and what shuffling costs at least (Chua et al. 2024), below the bound
        low = rep.by_analysis["lower bound, Chua et al. 2024"][0]
        assert 0 < low < eps
        assert float(A.shuffled_lower_epsilon(nu, bound.steps_per_pass, 2, 1e-5)) == low
        assert lines[1].endswith(f"shuffling costs at least epsilon = {low:.4g} here (lower bound, Chua et al. 2024)")
        assert lines[1].startswith("shuffled batches")
        assert "Poisson" not in rep.table()
        assert lines[2].startswith(f"epsilon = {eps:.4g}")
    else:
        assert lines[1].startswith(f"epsilon = {eps:.4g}")
    if name == "balls-in-bins":  # random allocation: amplified, below the same noise without amplification
        assert eps == pytest.approx(float(A.epsilon(A.balls_in_bins_event(nu, bound.steps_per_pass, 2), 1e-5)),
                                    rel=1e-12)
        assert eps < float(A.epsilon(A.shuffled_event(nu, 2), 1e-5))
    if name == "random-allocation-2":  # each record in 2 of the 23 steps of each of the 2 epochs
        assert bound.steps_per_pass == 23 and led.sampler["selected"] == 2
        assert eps == float(A.epsilon(A.random_allocation_event(nu, 23, 2, 2), 1e-5))
    if name != "poisson":
        assert sampler.name in rep.analysis and led.sampler == bound.spec()
    assert (whole.test_accuracy or 0) > 0.1  # it trained


@pytest.mark.parametrize("argv, message", [
    (["--sampler", "fixed-size"], "--sampler fixed-size needs --algorithm dpsgd"),
    (["--algorithm", "dpsbcd", "--sampler", "poisson"], "--sampler poisson needs --algorithm dpsgd or pnsgd"),
    (["--algorithm", "dpsgd", "--sampler", "truncated-poisson"], "needs --max-batch-size"),
    (["--algorithm", "dpsgd", "--max-batch-size", "10"], "needs --max-batch-size"),
    (["--algorithm", "dpsgd", "--sampler", "truncated-poisson", "--max-batch", "0"], "--max-batch-size must be"),
    (["--algorithm", "dpsgd", "--sampler", "cyclic"], "invalid choice: 'cyclic'"),
    (["--algorithm", "dpsgd", "--sampler", "shuffle", "--selected", "2"], "--selected needs --sampler balls-in-bins"),
    (["--algorithm", "dpsgd", "--sampler", "balls-in-bins", "--selected", "0"], "--selected must be an integer >= 1"),
])
def test_command_line_sampler_errors_are_one_line(argv, message, capsys):
    from jaxdp.cli.main import main

    if "invalid choice" in message:  # argparse's own usage error, exit status 2
        with pytest.raises(SystemExit) as exc:
            main(["train", "--smoke", "--plot", "none", *argv])
        assert exc.value.code == 2
    else:
        assert main(["train", "--smoke", "--plot", "none", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    if "invalid choice" not in message:
        assert err == [err[-1]] and err[-1].startswith("jaxdp: error: ")


def test_old_ledgers_read_as_poisson_and_per_instance_refuses_other_schemes():
    from jaxdp.training import CheckpointNorms, DPSGDLedger, per_point_privacy

    led = DPSGDLedger(analysis="dpsgd", reason="", q=0.1, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.1,
                      batch_size=10, records=100, passes=1, steps_per_pass=10, total_steps=10, steps_done=10,
                      capacity=20, delta=1e-5, order_seed=0, fixed_noise_seed=False, max_grad_norm=0.0)
    old = {k: v for k, v in led.to_json().items() if k != "sampler"}  # a ledger written before samplers
    assert DPSGDLedger.from_json(old) == led and repr(led.event()) == repr(A.dpsgd_event(0.1, 1.0, 10))
    shuffled = led._replace(sampler=S.Shuffle(10).bind(100).spec())
    assert DPSGDLedger.from_json(shuffled.to_json()) == shuffled
    assert repr(shuffled.event()) == repr(A.shuffled_event(1.0, 1))
    norms = CheckpointNorms(np.array([0]), np.ones((100, 1)), shuffled)
    with pytest.raises(ValueError, match="per-instance accounting covers Poisson sampling only"):
        per_point_privacy(norms)
