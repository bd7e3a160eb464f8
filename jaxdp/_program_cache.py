"""jaxdp's persistent cache of compiled accountant programs: on by default, JAX's settings untouched.

A fresh process that asks for one ε spends most of its time in XLA compiling the
accountant's program (about 3 s of the first ``dpsgd_epsilon`` call on the project's
2-core VM; tracing and lowering take 0.4 s). The public accountants' compiled programs are
therefore kept on disk and loaded by later processes (about 0.07 s), without the user
turning on JAX's persistent compilation cache (a global setting this module never
changes).

How a call is served. :func:`persistent` wraps a module-level ``jax.jit`` function. A call
whose arguments are all concrete (no tracer: the wrapped function is not inside the
caller's ``jit``, ``vmap`` or ``grad``), on a single-device backend, with ``disable_jit``
and the NaN/Inf debug checks off, looks its argument signature up in memory (static
arguments, pytree structure, shapes, dtypes, weak types and JAX's trace context); on a
miss it traces and lowers the function as ``jax.jit`` would, and looks for the lowered
program on disk under a SHA-256 key of

* the lowered StableHLO module (bytecode): the whole program, constants included;
* the jax and jaxlib versions, the backend platform and platform version, the device kind,
  the machine and its CPU feature flags (an executable uses the instructions of the CPU
  it was compiled for), the Python version, ``XLA_FLAGS``;
* every global JAX configuration value (compiler options among them) and the per-program
  compiler options below.

A file is used only if its SHA-256 checksum matches (a torn or corrupted file is ignored
and rewritten); otherwise the program is compiled (``lowered.compile()``, what ``jax.jit``
does, with the compiler options below) and written.

Compiler options. On CPU the programs are compiled with XLA's classic fusion emitters
(``xla_cpu_use_fusion_emitters=False``, per program: JAX's settings are untouched). For these
programs of many small scalar fusions they compile in 25-40 % less CPU time than the
default MLIR emitters and give the same bits (every public accountant, gradients included,
compared value by value: the repository's compile-time benchmark with ``--check-bits``). So that a value never
depends on whether a disk cache is on, concrete eager calls are compiled this way with the
cache off too (``JAXDP_CACHE_DIR=off``, JAX's cache configured, a folder that is not ours):
the program is then kept in memory only (64 signatures per function;
:func:`clear_memory` drops them).

Quick programs. A function may mark some of its calls quick (``persistent(..., quick=...)``, a
test on static arguments and shapes: the PLD accountant's calls of at most 2^18 configurations ×
grid bins, e.g. one ε at the default grid). Those are compiled on CPU at XLA's backend
optimisation level 0 as well: most of such a program's compile time is LLVM's optimisation
passes, which a program run once or a few times does not repay (the PLD's first answer: 2.3 →
1.5 s in a fresh process; each later call ~10 ms slower). Level 0 keeps IEEE arithmetic but
not the optimised program's instruction order, so such a value may differ from the same
call's under ``jax.jit`` (or a larger batch's) in its last bits (≤ 1e-9 relative on the PLD's
event families, both ways); every certified bound holds for either, since its round-off
analysis bounds any order of the operations. The test suite compiles every program at level 0.

A warm process skips tracing too. Tracing and lowering cost about 0.2 s of a warm first
call (as much as importing ``jaxdp.accounting``), so each program written also gets an
index entry under a second key computed before tracing: the argument signature above
(static arguments, tree structure with its node types and their static data, abstract
values, trace context), the environment part above, the versions of NumPy and SciPy (the
programs' constants are computed with them) and a SHA-256 digest of the source of every
module of the installed ``jaxdp`` package (the code that is traced). The entry names the
program file and holds its argument and result tree structures (pickled). A call whose
signature has such an entry loads that program without tracing; any doubt (a static
argument that is not a plain number, string or tuple of them, a tree node type from
outside ``jaxdp``, a representation with an object address, an entry or program file that
is missing, torn or fails to load) falls back to the path above, which traces and keys the
lowered module itself. Code changed in memory rather than on disk (a monkeypatched jaxdp
function) is not in the digest: turn the cache off (``JAXDP_CACHE_DIR=off``) to trace it.

Any other call (traced arguments, several devices, a program with hoisted constants, any
error of the cache itself) runs the ``jax.jit`` function unchanged, so the cache can make a
call faster but never change its value: the same module compiled with the same compiler
gives the same executable, and an index entry names the program that the same source,
library versions and signature traced to.

JAX's own persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, or
``jax.config.update("jax_compilation_cache_dir", ...)``; the ``jaxdp`` command turns it on for
``train``, ``grid``, ``audit`` and ``per-instance``): while it is configured (or has been set
up in this process), this cache steps aside (nothing read or written; programs compiled as
above and kept in memory) and JAX's does the job (each process then traces and lowers, and
loads from JAX's folder). The reason: an executable that JAX loaded from its
cache serialises to bytes that load in another process but fail when run (``JaxRuntimeError:
NOT_FOUND: Function multiply_divide_fusion.1 not found``, jax 0.10 on CPU), and
``lowered.compile()`` cannot tell whether it compiled or loaded. As a second guard, a program
loaded from this cache is trusted only once its first run completes: if that run raises, its
file and index entry are removed and the call goes to ``jax.jit`` (this also clears such files
written by earlier versions).

Programs prepared ahead. An accountant that runs several programs in turn, each on the
previous ones' results (``pnsgd_privacy``: setup, shifted-interpolation μ, inversions), can
have them all compiled at once with :func:`prepare`: the chain is first run in a planning
mode where each call traces and lowers its program on the caller's thread and hands it to
a thread of its own that loads it from this cache or compiles it (and writes it), returning
only its result's shapes to the next call; XLA releases Python's lock while compiling, so
the next program's tracing and, on several cores, the compilations overlap. Each call then
takes its program from its thread, under the same signature as above. The lowering is the
call's own (the same bytes, so the same key) and the compile thread takes the caller's x64
scope and compiles only if every JAX setting is then the caller's (else the call compiles
as usual): no value depends on whether a program was prepared.

Where: ``$JAXDP_CACHE_DIR/programs`` (the index entries in ``…/index`` beside it) if
``JAXDP_CACHE_DIR`` is set, else
``$XDG_CACHE_HOME/jaxdp/programs`` (``~/.cache/jaxdp/programs``; on Windows under
``%LOCALAPPDATA%``). ``JAXDP_CACHE_DIR=off`` (or ``0``, ``none``, ``false``, empty)
turns it off; it is read at every call. The folder is created private (mode 0700), a
folder owned by another user is not used, and the cache is capped at 256 MiB (the oldest
entries go first).

Concurrent processes: each file is written to a temporary name in the same folder and
renamed into place (atomic), so a reader sees a whole file or none; two processes that
compile the same program both write the same bytes. Eviction takes a file lock
(``filelock``). A loaded executable runs code from the cache folder, as a JAX
persistent-cache entry or a ``__pycache__`` file does: the folder is the user's own.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import platform
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["cache_dir", "clear_memory", "persistent", "prepare", "stats"]

_OFF = ("", "0", "off", "no", "none", "false")
_MAGIC = b"jaxdp-program-1\n"
_INDEX_MAGIC = b"jaxdp-index-1\n"
_MAX_BYTES = 256 * 2**20
_MEMO_SIZE = 64
_SUFFIX = ".xla"

# Counters for tests and benchmarks: programs loaded from disk, compiled and written, and
# calls that went straight to jax.jit.
stats = {"loaded": 0, "compiled": 0, "bypassed": 0, "untraced": 0, "discarded": 0}
# ("untraced" counts the loads that skipped tracing through the index; they count as loaded too.
# "discarded" counts loaded programs whose first run failed: removed from disk, call sent to jax.jit.)


def cache_dir() -> str | None:
    """The folder of the persistent program cache, or ``None`` when it is turned off."""
    choice = os.environ.get("JAXDP_CACHE_DIR")
    if choice is not None and choice.strip().lower() in _OFF:
        return None
    if choice:
        root = choice
    else:
        base = os.environ.get("XDG_CACHE_HOME")
        if not base and sys.platform == "win32":
            base = os.environ.get("LOCALAPPDATA")
        base = base or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "jaxdp")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "programs")


@functools.cache
def _usable_dir(path: str) -> bool:
    """Create ``path`` (private) once per process; False if it is not ours or not writable."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return False
        return os.access(path, os.W_OK)
    except OSError:
        return False


