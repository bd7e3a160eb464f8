"""jaxdp's persistent program cache: a later process loads what an earlier one compiled.

Every test uses its own temporary folder (``JAXDP_CACHE_DIR``); no cache is shared
between tests or with the user's. The values are compared with the cache turned off, in
the same process or a fresh one: the cache may change the time of a call, never its value.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxdp.accounting as A
from jaxdp import _program_cache
from jaxdp.accounting import _dpsgd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDERS = [1.5, 2.0, 3.0, 8.0, 32.0]  # a small program: quick to compile

_CHILD = """
import json, sys
import jaxdp.accounting as A
from jaxdp import _program_cache as pc
eps = A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders={orders!r})
ev = A.epsilon(A.dpsgd_event(0.02, 0.9, 300), 1e-6, orders={orders!r})
print(json.dumps({{"eps": float(eps).hex(), "ev": float(ev).hex(), **pc.stats}}))
""".format(orders=ORDERS)


def _child(cache: str) -> dict:
    env = {**os.environ, "JAXDP_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _files(folder) -> list[str]:
    path = os.path.join(folder, "programs")
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """A first process on an empty cache folder, then a second one on what it wrote: both tests
    below read the same two runs (each child costs ~1.7 CPU-s, mostly importing and compiling)."""
    cache = str(tmp_path_factory.mktemp("two_processes") / "cache")
    first = _child(cache)
    files, index = _files(cache), sorted(os.listdir(os.path.join(cache, "index")))
    return cache, first, files, index, _child(cache)


def test_a_second_process_loads_the_programs_and_gets_the_same_bits(two_processes):
    cache, first, files, _, second = two_processes
    assert first["compiled"] == 2 and first["loaded"] == 0
    assert len(files) == 2 and all(f.endswith(".xla") for f in files)
    assert second["loaded"] == 2 and second["compiled"] == 0
    off = _child("off")
    assert off["loaded"] == 0  # compiled in memory only
    for key in ("eps", "ev"):
        assert first[key] == second[key] == off[key]


def test_concurrent_processes_share_a_folder_safely(tmp_path):
    cache = str(tmp_path / "cache")
    env = {**os.environ, "JAXDP_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert len({(o["eps"], o["ev"]) for o in outs}) == 1
    assert len(_files(cache)) == 2  # whole files only: no temporary file left behind
    again = _child(cache)
    assert again["loaded"] == 2 and (again["eps"], again["ev"]) == (outs[0]["eps"], outs[0]["ev"])


def _fresh_memo():
    _dpsgd._dpsgd_epsilon_jit._memo.clear()


def test_a_corrupted_file_is_ignored_and_rewritten(tmp_path, monkeypatch):
    want = float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS))  # conftest: the cache is off
    monkeypatch.setenv("JAXDP_CACHE_DIR", str(tmp_path))
    _fresh_memo()
    before = dict(_program_cache.stats)
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want
    assert _program_cache.stats["compiled"] == before["compiled"] + 1
    (name,) = _files(tmp_path)
    file = tmp_path / "programs" / name
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the executable: its checksum no longer matches
    file.write_bytes(bytes(data))
    _fresh_memo()
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want
    assert _program_cache.stats["compiled"] == before["compiled"] + 2
    _fresh_memo()
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want
    assert _program_cache.stats["loaded"] == before["loaded"] + 1  # the rewritten file


def test_traced_calls_go_to_jit_and_jax_settings_are_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDP_CACHE_DIR", str(tmp_path))
    settings = dict(jax.config.values)
    f = lambda s: A.dpsgd_epsilon(0.01, s, 1000, 1e-5, orders=ORDERS)  # noqa: E731
    eager = float(f(np.float32(1.1)))  # what jit passes with x64 off
    before = _program_cache.stats["bypassed"]
    assert float(jax.jit(f)(1.1)) == eager
    g = jax.grad(f)(1.1)
    assert np.isfinite(g) and g < 0
    assert _program_cache.stats["bypassed"] > before
    assert dict(jax.config.values) == settings


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDP_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _program_cache.cache_dir() is None
    _fresh_memo()
    A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)
    assert not any(tmp_path.iterdir())
    monkeypatch.delenv("JAXDP_CACHE_DIR")
    assert _program_cache.cache_dir() == os.path.join(str(tmp_path), "jaxdp", "programs")


def test_a_warm_process_loads_without_tracing_and_gets_the_same_bits(two_processes):
    _, first, _, index, second = two_processes
    assert first["untraced"] == 0
    assert len(index) == 2  # one entry per program, beside programs/
    assert second["untraced"] == 2 and second["loaded"] == 2 and second["compiled"] == 0
    assert (first["eps"], first["ev"]) == (second["eps"], second["ev"])


def test_the_untraced_key_follows_the_source_and_falls_back_on_doubt(tmp_path, monkeypatch):
    want = float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS))  # conftest: the cache is off
    monkeypatch.setenv("JAXDP_CACHE_DIR", str(tmp_path))
    _fresh_memo()
    before = dict(_program_cache.stats)
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want  # compiled, indexed
    _fresh_memo()
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want
    assert _program_cache.stats["untraced"] == before["untraced"] + 1
    # Other source code: another key, so the call traces (and finds the same program by its module).
    monkeypatch.setattr(_program_cache, "_source_digest", lambda: b"edited")
    _fresh_memo()
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want
    assert _program_cache.stats["untraced"] == before["untraced"] + 1
    assert _program_cache.stats["loaded"] == before["loaded"] + 2 and _program_cache.stats["compiled"] == before[
        "compiled"] + 1
    # An entry whose program file is gone: traced and compiled again, never a wrong program.
    for name in os.listdir(tmp_path / "programs"):
        os.remove(tmp_path / "programs" / name)
    _fresh_memo()
    assert float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders=ORDERS)) == want
    assert _program_cache.stats["compiled"] == before["compiled"] + 2


def test_no_untraced_key_for_foreign_tree_nodes_or_addresses():
    import jax.numpy as jnp
    from jax._src import config

    class Foreign:  # a user's pytree class: its code is not in jaxdp's digest
        pass

    jax.tree_util.register_pytree_node(Foreign, lambda x: ((), None), lambda aux, ch: Foreign())
    aval = (jax.typeof(jnp.ones(2)),)
    context = config.trace_context()
    own = jax.tree_util.tree_structure(((A.dpsgd_event(0.1, 1.0, 10), 1.0), {}))
    assert _program_cache._index_key(jax, "x", ((0, (1.5, 2.0)),), own, aval, context) is not None
    foreign = jax.tree_util.tree_structure(((Foreign(), 1.0), {}))
    assert _program_cache._index_key(jax, "x", (), foreign, aval, context) is None
    assert _program_cache._index_key(jax, "x", ((0, object()),), own, aval, context) is None



_WITH_JAX_CACHE = """
import json, os, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import jaxdp.accounting as A
from jaxdp import _program_cache as pc

