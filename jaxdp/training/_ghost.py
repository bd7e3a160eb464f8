r"""The ghost-norm fast path of ``clipped_grad_sum`` for dense, convolutional and embedding layers.

Every supported layer computes its output from the example's own input rows and its
parameters through one primitive call, and its per-example parameter gradient is a sum
over the example's *positions* t (1 for a dense layer on a 2-D input; the tokens of a
sequence; the output pixels of a convolution) of outer products a_t δ_tᵀ, where a_t is
the input seen at position t (the row, the token, the receptive-field patch) and δ_t the
gradient of ℓ_i with respect to the output at t:

  ∂ℓ_i/∂W = Σ_t a_t δ_tᵀ,   ∂ℓ_i/∂b = Σ_t δ_t,   ∂ℓ_i/∂E[k] = Σ_{t: id_t = k} δ_t.

The δ's of every layer come out of one backward pass of Σ_i ℓ_i with respect to zero
"probes" added to the layers' outputs (ℓ_i depends on row i only, so row i of a probe's
gradient holds example i's δ's). The squared norm of each layer's per-example gradient is
then formed from (a, δ) without the other examples' gradients (see _ghost_norms._sq_norm_positions
and _ghost_norms._embed_sq_norm), and the clipped sum Σ_i c_i g_i is formed per layer from the same (a, δ)
with δ scaled by c_i (one contraction per layer; no second backward pass). Where a norm
needs the per-example weight gradients anyway (convolutions with few channels: vmap of the
layer's filter gradient, one grouped convolution, or, for very few input channels, one
batched contraction of the input's offset slices), the clipped sum is their weighted sum
over examples (b·d·e operations instead of another b·T·d·e).

Layers are intercepted on a freshly merged copy of the model (the user's module is never
modified): nnx.Linear through its ``dot_general`` attribute, nnx.Conv through its
``conv_general_dilated`` attribute, nnx.Embed by giving the copy a subclass whose
``__call__`` records the ids (``attend``, a tied use of the table, marks the model
unsupported), jaxdp.models.LipschitzDense by a subclass whose ``x @ W`` is a recorded
``dot_general``. Where a model cannot be handled, :func:`_diagnose` says which layer and
why, and ``clipped_grad_sum`` warns once (per model type and reason) before it takes the
general path: a flax version whose layers call something else turns the fast path off
loudly, never silently.

Safety by construction: the clipped sum is formed only from the intercepted calls' (a, δ),
exactly the per-example gradients whose norms are measured, so a use of a parameter
elsewhere in ``loss_fn`` (a weight penalty) loses its gradient instead of escaping the
clipping: each clipped term has norm ≤ C. (The copy also holds every owned parameter as
stop_gradient(p), each intercepted call adding p − stop_gradient(p), an exact zero, at its
own use of p, so that any gradient taken through the copy has the same property.)

nnx.Einsum is intercepted through its ``einsum_op`` attribute when its contraction factors
(``_ghost_norms._einsum_plan``: positions, groups such as heads, contracted and output axes).
nnx.LayerNorm, nnx.RMSNorm and nnx.LoRA are recorded whole (their inputs, and δ at their
output) and have closed forms (``_closed_form``): a norm layer's per-example scale and
bias gradients are Σ_p x̂_p ⊙ δ_p and Σ_p δ_p over the example's positions, (b, d) each,
with x̂ from one forward-mode pass of the layer on the whole batch; LoRA's adapters are two
outer-product layers (B with inputs xA, A with inputs x and output gradients δBᵀ), whose
norms take the Gram identity or the materialised gradient, whichever is cheaper. Other
layers without a formula here (other nnx.Einsum contractions, a norm layer with
cross-device statistics, any module holding trainable parameters directly) are recorded
the same way, and example i's gradient of the layer's own parameters is the
vector-Jacobian product of the layer's forward pass on its inputs (a batch of one) with
δ_i, vmapped over the examples: b copies of that layer's parameters, exact for any layer
whose output row i depends on input row i only. Layers outside ``_PER_LAYER`` are named in
one warning.

Trainable parameters are those of the ``wrt`` filter (default every ``nnx.Param``): the
others are public constants, neither intercepted nor clipped (LoRA fine-tuning: the base
kernels frozen, only ``nnx.LoRAParam`` counted).

The per-layer norms and sums from (a, δ) are in :mod:`jaxdp.training._ghost_norms`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from ..models import LipschitzDense
from ._canonical_conv import _conv_with_canonical_vjp
from ._ghost_closed import _closed_form, _live, _live_rows, _normalised_input, _per_layer_grads, _state_key
from ._ghost_norms import _closed_grad_sum, _closed_sq_norm, _einsum_plan, _layer_grad_sum, _layer_sq_norm
from ._per_example import _masked, _safe_clip_factor, _up, accumulation_dtype


# Exactly these classes: a subclass may use its parameters differently (weight norm, LoRA).
_OWNED = {nnx.Linear: ("kernel", "bias"), nnx.Conv: ("kernel", "bias"), nnx.Embed: ("embedding",),
          LipschitzDense: ("kernel",), nnx.LinearGeneral: ("kernel", "bias"), nnx.LoRALinear: ("kernel", "bias")}

# Layers recorded whole (inputs and output gradients) without a warning: the norm layers
# and LoRA by their closed forms (``_closed_form``), an nnx.Einsum whose contraction is not
# factored by vmap over the examples of the layer's own backward pass (b copies of its
# parameters, not of the model's). Any other module holding trainable parameters takes
# that per-layer vmap with a warning.
_PER_LAYER = (nnx.LayerNorm, nnx.RMSNorm, nnx.LoRA, nnx.Einsum)  # Einsum: when its contraction is not factored


def _einsum_layer_plan(m):
    """The factoring of an ``nnx.Einsum`` (``_ghost_norms._einsum_plan``), or None (then per layer)."""
    if not isinstance(m.einsum_str, str):
        return None
    return _einsum_plan(m.einsum_str, m.kernel.ndim, None if m.bias is None else m.bias.ndim)

# Prefix of the note a recorder adds to an exception raised inside its layer's call.
_NOTE = "jaxdp fast path, in layer: "


def _layer_name(m) -> str:
    """``nnx.Linear`` for flax's layers, the class name for any other module."""
    cls = type(m)
    return f"nnx.{cls.__name__}" if cls.__module__.startswith("flax.") else cls.__name__


