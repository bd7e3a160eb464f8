"""Docstrings and the command's output cite only files a pip user has (issue 22).

The package cites its guides as ``docs/NAME.md``; setup.py installs ``docs/*.md`` as
``jaxdp/docs/NAME.md``. No source file of ``jaxdp/`` may cite the README or ``benchmarks/``
(neither ships), and every cited ``docs/NAME.md`` must exist. The slow test installs the
package into a fresh virtual environment and lists what it got.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = re.compile(r"docs/([a-z0-9_]+\.md)")
UNSHIPPED = re.compile(r"README|benchmarks/|benchmarks README")


def _sources():
    return sorted((ROOT / "jaxdp").rglob("*.py"))


def test_no_citation_of_files_outside_the_package():
    bad = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if UNSHIPPED.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
            for name in DOCS.findall(line):
                if not (ROOT / "docs" / name).is_file():
                    bad.append(f"{path.relative_to(ROOT)}:{n}: docs/{name} does not exist")
    assert not bad, "\n".join(bad)


def test_docs_are_declared_as_package_data():
    setup = (ROOT / "setup.py").read_text()
    assert '"jaxdp.docs"' in setup and 'package_dir={"jaxdp.docs": "docs"}' in setup
    assert '"jaxdp.docs": ["*.md"]' in setup


@pytest.mark.slow
def test_installed_package_has_every_cited_doc(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = venv / "bin" / "pip"
    subprocess.run([str(pip), "install", "-q", "--no-deps", str(ROOT)], check=True, timeout=600)
    site = next(venv.glob("lib/python*/site-packages"))
    installed = {p.name for p in (site / "jaxdp" / "docs").glob("*.md")}
    assert installed == {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {p.relative_to(site / "jaxdp") for p in (site / "jaxdp").rglob("*.py")} == \
        {p.relative_to(ROOT / "jaxdp") for p in (ROOT / "jaxdp").rglob("*.py")}