@functools.cache
def _machine() -> bytes:
    """The machine part of the key: architecture and CPU feature flags (Linux), Python."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}|{sys.version}".encode()


# XLA options for the accountants' programs on CPU: the classic (elemental IR) fusion emitters.
# They compile these scalar-heavy programs in 25-40 % less CPU time than the MLIR fusion
# emitters (jax 0.10; dpsgd_epsilon 1.5 → 1.1 CPU-s, calibrate_noise_multiplier 3.5 → 2.1,
# pnsgd_privacy 6.2 → 4.4), and give the same bits (13,414 values of every public accountant,
# gradients included: the compile-time benchmark's --check-bits). An XLA that no longer knows
# an option compiles without (once per process).
_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_options_ok = [True]


# A program that its function marks quick (``persistent(..., quick=...)``: one small
# evaluation, compiled to run once or a few times) is compiled at XLA's backend optimisation
# level 0 on CPU as well: LLVM's optimisation passes are most of its compile time.
_QUICK_OPTIONS = {"xla_backend_optimization_level": 0}


def _options(jax, quick: bool = False) -> dict | None:
    """The compiler options of the accountants' programs on this backend (None: XLA's defaults)."""
    if not _options_ok[0] or jax.devices()[0].platform != "cpu":
        return None
    opts = {**_CPU_OPTIONS, **_QUICK_OPTIONS} if quick else dict(_CPU_OPTIONS)
    return opts or None


def _compile(jax, lowered, quick: bool = False):
    """``lowered.compile()`` with :data:`_CPU_OPTIONS` on CPU (and :data:`_QUICK_OPTIONS` for a quick
    program); without them where XLA refuses them."""
    opts = _options(jax, quick)
    if opts is None:
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=opts)
    except Exception:
        _options_ok[0] = False
        return lowered.compile()


def _jax_cache_on() -> bool:
    """True where JAX's own persistent compilation cache is configured, or was set up in this process.

    An executable that JAX loaded from its cache serialises to bytes that load but fail when run
    (``NOT_FOUND: Function ... not found``, jax 0.10 on CPU), so jaxdp's cache steps aside then.
    Any doubt (an internal name that moved) counts as on: stepping aside never changes a value.
    """
    try:
        from jax._src import compilation_cache as _cc
        from jax._src import config as _config

        if _config.enable_compilation_cache.value and _config.compilation_cache_dir.value is not None:
            return True
        return getattr(_cc, "_cache", None) is not None  # set up earlier (a folder since unset)
    except Exception:
        return True


def _environment(jax, quick: bool = False) -> bytes:
    import jaxlib

    dev = jax.devices()[0]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    parts = (jax.__version__, jaxlib.__version__, dev.client.platform, dev.client.platform_version, dev.device_kind,
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), repr(config),
             repr(sorted((_options(jax, quick) or {}).items())))
    return "\0".join(parts).encode() + b"\0" + _machine()


def _program(lowered) -> bytes:
    from jax._src.interpreters import mlir

    return mlir.module_to_bytecode(lowered.compiler_ir("stablehlo"))


@functools.cache
def _source_digest() -> bytes:
    """SHA-256 of every ``.py`` and ``.npy`` file of the installed jaxdp package (path and
    content) and of the NumPy and SciPy versions: what a traced program depends on besides JAX
    and its inputs (the ``.npy`` is the RDP plans' log-gamma table)."""
    import numpy
    import scipy

    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(f"{numpy.__version__}|{scipy.__version__}".encode())
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".npy")):
                file = os.path.join(folder, name)
                h.update(os.path.relpath(file, root).encode() + b"\0")
                with open(file, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.digest()


_PLAIN = (str, int, float, bool, type(None))


def _plain(value) -> bool:
    """A static argument whose ``repr`` says all there is to it (numbers, strings, tuples of them)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return type(value) in _PLAIN


def _own_nodes(treedef) -> bool:
    """Every node of the tree is a built-in container or a jaxdp class (whose code is in the digest)."""
    data = treedef.node_data()
    if data is None:
        return True
    kind = data[0]
    if kind not in (tuple, list, dict) and not getattr(kind, "__module__", "").startswith("jaxdp."):
        return False
    return all(_own_nodes(child) for child in treedef.children())


def _stable_repr(value) -> str:
    """``repr``, with slotted objects (JAX's axis environment in the trace context) shown by their
    fields instead of their address; anything else with an address stays as it is (and is refused)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(_stable_repr(v) for v in value) + ")"
    text = repr(value)
    slots = getattr(type(value), "__slots__", None)
    if " at 0x" in text and slots:
        fields = ", ".join(f"{k}={_stable_repr(getattr(value, k, None))}" for k in slots if k != "__weakref__")
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    return text


def _index_key(jax, name: str, static, treedef, avals, context) -> str | None:
    """The key of a call computed before tracing (see the module), or None where unsure."""
    try:
        if not _plain(static) or not _own_nodes(treedef):
            return None
        text = repr((name, static, str(treedef), tuple(repr(a) for a in avals), _stable_repr(context)))
        if " at 0x" in text:  # an object's address: not the same in another process
            return None
        return hashlib.sha256(_environment(jax) + b"\0" + _source_digest() + b"\0" + text.encode()).hexdigest()
    except Exception:
        return None


_ALL: weakref.WeakSet = weakref.WeakSet()


def clear_memory() -> None:
    """Drop the compiled programs every wrapped function keeps in memory (``jax.clear_caches``
    does not reach them); the disk cache is untouched."""
    for fn in list(_ALL):
        with fn._lock:
            fn._memo.clear()
            fn._ahead.clear()


class _Persistent:
    """A ``jax.jit`` function whose eager calls use the persistent cache (see the module)."""

    def __init__(self, jitted: Callable, name: str, static_argnums: tuple[int, ...], static_argnames: tuple[str, ...],
                 quick: Callable[..., bool] | None = None):
        self._jitted = jitted
        self._name = name
        self._quick = quick
        self._static_argnums = frozenset(static_argnums)
        self._static_argnames = frozenset(static_argnames)
        self._memo: OrderedDict = OrderedDict()
        self._ahead: OrderedDict = OrderedDict()  # signature -> _Job (see prepare)
        self._lock = threading.Lock()
        functools.update_wrapper(self, jitted)
        _ALL.add(self)

    # Anything the library does with the jitted function besides calling it (lower, trace,
    # eval_shape) goes to jax.jit.
    def __getattr__(self, name):
        return getattr(self._jitted, name)

    def __call__(self, *args, **kwargs):
        if "jax" not in sys.modules:
            return self._jitted(*args, **kwargs)
        import jax

        if getattr(_planning, "on", False):
            return self._plan(jax, args, kwargs)
        key = self._signature(jax, args, kwargs)
        if key is None:
            _count("bypassed")
            return self._jitted(*args, **kwargs)
        signature, path, index_args, dyn_args, dyn_kwargs = key
        with self._lock:
            compiled = self._memo.get(signature)
            if compiled is not None:
                self._memo.move_to_end(signature)
            job = self._ahead.pop(signature, None) if compiled is None else None
        if compiled is not None:
            return compiled(*dyn_args, **dyn_kwargs)
        # Prepared ahead (see prepare): its program, compiled or loaded; if that failed, as usual.
        compiled, files = (None, ()) if job is None else job.result()
        if compiled is None:
            index = None if path is None else _index_key(jax, self._name, *index_args)
            compiled, files = self._load_or_compile(jax, path, args, kwargs, index)
        if compiled is None:
            _count("bypassed")
            return self._jitted(*args, **kwargs)
        out = compiled(*dyn_args, **dyn_kwargs)
        if files:  # loaded from disk: trusted once its first run completes
            try:
                jax.block_until_ready(out)
            except Exception:  # e.g. a program serialised from an executable JAX's cache had loaded
                _count("discarded")
                for file in files:
                    try:
                        os.remove(file)
                    except OSError:
                        pass
                return self._jitted(*args, **kwargs)
        with self._lock:
            self._memo[signature] = compiled
            while len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        return out

    def _signature(self, jax, args, kwargs):
        """``(signature, path, index_args, dyn_args, dyn_kwargs)`` of an eager call, or None to go
        to jax.jit (traced arguments, several devices, an unhashable static argument...).

        The signature keys the memory cache: the folder, static arguments, tree structure,
        abstract values and JAX's trace context. Leaves may be ``jax.ShapeDtypeStruct``s (a
        call planned ahead): their abstract values are those of arrays of that shape and type.
        """
        path = cache_dir()
        dyn_args = tuple(a for i, a in enumerate(args) if i not in self._static_argnums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        if (any(isinstance(x, jax.core.Tracer) for x in leaves) or jax.config.jax_disable_jit
                or jax.config.jax_debug_nans or jax.config.jax_debug_infs or jax.device_count() != 1):
            return None
        # On disk only where the folder is usable and JAX's own persistent cache is not
        # configured; otherwise compiled here (with the compiler options) and kept in memory.
        if path is not None and (_jax_cache_on() or not _usable_dir(path)):
            path = None
        try:
            from jax._src import config as _config

            static = (tuple((i, args[i]) for i in sorted(self._static_argnums) if i < len(args)),
                      tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_argnames)))
            # str(treedef) names the classes: tree structures of two pytree classes with the
            # same fields can compare equal (JAX's register_dataclass; see jaxdp._pytree).
            avals = tuple(jax.typeof(x) for x in leaves)
            context = _config.trace_context()
            signature = (path, static, treedef, str(treedef), avals, context)
            hash(signature)
        except Exception:  # an unhashable static argument, an internal API that moved
            return None
        return signature, path, (static, treedef, avals, context), dyn_args, dyn_kwargs

    def _plan(self, jax, args, kwargs):
        """A call inside :func:`prepare`: start this program's compilation (or load it) and return
        the shapes of its result, a tree of ``jax.ShapeDtypeStruct``; :class:`_Stop` where unsure."""
        key = self._signature(jax, args, kwargs)
        if key is None:
            raise _Stop
        signature, path, index_args, _, _ = key
        with self._lock:
            compiled = self._memo.get(signature)
            job = self._ahead.get(signature)
        if compiled is not None:
            return compiled.out_info
        if job is not None:
            return job.out_info
        index = None if path is None else _index_key(jax, self._name, *index_args)
        entry = self._entry(path, index)
        _planning.on = False  # persistent calls made while tracing this program are real calls
        try:
            job = self._start(jax, path, args, kwargs, index, entry)
        finally:
            _planning.on = True
        with self._lock:
            self._ahead[signature] = job
            while len(self._ahead) > _MEMO_SIZE:
                self._ahead.popitem(last=False)
        return job.out_info

    def _start(self, jax, path, args, kwargs, index, entry):
        """The :class:`_Job` of a planned call (see :meth:`_plan`)."""
        if entry is not None and os.path.exists(entry):
            # Warm: loaded here, untraced, as the call itself would (a job already done).
            job = _Job(None)
            job.done = self._load_or_compile(jax, path, args, kwargs, index)
            if job.done[0] is None:
                raise _Stop
            job.out_info = job.done[0].out_info
        else:
            # Traced and lowered here (this thread's JAX configuration, x64 scope included);
            # loaded or compiled, and written, in a thread of its own.
            lowered = self._jitted.trace(*args, **kwargs).lower()
            job = _Job(lowered.out_info)
            job.start(self, jax, path, lowered, entry, self._is_quick(args, kwargs))
        return job

    def _entry(self, path: str | None, index: str | None) -> str | None:
        """The index entry's file of a call keyed ``index`` (None: no index)."""
        return None if index is None else os.path.join(os.path.dirname(path), "index", f"{self._name}-{index[:48]}")

    def _load_or_compile(self, jax, path: str | None, args, kwargs, index: str | None = None):
        """The compiled program and, if it was loaded from disk, the files it came from (removed
        if its first run fails); ``(None, ())`` to use jax.jit. ``path`` None: compile, no disk."""
        entry = self._entry(path, index)
        if entry is not None:
            compiled, file = _read_untraced(jax, entry, path)
            if compiled is not None:
                _count("loaded")
                _count("untraced")
                return compiled, (entry, file)
        try:
            lowered = self._jitted.lower(*args, **kwargs)
        except Exception:
            return None, ()
        return self._from_lowered(jax, path, lowered, entry, self._is_quick(args, kwargs))

    def _is_quick(self, args, kwargs) -> bool:
        """Whether this call's program is compiled as a quick one (see :func:`persistent`)."""
        if self._quick is None:
            return False
        try:
            return bool(self._quick(*args, **kwargs))
        except Exception:
            return False

    def _from_lowered(self, jax, path: str | None, lowered, entry: str | None, quick: bool = False):
        """The second half of :meth:`_load_or_compile`: the lowered program loaded from disk, or
        compiled (and written); also run by :func:`prepare`'s background threads."""
        try:
            if getattr(lowered._lowering, "const_args", None) != []:  # constants outside the module: not keyed
                return None, ()
            if path is None:
                _count("compiled")
                return _compile(jax, lowered, quick), ()
            key = hashlib.sha256(_environment(jax, quick) + b"\0" + _program(lowered)).hexdigest()
            trees = (jax.tree_util.tree_structure(lowered.args_info), lowered.out_tree)
        except Exception:
            return None, ()
        file = os.path.join(path, f"{self._name}-{key[:48]}{_SUFFIX}")
        compiled = _read(jax, file, *trees)
        if compiled is not None:
            _count("loaded")
            loaded = (file,) if entry is None else (file, entry)
        else:
            compiled = _compile(jax, lowered, quick)
            _count("compiled")
            loaded = ()
            if not _write(file, compiled, path):
                return compiled, loaded
        if entry is not None:
            _write_entry(entry, os.path.basename(file), trees)
        return compiled, loaded


def _count(name: str) -> None:
    """``stats[name] += 1`` under a lock (prepare's threads count too)."""
    with _stats_lock:
        stats[name] += 1


_stats_lock = threading.Lock()

# Programs prepared ahead (see prepare).
_planning = threading.local()  # .on: this thread is running a chain in prepare's planning mode


class _Stop(Exception):
    """A planned call that cannot be prepared: planning stops, the calls run as usual."""


class _Job:
    """One program being loaded or compiled in a background thread for :func:`prepare`."""

    def __init__(self, out_info):
        self.out_info = out_info
        self.done = None
        self._thread = None

    def start(self, fn: _Persistent, jax, path, lowered, entry, quick: bool = False) -> None:
        x64 = bool(jax.config.jax_enable_x64)
        environment = _environment(jax)

        def work():
            try:
                # The compile reads JAX's configuration, whose scoped values are per thread:
                # this thread takes the caller's x64 scope and goes on only if then every
                # configuration value (what the cache keys as the environment) is the caller's.
                with jax.enable_x64(x64):
                    if _environment(jax) != environment:
                        self.done = (None, ())
                        return
                    self.done = fn._from_lowered(jax, path, lowered, entry, quick)
            except Exception:
                self.done = (None, ())

        self._thread = threading.Thread(target=work, name=f"jaxdp-prepare-{fn._name}")
        self._thread.start()

    def result(self):
        """``(compiled, files)`` as :meth:`_Persistent._load_or_compile` returns it (waits)."""
        if self._thread is not None:
            self._thread.join()
        return self.done if self.done is not None else (None, ())


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def prepare(chain: Callable, *args, **kwargs) -> None:
    """Start compiling, all at once, the programs that ``chain(*args, **kwargs)`` will run.

    ``chain`` is a function that calls :func:`persistent` functions in turn, each on the
    previous ones' results (or parts of them, indexed or passed through; nothing computed on
    them). A program's compilation does not need its inputs' values, only their shapes and
    types, and XLA releases Python's lock while it compiles. So ``chain`` is run once here
    in a planning mode, where each persistent call traces and lowers its program, starts its
    compilation (or the load from this cache, and the write to it) in a thread of its own,
    and returns the shapes of its result (``jax.ShapeDtypeStruct`` leaves) for the next
    call; tracing the next program overlaps the previous ones' compilation, and on a
    machine with several cores the compilations overlap too. Then the caller runs ``chain``
    as usual: each call finds its program prepared under the same signature (the key of the
    memory cache: folder, static arguments, tree structure, abstract values, trace context)
    and waits for it if it is not done yet.

    Nothing changes a value: each program is lowered from the same function, static
    arguments and abstract values as the call itself would lower it (the same StableHLO
    bytes, so the same disk-cache key), and compiled with the same options and JAX
    configuration (the thread takes the caller's x64 scope, and compiles only if then every
    configuration value is the caller's; else the call compiles as usual). A program that
    is in memory, or that an index entry names (loaded there, untraced, as the call itself
    would load it), is not compiled again: planning goes on with its result's shapes.
    Planning stops, silently, at the first call that cannot be planned (a traced argument,
    an error, a computation on a planned result); the calls not prepared run as usual.
    Under a caller's ``jit``, ``vmap`` or ``grad`` it does nothing, and on a single core
    too (nothing would overlap: three compiles at once cost ~5 % more CPU than in turn).

    Args:
      chain: the function whose persistent calls to prepare; it is run here with the
        same arguments, and its result is discarded.
      *args: the arguments the caller will pass to ``chain`` (concrete).
      **kwargs: likewise.
    """
    if "jax" not in sys.modules or getattr(_planning, "on", False) or _cores() < 2:
        return
    import jax

    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
        return
    _planning.on = True
    try:
        chain(*args, **kwargs)
    except Exception:  # _Stop, or anything else: the calls themselves run as usual
        pass
    finally:
        _planning.on = False


def _checked(file: str, magic: bytes) -> bytes | None:
    """The payload of a cache file whose checksum matches, else None (missing, torn, corrupted)."""
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(magic) + 32
    if not data.startswith(magic) or len(data) <= head:
        return None
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(magic):head]:
        return None  # torn or corrupted: compile again (and overwrite)
    return payload