def _describe(m, path) -> str:
    where = "/".join(str(p) for p in path)
    return f"{_layer_name(m)} at '{where}'" if where else f"{_layer_name(m)} (the model itself)"


def _names_layer(call):
    """Wrap a recorder's ``__call__`` so that an exception raised inside it names the layer."""

    @functools.wraps(call)
    def wrapped(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        except Exception as err:  # re-raised: only annotated
            recorder = self if isinstance(self, _Recorder) else self._jaxdp_recorder
            err.add_note(_NOTE + recorder.layer)
            raise

    return wrapped


class _Recorder:
    """Stands in for one layer's primitive: records its inputs, adds a probe to its output."""

    kind = "linear"

    def __init__(self, original, registry: list, probes, params: dict, path: tuple = (), layer: str = ""):
        self.original = original
        self.registry = registry
        self.probes = probes
        self.params = params  # the layer's real (differentiable) parameter values
        self.path = path  # the layer's path in the model (keys of its parameters' State)
        self.layer = layer  # the layer's type and path, for the messages

    def _finish(self, out, record, live_bias=True):
        if live_bias and "bias" in self.params:
            out = _live(out, self.params["bias"])  # gives the gradient to the bias flax adds next
        position = len(self.registry)
        record.update(recorder=self, shape=out.shape, dtype=out.dtype)
        self.registry.append(record)
        if self.probes is not None:
            out = out + self.probes[position].astype(out.dtype)
        return out


class _LinearRecorder(_Recorder):
    kind = "linear"

    @_names_layer
    def __call__(self, lhs, rhs, dimension_numbers, *args, **kwargs):
        rhs = _live(rhs, self.params["kernel"])
        out = self.original(lhs, rhs, dimension_numbers, *args, **kwargs)
        return self._finish(out, {"inputs": lhs, "dims": dimension_numbers, "kernel_ndim": rhs.ndim})


class _ConvRecorder(_Recorder):
    kind = "conv"

    @_names_layer
    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                 dimension_numbers=None, feature_group_count=1, batch_group_count=1, **kwargs):
        rhs = _live(rhs, self.params["kernel"])
        # The layer's own convolution, in canonical form when it is lax's (see _canonical_conv).
        fn = self.original
        if fn is jax.lax.conv_general_dilated and kwargs.get("out_sharding") is None:
            fn = _conv_with_canonical_vjp
            kwargs.pop("out_sharding", None)
        out = fn(lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
                            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                            feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                            **kwargs)
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        conv = {"strides": tuple(window_strides), "padding": padding, "dn": dn,
                "lhs_dilation": tuple(lhs_dilation or (1,) * (lhs.ndim - 2)),
                "rhs_dilation": tuple(rhs_dilation or (1,) * (lhs.ndim - 2)),
                "filter_shape": tuple(rhs.shape[d] for d in dn.rhs_spec[2:]),
                "groups": (feature_group_count, batch_group_count)}
        return self._finish(out, {"inputs": lhs, "conv": conv})


