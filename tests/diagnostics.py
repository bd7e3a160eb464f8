"""What a failing accountant comparison prints besides the two numbers.

Two CI runs (sessions 6 and 8) each failed one random-tree comparison once, with a value
that reruns of the same test, alone or in the whole suite, got right. :func:`recheck`
recomputes such a value in the same process with JAX's in-memory caches cleared and the
persistent compilation cache off, and in a fresh Python process, so that the failure
says whether the wrong value came from a compiled program the process held (a recompile
gives the right one) or from the computation itself (every recompute repeats it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax

_PRELUDE = "import jax; jax.config.update('jax_enable_x64', True); import jaxdp.accounting as A; from jaxdp.accounting import *"


def recheck(call: str) -> str:
    """``call``, a Python expression with literal arguments (``A`` is ``jaxdp.accounting``;
    event reprs evaluate as written), recomputed three ways: lines for an assertion message."""
    import jaxdp.accounting as A

    namespace = {"A": A, **{k: getattr(A, k) for k in A.__all__}}
    lines = [f"call: {call}"]
    try:
        with jax.enable_x64(True):
            lines.append(f"again: {float(eval(call, namespace))!r}")
            was = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            try:
                jax.clear_caches()
                lines.append(f"recompiled, no persistent cache: {float(eval(call, namespace))!r}")
            finally:
                jax.config.update("jax_enable_compilation_cache", was)
    except Exception as exc:  # the diagnosis must not hide the failure it explains
        lines.append(f"in-process recheck failed: {type(exc).__name__}: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    try:
        proc = subprocess.run([sys.executable, "-c", f"{_PRELUDE}; print(repr(float({call})))"], capture_output=True,
                              text=True, timeout=300, env={**env, "JAX_ENABLE_COMPILATION_CACHE": "false"})
        lines.append(f"fresh process: {proc.stdout.strip() or proc.stderr.strip()[-300:]}")
    except Exception as exc:
        lines.append(f"fresh process failed: {type(exc).__name__}: {exc}")
    return "\n".join(lines)