def _read_untraced(jax, entry: str, path: str):
    """The program an index entry names, loaded without tracing, and its file; None on any doubt."""
    payload = _checked(entry, _INDEX_MAGIC)
    if payload is None:
        return None, None
    try:
        name, in_tree, out_tree = pickle.loads(payload)
        if os.path.basename(name) != name or not name.endswith(_SUFFIX):
            return None, None
    except Exception:
        return None, None
    file = os.path.join(path, name)
    return _read(jax, file, in_tree, out_tree), file


def _read(jax, file: str, in_tree, out_tree):
    from jax.experimental import serialize_executable

    payload = _checked(file, _MAGIC)
    if payload is None:
        return None
    try:
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception:
        return None
    try:
        os.utime(file)  # recently used: evicted last
    except OSError:
        pass
    return compiled


def _write(file: str, compiled, path: str) -> bool:
    """Write the executable; True if it is on disk."""
    from jax.experimental import serialize_executable

    try:
        payload = serialize_executable.serialize(compiled)[0]
    except Exception:  # not serialisable on this backend: just not cached
        return False
    if not _atomic_write(file, _MAGIC, payload):
        return False
    _evict(path)
    return True


def _write_entry(entry: str, name: str, trees) -> None:
    """Write an index entry (see the module); its folder is created private like the programs'."""
    try:
        payload = pickle.dumps((name, *trees))
    except Exception:  # a tree structure that does not pickle: no entry, the call still traces
        return
    folder = os.path.dirname(entry)
    if _usable_dir(folder):
        _atomic_write(entry, _INDEX_MAGIC, payload)