class _EinsumRecorder(_Recorder):
    kind = "einsum"

    @_names_layer
    def __call__(self, spec, lhs, rhs, *args, **kwargs):
        plan = _einsum_plan(spec, rhs.ndim, None if "bias" not in self.params else self.params["bias"].ndim)
        if plan is None:  # another contraction given at call time
            self.registry.append({"recorder": None, "why": f"{self.layer} called with the contraction {spec!r}"})
            return self.original(spec, lhs, rhs, *args, **kwargs)
        rhs = _live(rhs, self.params["kernel"])
        out = self.original(spec, lhs, rhs, *args, **kwargs)
        return self._finish(out, {"inputs": lhs, "einsum": plan})


class _RecordingEmbed(nnx.Embed):
    """nnx.Embed whose calls are recorded (set on the instrumented copy only)."""

    @_names_layer
    def __call__(self, inputs, out_sharding=None):
        rec = self._jaxdp_recorder
        out = nnx.Embed.__call__(self, inputs, out_sharding)
        ids = _normalised_ids(jnp.asarray(inputs), self.num_embeddings)
        out = _live_rows(out, rec.params["embedding"], ids)  # the table's gradient, at this call only
        return rec._finish(out, {"inputs": inputs, "ids": ids, "vocab": self.num_embeddings})

    def attend(self, query, out_sharding=None):
        rec = self._jaxdp_recorder  # a second use of the table: unsupported
        rec.registry.append({"recorder": None, "why": f"{rec.layer} is used through Embed.attend (tied weights)"})
        return nnx.Embed.attend(self, query, out_sharding)


class _RecordingLipschitzDense(LipschitzDense):
    """LipschitzDense whose ``x @ W`` is a recorded ``dot_general`` (set on the instrumented copy only)."""

    def __call__(self, x):
        x = jnp.asarray(x)
        kernel = self.kernel[...]
        dtype = jnp.result_type(x.dtype, kernel.dtype)  # as ``x @ W`` promotes
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return self._jaxdp_recorder(x.astype(dtype), kernel.astype(dtype), dims)


def _normalised_ids(ids, vocab: int):
    """Row of the table each id reads (jnp.take wraps negative ids; a one-row table broadcasts)."""
    if vocab == 1:
        return jnp.zeros(ids.shape, jnp.int32)
    ids = ids.astype(jnp.int32)
    return jnp.where(ids < 0, ids + vocab, ids)


