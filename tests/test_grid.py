"""Streamed grids (jaxdp.grids) and ``jaxdp grid``: values, resuming, fingerprints, heat maps.

Every test uses the same chunk length and orders, so the chunk function compiles once.
"""

import json
import os

import numpy as np
import pytest

import jaxdp.grids as G
from jaxdp.cli.main import main
from tests.references import rdp_to_epsilon_improved, sgm_rdp_int

ORDERS = (2.0, 3.0, 4.0, 8.0, 16.0, 32.0)  # integer orders: the mpmath binomial sum is exact for them
CHUNK = 8
AXES = ([1e-3, 0.01, 0.1], [0.8, 2.0], [10.0, 1000.0], [1e-5, 1e-7])  # 24 configurations, 3 chunks (last padded)
# jit and the eager call differ by float64 rounding only; mpmath: the reference is exact to
# 50 digits, so the gap is float64 evaluation error of a few ulps of the RDP sum.
RTOL = 1e-12
ORDERS_TEXT = ",".join(f"{o:g}" for o in ORDERS)


def _grid(directory=None, **kw):
    return G.epsilon_grid(*AXES, directory=directory, chunk_size=CHUNK, orders=ORDERS, **kw)


@pytest.fixture(scope="module")
def reference():
    return np.array(_grid().epsilon)


def test_grid_matches_mpmath(reference):
    assert reference.shape == (3, 2, 2, 2)
    for i, j, k, m in [(0, 0, 1, 0), (2, 1, 0, 1), (1, 0, 1, 1)]:
        q, s, t, d = AXES[0][i], AXES[1][j], AXES[2][k], AXES[3][m]
        rdp = [t * sgm_rdp_int(q, s, int(a)) for a in ORDERS]
        want = rdp_to_epsilon_improved(ORDERS, rdp, d)
        assert reference[i, j, k, m] == pytest.approx(want, rel=RTOL)


def test_interrupted_grid_resumes_without_loss_or_duplication(tmp_path, reference):
    seen = []

    def stop_after_two(k, n):
        seen.append(k)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _grid(tmp_path, callback=stop_after_two)
    recomputed = []
    res = _grid(tmp_path, callback=lambda k, n: recomputed.append(k))
    assert (res.resumed_chunks, res.computed_chunks) == (2, 1)
    assert sorted(seen + recomputed) == [0, 1, 2]  # each chunk computed exactly once
    np.testing.assert_array_equal(res.epsilon, reference)
    G.write_grid_csv(str(tmp_path / "a.csv"), res)
    G.write_grid_csv(str(tmp_path / "b.csv"), G.GridResult(reference, res.axes, 0, 0, 0.0, None))
    rows = (tmp_path / "a.csv").read_text().splitlines()
    assert rows == (tmp_path / "b.csv").read_text().splitlines() and len(rows) == 25
    q, s, t, d, e = (float(v) for v in rows[-1].split(","))
    assert (q, s, t, d, e) == (0.1, 2.0, 1000.0, 1e-7, reference[-1, -1, -1, -1])  # repr round-trips
    again = _grid(tmp_path, progress=True)  # finished: nothing recomputed (the bar starts full)
    assert (again.resumed_chunks, again.computed_chunks) == (3, 0)


def test_changed_arguments_never_reuse_chunks(tmp_path, reference):
    _grid(tmp_path)
    changed = list(AXES)
    changed[0] = [1e-3, np.nextafter(0.01, 1.0), 0.1]  # one ulp
    res = G.epsilon_grid(*changed, directory=tmp_path, chunk_size=CHUNK, orders=ORDERS)
    assert (res.resumed_chunks, res.computed_chunks) == (0, 3)
    np.testing.assert_array_equal(res.epsilon, G.epsilon_grid(*changed, chunk_size=CHUNK, orders=ORDERS).epsilon)
    assert len([p for p in os.listdir(tmp_path) if p.startswith("chunks-")]) == 1  # the old grid's folder is gone
    assert G.epsilon_grid(*AXES, directory=tmp_path, chunk_size=CHUNK, orders=ORDERS, method="classic").computed_chunks == 3