def _atomic_write(file: str, magic: bytes, payload: bytes) -> bool:
    """Write magic, checksum and payload to a temporary name beside ``file``, then rename it into place."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=os.path.dirname(file))
        with os.fdopen(fd, "wb") as f:
            f.write(magic + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, file)
        tmp = None
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass


def _evict(path: str) -> None:
    """Delete the least recently used entries beyond the size cap (under a file lock)."""
    try:
        entries = [e for e in os.scandir(path) if e.name.endswith(_SUFFIX) and not e.name.startswith(".")]
        if sum(e.stat().st_size for e in entries) <= _MAX_BYTES:
            return
        import filelock

        with filelock.FileLock(os.path.join(path, ".evict.lock"), timeout=10):
            entries = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(path)
                             if e.name.endswith(_SUFFIX) and not e.name.startswith("."))
            total = sum(size for _, size, _ in entries)
            for _, size, file in entries:
                if total <= _MAX_BYTES:
                    break
                os.remove(file)
                total -= size
    except Exception:  # a missing filelock, a timeout, a file another process removed first
        pass


def persistent(name: str, *, static_argnums: tuple[int, ...] = (), static_argnames: tuple[str, ...] = (),
               quick: Callable[..., bool] | None = None):
    """Decorator: a module-level ``jax.jit`` function whose eager calls use the program cache.

    Put it above the ``jax.jit`` decorator and repeat the jit's static arguments::

        @persistent("dpsgd_epsilon", static_argnums=(0, 1))
        @functools.partial(jax.jit, static_argnums=(0, 1))
        def _dpsgd_epsilon_jit(orders_key, method, q, sigma, steps, delta): ...

    ``name`` prefixes the cache files (readability only; the key is the program).
    ``quick``, if given, is called with a call's arguments (static ones as passed, the others
    concrete arrays or ``jax.ShapeDtypeStruct``s): where it returns True the program is one
    small evaluation and is compiled on CPU at XLA's backend optimisation level 0 (see the
    module: a shorter compile, a slower run, values that may differ from the fully optimised
    program's in their last bits). It must depend on static arguments and shapes only.
    """

    def wrap(jitted: Callable) -> Any:
        return _Persistent(jitted, name, tuple(static_argnums), tuple(static_argnames), quick)

    return wrap
