"""The README's snippets run and print what the README says they print.

Every ```python block of README.md that is followed by a ```text block is run in a fresh
process from an empty folder; its output must match the text block line by line, where
``…`` stands for any text (figures that vary with the noise drawn). Blocks that train a model
duplicate examples 14-16 (which run in CI) and take tens of seconds: they are marked slow
(``JAXDP_SLOW=1``). Section 6's command lines that quote their output in a comment run too.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_snippets(text: str):
    """``(section, code, expected)`` for every python block followed by a text block."""
    pattern = re.compile(r"```python\n(.*?)```\s*\n```text\n(.*?)```", re.S)
    out = []
    for m in pattern.finditer(text):
        heading = re.findall(r"^## (.+)$", text[: m.start()], re.M)
        out.append((heading[-1] if heading else "top", m.group(1), m.group(2)))
    return out


def output_matches(expected: str, actual: str) -> bool:
    exp, act = expected.strip("\n").splitlines(), actual.strip("\n").splitlines()
    if len(exp) != len(act):
        return False
    for e, a in zip(exp, act):
        regex = "^" + ".*".join(re.escape(part) for part in e.rstrip().split("…")) + "$"
        if not re.match(regex, a.rstrip()):
            return False
    return True


SNIPPETS = readme_snippets(README.read_text())


def test_readme_has_a_snippet_per_task():
    sections = [s for s, _, _ in SNIPPETS]
    assert [s.split(".")[0] for s in sections] == ["1", "2", "3", "4", "5"], sections


def test_readme_length_and_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 260  # about 250: the task sections, the migration table, the main names
    assert "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/jaxdp train" in text
    assert 'python3 -m venv .venv && .venv/bin/pip install ".[test]" && .venv/bin/python -m pytest -q' in text


def test_output_matching():
    assert output_matches("a 1.5\nb … %\n", "a 1.5\nb 90.3 %")
    assert not output_matches("a 1.5\n", "a 1.6")
    assert not output_matches("a\n", "a\nb")


@pytest.mark.parametrize(
    "section,code,expected",
    [pytest.param(s, c, e, marks=[pytest.mark.slow] if "train(" in c else [], id=s.split(".")[0])
     for s, c, e in SNIPPETS])
def test_readme_snippet_prints_what_it_says(section, code, expected, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert output_matches(expected, proc.stdout), f"{section}: README says\n{expected}\nprinted\n{proc.stdout}"


def test_readme_command_lines_print_what_their_comments_say(tmp_path):
    """Section 6's lines that end with ``# what it prints`` run and print it."""
    section = README.read_text().split("## 6. The command line", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    checked = 0
    for line in section.splitlines():
        if not line.startswith("jaxdp ") or "  # " not in line or "[" in line:
            continue
        command, comment = line.split("  # ", 1)
        if "=" not in comment and not any(ch.isdigit() for ch in comment):
            continue
        proc = subprocess.run([sys.executable, "-m", "jaxdp", *command.split()[1:]], capture_output=True,
                              text=True, timeout=600, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "JAXDP_CACHE_DIR": "off"})
        assert proc.returncode == 0, proc.stderr
        expected = comment.strip().split()[-1]  # the figure the comment quotes
        assert expected in proc.stdout, f"{command}: README says {comment!r}, printed\n{proc.stdout}"
        checked += 1
    assert checked == 2