def _trainable_paths(params) -> frozenset:
    """The paths (tuples of keys) of the trainable parameters in their ``nnx.State``."""
    return frozenset(_state_key(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def _owners(model: nnx.Module, trainable=None) -> tuple[tuple | None, str | None]:
    """``((owned layers, per-layer modules, their attributes), None)``, or ``(None, why)``.

    The owned layers (``_OWNED``) have their trainable parameters' norms formed from
    ``(a, δ)``; the per-layer modules (any other module holding trainable parameters
    directly) by vmap of the module's own backward pass. ``trainable`` is the set of
    trainable parameter paths (all ``nnx.Param`` when None); frozen parameters are public
    constants and are not looked at.
    """
    modules = dict(nnx.iter_modules(model))
    held: dict = {}
    live = set()  # the trainable Variables (a tied one is listed once, under its first path)
    for path, value in nnx.iter_graph(model):
        if isinstance(value, nnx.Param) and (trainable is None or tuple(path) in trainable):
            held.setdefault(tuple(path[:-1]), []).append(path[-1])
            live.add(id(value))
    layers, per_layer = {}, {}
    for owner, attrs in held.items():
        m = modules.get(owner)
        if m is None:
            holder = modules.get(owner[:-1], model)
            return None, f"{_describe(holder, owner[:-1])}, which holds the parameter '{owner[-1]}' in a container"
        if type(m) is nnx.Einsum and _einsum_layer_plan(m) is not None and set(attrs) <= {"kernel", "bias"}:
            layers[owner] = m
        elif type(m) in _OWNED:
            # A masked kernel's gradient is masked; grouped convolutions are not factored here.
            if type(m) is nnx.Conv and m.mask is not None:
                return None, f"{_describe(m, owner)} with a kernel mask"
            if type(m) is nnx.Conv and m.feature_group_count != 1:
                return None, f"{_describe(m, owner)} with feature_group_count={m.feature_group_count}"
            if type(m) is nnx.LinearGeneral and (m.batch_axis or m.dot_general_cls is not None):
                return None, f"{_describe(m, owner)} with batch axes or a dot_general_cls"
            extra = [a for a in attrs if a not in _OWNED[type(m)]]
            if extra:
                return None, f"{_describe(m, owner)} with an extra parameter '{extra[0]}'"
            layers[owner] = m
        else:
            if any(isinstance(v, nnx.RngState) for _, v in nnx.iter_graph(m)):
                return None, f"{_describe(m, owner)}, which holds parameters and random state"
            per_layer[owner] = m
    # iter_graph lists a shared Variable once: a parameter tied between layers has a
    # per-example gradient (a sum over both layers) whose norm is not factored here.
    seen: dict = {}
    for path, m in modules.items():
        for attr, var in vars(m).items():
            if isinstance(var, nnx.Param) and id(var) in live:
                if id(var) in seen:
                    return None, f"{seen[id(var)]} and {_describe(m, path)}, which share a parameter (tied weights)"
                seen[id(var)] = _describe(m, path)
    if not held:
        return None, f"{_describe(model, ())}, which has no parameters"
    return (layers, per_layer, held), None


def _instrumented(graphdef, rest, registry, owners):
    """Return ``build(params, probes)``: a fresh model copy with every supported layer instrumented."""
    layers, per_layer, held = owners

    def build(p, probes):
        model = nnx.merge(graphdef, p, rest)
        modules = dict(nnx.iter_modules(model))
        # The per-layer modules' pure forms first, before any layer of theirs is instrumented.
        pure = {}
        for path in per_layer:
            attrs = tuple(held[path])
            pure[path] = nnx.split(modules[path], lambda q, v, attrs=attrs: len(q) == 1 and q[0] in attrs, ...)
        for path, m in modules.items():
            path = tuple(path)
            if path not in layers and path not in per_layer:
                continue
            real = {}
            for attr in held[path]:
                var = getattr(m, attr)
                real[attr] = var.get_value()
                var.set_value(jax.lax.stop_gradient(real[attr]))
            layer = _describe(m, path)
            kind = type(m)
            if path in per_layer:
                m.__class__ = _per_layer_class(kind)
                m._jaxdp_recorder = _Recorder(pure[path], registry, probes, real, path, layer)
            elif kind in (nnx.Linear, nnx.LinearGeneral, nnx.LoRALinear):
                original = m.dot_general if m.dot_general is not None else jax.lax.dot_general  # LinearGeneral's default
                m.dot_general = _LinearRecorder(original, registry, probes, real, path, layer)
            elif kind is nnx.Einsum:
                m.einsum_op = _EinsumRecorder(m.einsum_op, registry, probes, real, path, layer)
            elif kind is nnx.Conv:
                m.conv_general_dilated = _ConvRecorder(m.conv_general_dilated, registry, probes, real, path, layer)
            elif kind is nnx.Embed:
                m.__class__ = _RecordingEmbed
                m._jaxdp_recorder = _Recorder(None, registry, probes, real, path, layer)
            else:
                m.__class__ = _RecordingLipschitzDense
                m._jaxdp_recorder = _LinearRecorder(jax.lax.dot_general, registry, probes, real, path, layer)
        return model

    return build


@functools.cache
def _per_layer_class(cls):
    """``cls`` whose calls are recorded whole (set on the instrumented copy only)."""

    @_names_layer
    def __call__(self, *args, **kwargs):
        rec = self._jaxdp_recorder
        out = cls.__call__(self, *args, **kwargs)
        if (not args or not all(isinstance(a, jax.Array) for a in args)
                or any(isinstance(v, jax.Array) for v in kwargs.values()) or not isinstance(out, jax.Array)):
            rec.registry.append({"recorder": None, "why": f"{rec.layer} called with other than array arguments "
                                 "or returning other than one array"})
            return out
        gdef, theta, state = rec.original
        record = {"inputs": args[0], "args": tuple(args), "kwargs": kwargs, "gdef": gdef, "theta": theta,
                  "state": state}
        record.update(_closed_form(cls, self, args, kwargs, out, rec.params))
        return rec._finish(out, record, live_bias=False)

    return type(cls)(f"_Recording{cls.__name__}", (cls,), {"__call__": __call__, "__module__": cls.__module__})


def _record_unsupported(rec, b: int) -> str | None:
    """Shape checks of one recorded call (trace time): why the fast path cannot take it, or None."""
    recorder = rec["recorder"]
    if recorder is None:
        return rec["why"]
    inputs = rec["inputs"]
    if len(rec["shape"]) < 1 or rec["shape"][0] != b or inputs.ndim < 1 or inputs.shape[0] != b:
        return f"{recorder.layer} applied to an input without the batch on its leading axis"
    if "ids" in rec:
        return None
    if "einsum" in rec:
        return None
    if "gdef" in rec:
        if any(a.ndim < 1 or a.shape[0] != b for a in rec["args"]):
            return f"{recorder.layer} applied to an input without the batch on its leading axis"
        return None
    if "conv" in rec:
        c = rec["conv"]
        if not (c["groups"] == (1, 1) and c["dn"].lhs_spec[0] == 0 and c["dn"].out_spec[0] == 0):
            return f"{recorder.layer} with grouped convolutions or the batch off the leading axis"
        if not all(v == 1 for v in c["lhs_dilation"]):
            return f"{recorder.layer} with input dilation"
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = rec["dims"]
    k = len(tuple(lhs_contract))  # the input's last k axes with the kernel's first k (LinearGeneral)
    if not (1 <= k < inputs.ndim and tuple(lhs_contract) == tuple(range(inputs.ndim - k, inputs.ndim))
            and tuple(rhs_contract) == tuple(range(k)) and not tuple(lhs_batch) and not tuple(rhs_batch)
            and rec["kernel_ndim"] > k and len(rec["shape"]) == inputs.ndim - k + rec["kernel_ndim"] - k):
        return f"{recorder.layer} contracting other axes than the input's last with the kernel's first"
    return None


# Errors that tracing the instrumented copy may raise where the recorders do not fit the
# model (a flax version whose layers call another function or signature; forward-mode
# autodiff inside loss_fn through the recorded convolution's custom_vjp). They mean
# "unsupported" only if the uninstrumented model traces; otherwise they are the caller's.
_TRACE_ERRORS = (TypeError, ValueError, AttributeError, NotImplementedError)


def _pulled_back(f):
    """``f(p, x, y)`` whose backward pass with respect to ``p`` is traced too (as the fast path runs it)."""

    def g(p, x, y):
        out, pull = jax.vjp(lambda p: f(p, x, y), p)
        pull(jnp.ones_like(out))
        return out

    return g


def _diagnose(loss_fn, model, x, y, wrt=nnx.Param) -> tuple[list | None, str | None]:
    """Trace once, forward and backward (shapes only): ``(probe shapes, why)`` if the fast path applies, else ``(None, why)``.

    ``why`` names the layer the fast path cannot handle, with its type; with probe shapes it
    names the layer types taken per layer without a formula (None if there are none). It is None where
    the general path raises anyway (``loss_fn`` not returning a ``(b,)`` vector). An error
    of ``loss_fn`` or the model itself (one that tracing without the instrumentation raises
    too) is raised, not taken for "unsupported".
    """
    graphdef, params, rest = nnx.split(model, wrt, ...)
    owners, why = _owners(model, _trainable_paths(params))
    if owners is None:
        return None, why
    registry: list = []
    build = _instrumented(graphdef, rest, registry, owners)

    def run(p, x, y):
        registry.clear()
        return loss_fn(build(p, None), x, y)

    failure = None
    try:
        out = jax.eval_shape(_pulled_back(run), params, x, y)
    except _TRACE_ERRORS as err:
        failure = err
    if failure is not None:
        # Outside the except block, so that the caller's own error is raised unchained.
        jax.eval_shape(_pulled_back(lambda p, x, y: loss_fn(nnx.merge(graphdef, p, rest), x, y)), params, x, y)
        notes = [n[len(_NOTE):] for n in getattr(failure, "__notes__", ()) if n.startswith(_NOTE)]
        where = notes[-1] if notes else f"a layer of {_describe(model, ())}"
        message = str(failure).strip().split("\n")[0][:200]
        return None, f"{where}, whose instrumented call raised {type(failure).__name__}: {message}"
    b = x.shape[0]
    if out.shape != (b,):
        return None, None
    for rec in registry:
        why = _record_unsupported(rec, b)
        if why is not None:
            return None, why
    # Each layer must be applied exactly once: a shared layer's per-example gradient is a
    # sum over its calls, whose norm is not formed here.
    calls: dict = {}
    for rec in registry:
        calls.setdefault(rec["recorder"].path, []).append(rec["recorder"])
    layers, per_layer, _ = owners
    for path, m in {**layers, **per_layer}.items():
        n = len(calls.get(path, ()))
        if n != 1:
            how = "not applied by loss_fn through its usual call" if n == 0 else f"applied {n} times (shared)"
            return None, f"{_describe(m, path)}, {how}"
    if len(registry) != len(layers) + len(per_layer):  # a recorder outside the owned layers: cannot happen
        return None, f"{_describe(model, ())}, whose layers were called {len(registry)} times"
    # Per-layer vmap for a module the fast path has no formula for: exact, named in one warning.
    unknown = sorted({_layer_name(m) for m in per_layer.values() if type(m) not in _PER_LAYER})
    why = None if not unknown else (
        f"{', '.join(unknown)} (no per-example norm formula; those layers' per-example gradients are "
        "materialised, each by vmap of the layer's own backward pass)")
    return [(tuple(r["shape"]), r["dtype"]) for r in registry], why


def _discover(loss_fn, model, x, y, wrt=nnx.Param) -> list | None:
    """The probe shapes if the fast path applies to every layer, else None (see :func:`_diagnose`)."""
    calls, why = _diagnose(loss_fn, model, x, y, wrt)
    return calls if why is None else None


_WARNED: set = set()  # (model type, reason) pairs already warned about


def _warn_fallback(model, why: str, per_layer: bool = False) -> None:
    """Warn once per model type and reason that the fast path is off for this model (or some of its layers)."""
    key = (type(model), why)
    if key in _WARNED:
        return
    _WARNED.add(key)
    if per_layer:
        message = (f"clipped_grad_sum on {type(model).__name__}: the fast path has no formula for {why}; the other "
                   "layers take the fast path (the same clipped sum; those layers cost more memory).")
    else:
        message = (f"clipped_grad_sum on {type(model).__name__}: the fast path cannot handle {why}; using the general "
                   "vmap(grad) path (the same clipped sum, slower, more memory). Pass use_fast_path=False to choose "
                   "it without this warning.")
    warnings.warn(message, UserWarning, stacklevel=_caller_stacklevel())


# Frames of these packages (and of the standard wrappers they call through) lie between the
# caller and the warning: it is issued at trace time, deep inside jax.
_LIBRARY_FILES = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, flax, sys.modules["jaxdp"]))
_WRAPPER_FILES = (contextlib.__file__, functools.__file__)


