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
* every global JAX configuration value (compiler options among them).

A file is used only if its SHA-256 checksum matches (a torn or corrupted file is ignored
and rewritten); otherwise the program is compiled (``lowered.compile()``, what ``jax.jit``
does) and written. Any other call (traced arguments, several devices, a program with
hoisted constants, any error of the cache itself) runs the ``jax.jit`` function
unchanged, so the cache can make a call faster but never change its value: the same
module compiled with the same compiler gives the same executable.

Where: ``$JAXDP_CACHE_DIR/programs`` if ``JAXDP_CACHE_DIR`` is set, else
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
import platform
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["cache_dir", "persistent", "stats"]

_OFF = ("", "0", "off", "no", "none", "false")
_MAGIC = b"jaxdp-program-1\n"
_MAX_BYTES = 256 * 2**20
_MEMO_SIZE = 64
_SUFFIX = ".xla"

# Counters for tests and benchmarks: programs loaded from disk, compiled and written, and
# calls that went straight to jax.jit.
stats = {"loaded": 0, "compiled": 0, "bypassed": 0}


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


def _environment(jax) -> bytes:
    import jaxlib

    dev = jax.devices()[0]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    parts = (jax.__version__, jaxlib.__version__, dev.client.platform, dev.client.platform_version, dev.device_kind,
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), repr(config))
    return "\0".join(parts).encode() + b"\0" + _machine()


def _program(lowered) -> bytes:
    from jax._src.interpreters import mlir

    return mlir.module_to_bytecode(lowered.compiler_ir("stablehlo"))


class _Persistent:
    """A ``jax.jit`` function whose eager calls use the persistent cache (see the module)."""

    def __init__(self, jitted: Callable, name: str, static_argnums: tuple[int, ...], static_argnames: tuple[str, ...]):
        self._jitted = jitted
        self._name = name
        self._static_argnums = frozenset(static_argnums)
        self._static_argnames = frozenset(static_argnames)
        self._memo: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        functools.update_wrapper(self, jitted)

    # Anything the library does with the jitted function besides calling it (lower, trace,
    # eval_shape) goes to jax.jit.
    def __getattr__(self, name):
        return getattr(self._jitted, name)

    def __call__(self, *args, **kwargs):
        path = cache_dir()
        if path is None or "jax" not in sys.modules:
            return self._jitted(*args, **kwargs)
        import jax

        dyn_args = tuple(a for i, a in enumerate(args) if i not in self._static_argnums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        if (any(isinstance(x, jax.core.Tracer) for x in leaves) or jax.config.jax_disable_jit
                or jax.config.jax_debug_nans or jax.config.jax_debug_infs or jax.device_count() != 1
                or not _usable_dir(path)):
            stats["bypassed"] += 1
            return self._jitted(*args, **kwargs)
        try:
            from jax._src import config as _config

            static = (tuple((i, args[i]) for i in sorted(self._static_argnums) if i < len(args)),
                      tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_argnames)))
            # str(treedef) names the classes: tree structures of two pytree classes with the
            # same fields can compare equal (JAX's register_dataclass; see jaxdp._pytree).
            signature = (path, static, treedef, str(treedef), tuple(jax.typeof(x) for x in leaves),
                         _config.trace_context())
            hash(signature)
        except Exception:  # an unhashable static argument, an internal API that moved
            stats["bypassed"] += 1
            return self._jitted(*args, **kwargs)
        with self._lock:
            compiled = self._memo.get(signature)
            if compiled is not None:
                self._memo.move_to_end(signature)
        if compiled is None:
            compiled = self._load_or_compile(jax, path, args, kwargs)
            if compiled is None:
                stats["bypassed"] += 1
                return self._jitted(*args, **kwargs)
            with self._lock:
                self._memo[signature] = compiled
                while len(self._memo) > _MEMO_SIZE:
                    self._memo.popitem(last=False)
        return compiled(*dyn_args, **dyn_kwargs)

    def _load_or_compile(self, jax, path: str, args, kwargs):
        """The compiled program from disk, or compiled now and written; None to use jax.jit."""
        try:
            lowered = self._jitted.lower(*args, **kwargs)
            if getattr(lowered._lowering, "const_args", None) != []:  # constants outside the module: not keyed
                return None
            key = hashlib.sha256(_environment(jax) + b"\0" + _program(lowered)).hexdigest()
        except Exception:
            return None
        file = os.path.join(path, f"{self._name}-{key[:48]}{_SUFFIX}")
        compiled = _read(jax, file, lowered)
        if compiled is not None:
            stats["loaded"] += 1
            return compiled
        compiled = lowered.compile()
        stats["compiled"] += 1
        _write(file, compiled, path)
        return compiled


def _read(jax, file: str, lowered):
    from jax.experimental import serialize_executable

    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(_MAGIC) + 32
    if not data.startswith(_MAGIC) or len(data) <= head:
        return None
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(_MAGIC):head]:
        return None  # torn or corrupted: compile again (and overwrite)
    try:
        in_tree = jax.tree_util.tree_structure(lowered.args_info)
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, lowered.out_tree)
    except Exception:
        return None
    try:
        os.utime(file)  # recently used: evicted last
    except OSError:
        pass
    return compiled


def _write(file: str, compiled, path: str) -> None:
    from jax.experimental import serialize_executable

    try:
        payload = serialize_executable.serialize(compiled)[0]
    except Exception:  # not serialisable on this backend: just not cached
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=path)
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, file)
        tmp = None
        _evict(path)
    except OSError:
        pass
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


def persistent(name: str, *, static_argnums: tuple[int, ...] = (), static_argnames: tuple[str, ...] = ()):
    """Decorator: a module-level ``jax.jit`` function whose eager calls use the program cache.

    Put it above the ``jax.jit`` decorator and repeat the jit's static arguments::

        @persistent("dpsgd_epsilon", static_argnums=(0, 1))
        @functools.partial(jax.jit, static_argnums=(0, 1))
        def _dpsgd_epsilon_jit(orders_key, method, q, sigma, steps, delta): ...

    ``name`` prefixes the cache files (readability only; the key is the program).
    """

    def wrap(jitted: Callable) -> Any:
        return _Persistent(jitted, name, tuple(static_argnums), tuple(static_argnames))

    return wrap
