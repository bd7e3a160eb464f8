import jaxdp
import jaxdp.accounting as A


def test_accounting_all_is_public_and_complete():
    for name in A.__all__:
        assert hasattr(A, name), name
        assert not name.startswith("_")
    public = {n for n in dir(A) if not n.startswith("_") and n not in {"annotations"}}
    # Every public attribute that is not a submodule is listed in __all__.
    modules = {n for n in public if type(getattr(A, n)).__name__ == "module"}
    assert public - modules <= set(A.__all__)


def test_version():
    assert isinstance(jaxdp.__version__, str)


def test_audit_all_is_public_and_complete():
    import jaxdp.audit as au

    for name in au.__all__:
        assert hasattr(au, name), name
        assert not name.startswith("_")
    public = {n for n in dir(au) if not n.startswith("_") and n not in {"annotations"}}
    modules = {n for n in public if type(getattr(au, n)).__name__ == "module"}
    assert public - modules <= set(au.__all__)