def test_a_line_cut_short_is_not_a_finished_chunk(tmp_path, reference):
    res = _grid(tmp_path)
    done = os.path.join(res.directory, "done.txt")
    with open(done, "w") as fh:
        fh.write("0\n2")  # chunk 2's line lost its newline: it was not finished
    res = _grid(tmp_path)
    assert (res.resumed_chunks, res.computed_chunks) == (1, 2)
    np.testing.assert_array_equal(res.epsilon, reference)


@pytest.mark.parametrize("kw,name", [
    (dict(q=[0.1, 1.5]), "q"), (dict(q=[]), "q"), (dict(q="0.1"), "q"),
    (dict(noise_multiplier=[0.0]), "noise_multiplier"), (dict(num_steps=[-1.0]), "num_steps"),
    (dict(delta=[1e-5, 1e-320]), "delta"), (dict(chunk_size=0), "chunk_size"), (dict(chunk_size=2.5), "chunk_size"),
    (dict(accountant="exact"), "accountant"), (dict(method="best"), "method"), (dict(orders=[0.5]), "orders"),
])
def test_invalid_arguments_are_named(kw, name):
    args = dict(q=AXES[0], noise_multiplier=AXES[1], num_steps=AXES[2], delta=AXES[3], chunk_size=CHUNK)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        G.epsilon_grid(**args)


def _cli(tmp_path, *extra):
    return ["grid", "--q", "1e-3,0.01,0.1", "--noise-multiplier", "0.8,2", "--num-steps", "10,1000",
            "--chunk-size", str(CHUNK), "--orders", ORDERS_TEXT, "--out", str(tmp_path), *extra]


def test_cli_delta_list_contours_and_resume(tmp_path, capsys, reference, monkeypatch):
    argv = _cli(tmp_path, "--delta", "1e-5,1e-7", "--contours", "1,2,8", "--json")
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["configurations"] == 24 and first["computed_chunks"] == 3 and first["deltas"] == [1e-5, 1e-7]
    assert first["steps_shown"] == [10.0, 1000.0] and first["contours"] == [1.0, 2.0, 8.0]
    for path in first["pngs"]:
        assert os.path.getsize(path) > 1000
    assert [os.path.basename(p) for p in first["pngs"]] == ["epsilon_grid_delta1e-05.png", "epsilon_grid_delta1e-07.png"]
    rows = (tmp_path / "epsilon_grid.csv").read_text().splitlines()
    assert len(rows) == 25 and {r.split(",")[3] for r in rows[1:]} == {"1e-05", "1e-07"}
    assert [float(r.split(",")[4]) for r in rows[1:]] == reference.ravel().tolist()
    from jaxdp.cli import grid

    monkeypatch.setattr(grid, "_heatmap", lambda *a, **k: None)  # drawn above; the reruns test the chunks
    assert main(argv) == 0  # the same command again: every chunk resumed
    again = json.loads(capsys.readouterr().out)
    assert (again["computed_chunks"], again["resumed_chunks"]) == (0, 3)
    assert main([*argv, "--restart"]) == 0
    assert json.loads(capsys.readouterr().out)["computed_chunks"] == 3


def test_cli_says_which_steps_it_draws(tmp_path, capsys, monkeypatch):
    from jaxdp.cli import grid

    monkeypatch.setattr(grid, "MAX_PANELS", 1)
    assert main(_cli(tmp_path, "--delta", "1e-5")) == 0
    out = capsys.readouterr().out
    assert "heat maps show 1 of the 2 steps values: 10 (all are in the CSV)" in out
    assert (tmp_path / "epsilon_grid.png").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--delta", "1e-5", "--contours", "0,1"], "--contours"),
    (["--delta", "1e-5", "--chunk-size", "0"], "--chunk-size"),
    (["--delta", "1e-5,2"], "--delta"),
])
def test_cli_bad_options_one_line(tmp_path, capsys, extra, needle):
    try:
        rc = main(_cli(tmp_path, *extra))
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("jaxdp: error:") and "\n" not in err and needle in err, err


