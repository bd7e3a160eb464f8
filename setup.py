"""Packaging beyond pyproject.toml: the guides in docs/ ship inside the package as jaxdp/docs/*.md.

Docstrings and the command's output cite them (``docs/pld.md``, installed as
``jaxdp/docs/pld.md``), so a pip user has every file they name (tests/test_docs_shipped.py).
``jaxdp/accounting/_gammaln_table.npy`` (SciPy's log-gamma at the default orders' arguments)
ships too: building the default RDP plan then needs no SciPy import.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["jaxdp", "jaxdp.*"]), "jaxdp.docs"],
    package_dir={"jaxdp.docs": "docs"},
    package_data={"jaxdp": ["py.typed", "accounting/_gammaln_table.npy"], "jaxdp.docs": ["*.md"]},
)