def eps():
    return float(A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5, orders={orders!r})).hex()

out = {{}}
if sys.argv[3] == "fill":
    os.environ["JAXDP_CACHE_DIR"] = "off"
    out["eps"] = eps()  # jax.jit: compiled and put in JAX's cache
    os.environ["JAXDP_CACHE_DIR"] = sys.argv[2]
    out["beside"] = eps()  # JAX's cache is configured: jaxdp's steps aside and writes nothing
    out["files"] = sorted(os.listdir(sys.argv[2])) if os.path.isdir(sys.argv[2]) else []
else:
    os.environ["JAXDP_CACHE_DIR"] = sys.argv[2]
    pc._jax_cache_on = lambda: False  # as if JAX's cache had gone unnoticed:
    out["eps"] = eps()  # "write": JAX's cache serves the program, jaxdp serialises and writes it;
    # "read": that file loads, but its first run fails: it is removed and jax.jit answers
    out["files"] = sorted(os.listdir(os.path.join(sys.argv[2], "programs")))
print(json.dumps({{**out, **pc.stats}}))
""".format(orders=ORDERS)


def _with_jax_cache(tmp_path, step: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _WITH_JAX_CACHE, str(tmp_path / "jax"), str(tmp_path / "jaxdp"), step],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_with_jax_own_persistent_cache_configured_jaxdp_steps_aside(tmp_path):
    """JAX's persistent compilation cache on (``jax_compilation_cache_dir``): jaxdp's cache writes
    nothing and the answer is jax.jit's (an executable JAX loaded from its cache serialises to a
    program that fails in another process with ``NOT_FOUND: Function ... not found``)."""
    fill = _with_jax_cache(tmp_path, "fill")
    assert fill["eps"] == fill["beside"]
    assert fill["files"] == [] and fill["loaded"] == 0


def test_a_loaded_program_whose_first_run_fails_is_removed(tmp_path):
    """Where JAX's cache goes unnoticed, the program serialised from an executable it loaded is
    written; in a fresh process it loads, its first run fails, the file is removed and jax.jit
    answers (three processes: in the fast suite, the step-aside test above)."""
    fill, write, read = (_with_jax_cache(tmp_path, step) for step in ("fill", "write", "read"))
    assert fill["eps"] == write["eps"] == read["eps"]
    assert write["compiled"] == 1 and len(write["files"]) == 1
    assert read["loaded"] == 1 and read["discarded"] == 1 and read["files"] == []


def test_compiler_options_change_no_bits_and_apply_with_the_cache_off(monkeypatch):
    """The accountants' CPU compiler options (classic fusion emitters: faster to compile) give the
    bits of XLA's defaults (the full comparison: benchmarks/compile_times.py --check-bits), and
    eager calls use them with the cache off too, so no value depends on the cache."""
    monkeypatch.setenv("JAXDP_CACHE_DIR", "off")
    f = lambda: np.asarray(A.dpsgd_epsilon([0.001, 0.01, 0.3], [[0.7], [1.1], [4.0]], 1000, 1e-5, orders=ORDERS))  # noqa: E731
    _fresh_memo()
    before = _program_cache.stats["compiled"]
    with_options = f()
    assert _program_cache.stats["compiled"] == before + 1  # compiled by the cache's path, kept in memory
    monkeypatch.setattr(_program_cache, "_CPU_OPTIONS", {})
    _fresh_memo()
    defaults = f()
    _fresh_memo()
    np.testing.assert_array_equal(with_options.view(np.uint64), defaults.view(np.uint64))
    assert np.all(np.isfinite(with_options))


# prepare: the programs of a chain compiled at once (threads), each call then finds its own.
@_program_cache.persistent("test_first")
@jax.jit
def _first(x, y):
    return {"s": jax.numpy.sin(x) * y, "n": jax.numpy.cos(x).sum()}


@_program_cache.persistent("test_second", static_argnames=("k",))
@functools.partial(jax.jit, static_argnames=("k",))
def _second(s, n, k):
    return jax.numpy.exp(s[:k]) + n


def _chain(x, y, k):
    out = _first(x, y)
    return _second(out["s"], out["n"], k=k)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint64 if x.dtype.itemsize == 8 else np.uint32)


@pytest.mark.parametrize("cache", ["off", "folder"])
def test_prepare_compiles_each_program_once_and_changes_no_bit(tmp_path, monkeypatch, cache):
    monkeypatch.setenv("JAXDP_CACHE_DIR", "off" if cache == "off" else str(tmp_path))
    monkeypatch.setattr(_program_cache, "_cores", lambda: 2)
    _program_cache.clear_memory()
    x = np.linspace(0.0, 3.0, 7)
    with jax.enable_x64(True):  # the caller's x64 scope, which the compile threads take on
        want = jax.jit(lambda x, y: _chain(x, y, 5))(x, 2.0)  # traced: jax.jit's programs
        before = dict(_program_cache.stats)
        _program_cache.prepare(_chain, x, 2.0, k=5)
        jobs = [*_first._ahead.values(), *_second._ahead.values()]
        assert len(jobs) == 2 and all(job.result()[0] is not None for job in jobs)  # compiled in their threads
        got = _chain(x, 2.0, k=5)
        assert got.dtype == np.float64
        assert _program_cache.stats["compiled"] == before["compiled"] + 2  # each compiled once, in its thread
        assert not _first._ahead and not _second._ahead  # every prepared program taken by its call
        np.testing.assert_array_equal(_bits(got), _bits(want))
        _program_cache.prepare(_chain, x, 2.0, k=5)  # in memory now: nothing to prepare
        assert _program_cache.stats["compiled"] == before["compiled"] + 2 and not _second._ahead
        if cache == "folder":  # a warm start: loaded (untraced) while planning, same bits
            _program_cache.clear_memory()
            _program_cache.prepare(_chain, x, 2.0, k=5)
            np.testing.assert_array_equal(_bits(_chain(x, 2.0, k=5)), _bits(want))
            assert _program_cache.stats["untraced"] == before["untraced"] + 2
            assert _program_cache.stats["compiled"] == before["compiled"] + 2


def test_prepare_stops_where_it_cannot_plan_and_the_calls_run_as_usual(monkeypatch):
    monkeypatch.setenv("JAXDP_CACHE_DIR", "off")
    monkeypatch.setattr(_program_cache, "_cores", lambda: 2)
    _program_cache.clear_memory()
    x = np.linspace(0.0, 3.0, 6)

    def computed(x, y, k):  # a computation on a planned result: planning stops there
        out = _first(x, y)
        return _second(out["s"] * 2.0, out["n"], k=k)

    before = _program_cache.stats["compiled"]
    _program_cache.prepare(computed, x, 2.0, k=3)
    assert len(_first._ahead) == 1 and not _second._ahead
    got = computed(x, 2.0, k=3)
    assert _program_cache.stats["compiled"] == before + 2 and not _first._ahead
    np.testing.assert_array_equal(_bits(got), _bits(jax.jit(lambda x: computed(x, 2.0, 3))(x)))
    # Under the caller's jit: nothing prepared; on a single core neither.
    jax.jit(lambda x: _program_cache.prepare(_chain, x, 2.0, k=3) or _chain(x, 2.0, k=3))(x)
    assert not _first._ahead and not _second._ahead
    monkeypatch.setattr(_program_cache, "_cores", lambda: 1)
    _program_cache.prepare(_chain, x + 1.0, 2.0, k=3)
    assert not _first._ahead and not _second._ahead


def test_a_prepared_compile_needs_the_callers_whole_configuration(monkeypatch):
    """A scoped JAX setting the compile thread does not take on: the call compiles as usual."""
    monkeypatch.setenv("JAXDP_CACHE_DIR", "off")
    monkeypatch.setattr(_program_cache, "_cores", lambda: 2)
    _program_cache.clear_memory()
    x = np.linspace(0.0, 3.0, 5)
    before = _program_cache.stats["compiled"]
    with jax.default_matmul_precision("highest"):
        _program_cache.prepare(_chain, x, 2.0, k=2)
        job = _first._ahead[next(iter(_first._ahead))]
        assert job.result() == (None, ())  # refused in the thread
        got = _chain(x, 2.0, k=2)
    assert _program_cache.stats["compiled"] == before + 2
    np.testing.assert_array_equal(_bits(got), _bits(jax.jit(lambda x: _chain(x, 2.0, 2))(x)))


# Quick programs: a call its function marks quick is compiled at XLA's optimisation level 0 too.
@_program_cache.persistent("test_quick", quick=lambda x: np.size(x) <= 4)
@jax.jit
def _quick_fn(x):
    return jax.numpy.exp(x) * 2.0


def test_quick_calls_compile_at_level_0_under_their_own_key(monkeypatch):
    monkeypatch.setenv("JAXDP_CACHE_DIR", "off")
    seen = []
    real = _program_cache._compile
    monkeypatch.setattr(_program_cache, "_compile", lambda jax_, lowered, quick=False: seen.append(quick) or real(jax_, lowered, quick))
    _program_cache.clear_memory()
    small, large = _quick_fn(np.arange(3.0)), _quick_fn(np.arange(9.0))
    assert seen == [True, False]
    np.testing.assert_allclose(np.asarray(small), 2 * np.exp(np.arange(3.0)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(large), 2 * np.exp(np.arange(9.0)), rtol=1e-6)
    if jax.devices()[0].platform == "cpu":
        assert _program_cache._options(jax, True)["xla_backend_optimization_level"] == 0
        assert "xla_backend_optimization_level" not in _program_cache._options(jax, False)
        assert _program_cache._environment(jax, True) != _program_cache._environment(jax, False)  # disk keys differ


def test_pld_quick_is_one_small_evaluation():
    from jaxdp.accounting._pld import _quick

    one = np.float64(0.5)
    assert _quick((), (), 2**14, 1e-15, "upper", "epsilon", one, one)
    assert _quick((), (), 2**14, 1e-15, "upper", "epsilon", np.ones(16), one)
    assert not _quick((), (), 2**14, 1e-15, "upper", "epsilon", np.ones(17), one)
    assert not _quick((), (), 2**19, 1e-15, "upper", "epsilon", one)
    assert _quick((), (), 2**14, 1e-15, "upper", "epsilon", jax.ShapeDtypeStruct((4,), np.float64), np.ones((2, 1)))