def test_panels_cover_every_steps_value_up_to_the_cap():
    from jaxdp.cli.grid import MAX_PANELS, _panels

    assert _panels(10) == list(range(10))
    shown = _panels(100)
    assert len(shown) == MAX_PANELS and shown[0] == 0 and shown[-1] == 99


def test_pld_grid_options_are_accepted_without_orders():
    # Found while benchmarking: the default orders (an array) reached the PLD chunk cache as a key.
    assert callable(G._chunk_function("pld", None, "improved"))
    assert G._fingerprint([np.array([0.1])], accountant="pld", orders=None, method="improved", chunk_size=16)


@pytest.mark.slow  # the PLD program compiles for ~30 s; the option handling is covered above
def test_pld_grid_equals_pld_epsilon():
    import jaxdp.accounting as A

    res = G.epsilon_grid([0.01, 0.02], 1.1, 1000, 1e-5, accountant="pld")
    for i, q in enumerate([0.01, 0.02]):
        assert res.epsilon[i, 0, 0, 0] == pytest.approx(float(A.pld_epsilon(A.dpsgd_event(q, 1.1, 1000), 1e-5)),
                                                        rel=RTOL)


def test_cli_interrupted_says_how_to_resume(tmp_path, capsys, monkeypatch):
    real = G.epsilon_grid

    def interrupted(*a, **k):
        real(*a, **dict(k, callback=lambda i, n: (_ for _ in ()).throw(KeyboardInterrupt) if i == 1 else None))

    from jaxdp.cli import grid

    monkeypatch.setattr(grid, "_heatmap", lambda *a, **k: None)  # heat maps are tested above
    monkeypatch.setattr(G, "epsilon_grid", interrupted)
    assert main(_cli(tmp_path, "--delta", "1e-5,1e-7")) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    monkeypatch.setattr(G, "epsilon_grid", real)
    assert main(_cli(tmp_path, "--delta", "1e-5,1e-7", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["computed_chunks"], out["resumed_chunks"]) == (1, 2)


# ---------------------------------------------------------------------------------------
# Full disk (issue 26): one line naming the file and the free space, exit 1, nothing left behind
# ---------------------------------------------------------------------------------------


def test_memory_mapped_file_is_checked_against_the_free_space(tmp_path, monkeypatch):
    # Before: the map was created sparse and a write into it on a full disk killed the process (SIGBUS).
    import collections
    import errno

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(G.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OSError) as err:
        _grid(str(tmp_path))
    assert err.value.errno == errno.ENOSPC and err.value.filename.endswith("epsilon.npy")
    assert "need" in str(err.value) and "100 bytes free" in str(err.value)
    assert not any(p.name.startswith("chunks-") for p in tmp_path.iterdir())  # checked before the folder is made


def test_preallocation_failure_leaves_no_folder(tmp_path, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(G.os, "posix_fallocate", full)
    with pytest.raises(OSError) as err:
        _grid(str(tmp_path))
    assert err.value.errno == errno.ENOSPC and err.value.filename.endswith("epsilon.npy")
    assert list(tmp_path.iterdir()) == []


class _FullFile:
    """A text file that takes the first ``room`` characters and then reports a full disk."""

    def __init__(self, path, room):
        self._fh, self._room = open(path, "w"), room

    def write(self, text):
        import errno

        if len(text) > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(text)
        return self._fh.write(text)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def test_csv_on_a_full_disk_removes_its_temporary_file(tmp_path, monkeypatch, reference):
    import errno

    res = _grid()
    monkeypatch.setattr(G, "open", lambda path, mode="r": _FullFile(path, 100), raising=False)
    path = str(tmp_path / "epsilon_grid.csv")
    with pytest.raises(OSError) as err:
        G.write_grid_csv(path, res, chunk_size=4)
    assert err.value.errno == errno.ENOSPC and err.value.filename == path
    assert list(tmp_path.iterdir()) == []  # neither the CSV nor epsilon_grid.csv.tmp


def test_cli_full_disk_one_line_exit_1(tmp_path, capsys, monkeypatch, reference):
    import collections

    from jaxdp.cli import grid

    usage = collections.namedtuple("usage", "total used free")
    real = G.shutil.disk_usage
    monkeypatch.setattr(G.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    assert main(_cli(tmp_path, "--delta", "1e-5")) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("jaxdp: error: no space left on the device writing ") and "epsilon.npy" in err, err
    assert " free)" in err and "\n" not in err and "Traceback" not in err and captured.out == ""
    # The CSV: a full disk while writing it, after the grid was computed.
    monkeypatch.setattr(G.shutil, "disk_usage", real)
    monkeypatch.setattr(grid, "_heatmap", lambda *a, **k: None)
    monkeypatch.setattr(G, "open", lambda path, mode="r": _FullFile(path, 100) if path.endswith(".csv.tmp")
                        else open(path, mode), raising=False)
    assert main(_cli(tmp_path, "--delta", "1e-5")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdp: error: no space left on the device writing ") and "epsilon_grid.csv'" in err, err
    assert "\n" not in err and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_cli_range_sizes_are_capped_before_allocation(tmp_path, capsys):
    # Before: --q 1e-3:1e-1:1000000000 allocated a billion floats and died with MemoryError.
    from jaxdp.cli._common import MAX_RANGE_POINTS

    argv = ["grid", "--q", "1e-3:1e-1:1000000000", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5",
            "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"jaxdp: error: --q: the point count N of LO:HI:N must be in [1, {MAX_RANGE_POINTS:_}]; "
                   "got 1000000000")


def _small_file_system_runs(folder, script):
    """Run ``script`` (Python) in a user and mount namespace with a 64 kB tmpfs on ``folder``; None if not allowed."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{folder}'"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    env = dict(os.environ, JAXDP_CACHE_DIR="off", PYTHONPATH=os.getcwd())
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{folder}' && "
                           f"exec '{sys.executable}' -c \"$0\"", script], capture_output=True, text=True, env=env,
                          timeout=300)


def test_full_disk_on_a_real_small_file_system(tmp_path):
    # 64 kB: 10,000 configurations need 80 kB of results (refused before the map is made);
    # 2,000 need 16 kB (they fit) but their CSV does not (one line, and no temporary file left).
    folder = tmp_path / "fs"
    folder.mkdir()
    script = f"""
import os, sys
from jaxdp.cli.main import main
base = ["grid", "--noise-multiplier", "0.5:5:50", "--num-steps", "100", "--delta", "1e-5", "--orders", "2,4,8,16,32",
        "--no-progress", "--out", "{folder}/g"]
print("rc", main([*base, "--q", "1e-4:1e-1:200"]), file=sys.stderr, flush=True)
print("rc", main([*base, "--q", "1e-4:1e-1:40"]), file=sys.stderr, flush=True)
print("files", sorted(os.listdir("{folder}/g")), file=sys.stderr)
"""
    res = _small_file_system_runs(folder, script)
    if res is None:
        pytest.skip("no user/mount namespaces here (unshare -rm): the small file system needs them")
    lines = [ln for ln in res.stderr.splitlines() if not ln.startswith(("WARNING", "W0", "I0"))]
    assert len(lines) == 5, res.stderr
    assert lines[0].startswith("jaxdp: error: no space left on the device writing ") and "epsilon.npy" in lines[0]
    assert lines[1] == "rc 1" and " free)" in lines[0]
    assert lines[2].startswith("jaxdp: error: no space left on the device writing ") and "epsilon_grid.csv'" in lines[2]
    assert lines[3] == "rc 1"
    files = lines[4]
    assert ".tmp" not in files and "epsilon_grid.csv" not in files, files