def _caller_stacklevel() -> int:
    """``stacklevel`` for a warning from :func:`_warn_fallback` that points at the caller's own code."""
    frame, level = sys._getframe(1), 1  # level 1: _warn_fallback itself
    while frame is not None and (frame.f_code.co_filename.startswith(_LIBRARY_FILES)
                                 or frame.f_code.co_filename in _WRAPPER_FILES):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _fast(loss_fn, model, x, y, clip_norm, calls, mask=None, wrt=nnx.Param) -> tuple:
    """``(Σ_i c_i g_i, norms)`` on the fast path, for the probe shapes ``calls`` of :func:`_discover`."""
    graphdef, params, rest = nnx.split(model, wrt, ...)
    owners, _ = _owners(model, _trainable_paths(params))
    probes = [jnp.zeros(shape, dtype) for shape, dtype in calls]
    registry: list = []
    build = _instrumented(graphdef, rest, registry, owners)
    arrays_of = ("inputs", "ids", "args", "theta", "state", "lora_ab")

    def f(p, probes_):
        registry.clear()
        losses = loss_fn(build(p, probes_), x, y)
        return losses, [{k: rec[k] for k in arrays_of if rec.get(k) is not None} for rec in registry]

    # The parameters' cotangents are never used: under jit they are not computed.
    losses, vjp_fn, arrays = jax.vjp(f, params, probes, has_aux=True)
    # The aux output carries the recorded arrays; the static facts come from the registry.
    records = [{**reg, **arr} for arr, reg in zip(arrays, registry, strict=True)]
    _, deltas = vjp_fn(jnp.ones_like(losses))  # row i of deltas[k] holds example i's δ's at layer k
    # Norms and sums in float32 at least (bfloat16 layers: see accumulation_dtype); no-ops otherwise.
    deltas = [_up(d) for d in deltas]
    records = [{**rec, "inputs": _up(rec["inputs"])} if "inputs" in rec else rec for rec in records]
    sq, per_example = None, []
    for rec, delta in zip(records, deltas, strict=True):
        if "closed" in rec:
            term, pe = _closed_sq_norm(rec, delta, _normalised_input(rec) if rec["closed"] == "norm" else None)
        elif "gdef" in rec:
            pe = jax.tree.map(_up, _per_layer_grads(rec, delta))
            term = sum(jnp.sum(jnp.square(v).reshape(v.shape[0], -1), axis=1) for v in jax.tree.leaves(pe))
        else:
            term, pe = _layer_sq_norm(rec, delta)
        per_example.append(pe)
        sq = term if sq is None else sq + term.astype(sq.dtype)
    norms, factor = _safe_clip_factor(sq, clip_norm)
    # The weights are constants (S = Σ c_i g_i is not differentiated through c).
    factor = jax.lax.stop_gradient(_masked(factor, mask))
    sums = {}
    for rec, delta, pe in zip(records, deltas, per_example, strict=True):
        if "closed" in rec:
            layer_sums = _closed_grad_sum(rec, pe, factor)
        elif "gdef" in rec:
            flat = jax.tree_util.tree_flatten_with_path(pe)[0]
            layer_sums = {_state_key(kp)[-1]: jnp.tensordot(factor.astype(v.dtype), v, axes=1) for kp, v in flat}
        else:
            layer_sums = _layer_grad_sum(rec, delta, factor, pe)
        for attr, value in layer_sums.items():
            sums[rec["recorder"].path + (attr,)] = value

    def fill(key_path, leaf):
        return sums[_state_key(key_path)].astype(accumulation_dtype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(fill, params), norms
