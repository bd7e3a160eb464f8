"""Nothing secret is written outside checkpoints: not the noise key, not the random stopping step.

Each mechanism (PNSGD with a fixed schedule and with random stopping, DP-SGD, DP-SBCD) runs
through the public API (``train`` with its printed report, the report's table and the
public ledger as JSON) and through the command line (``jaxdp train`` as text and as JSON,
its plot, and for DP-SGD ``jaxdp per-instance`` with its CSV and histogram), with
checkpoints in a folder of their own. Everything written elsewhere (stdout, stderr, every
file's bytes, PNG text chunks decompressed, every file name) is searched for:

* the key data of the noise key, of the two keys split from it (noise, stopping time) and
  of every key in the final state: raw bytes (both byte orders), hex and decimal words;
* the stopping step of the random-stop runs, as a decimal token (not part of a longer
  number or a decimal fraction). The seeds are chosen so that it is a number no public
  quantity of the run equals (checked), so the search is meaningful.

The noise seed is fixed (a test needs known keys); its 32-bit value is distinctive too.
"""

from __future__ import annotations

import json
import re
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.cli.main import main
from jaxdp.data import from_arrays
from jaxdp.models import MLP, LipschitzMLP, SoftmaxRegression
from jaxdp.training import (
    DPSBCDMechanism,
    DPSGDMechanism,
    PNSGDMechanism,
    RunOptions,
    latest_checkpoint_step,
    samplers,
    train,
)

SEED = 0xB57A9E04  # key data [0, 0xB57A9E04]; its stopping steps: 31 of 32 (API), 67 of 89 (CLI)
API_STOP, CLI_STOP = 31, 67


def _data():
    rng = np.random.default_rng(0)
    return from_arrays(rng.normal(size=(96, 6)), rng.integers(0, 3, size=96), test_fraction=0.0)


API = {
    "pnsgd": (lambda: SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)),
              lambda: PNSGDMechanism(learning_rate=1.0, radius=5.0, noise_multiplier=1.0, batch_size=3)),
    "pnsgd_random_stop": (lambda: SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)),
                          lambda: PNSGDMechanism(learning_rate=1.0, radius=5.0, noise_multiplier=1.0, batch_size=3,
                                                 schedule="random_stop")),
    # Poisson batches: the batches' key is a second secret in the state (uncut: eta*beta*(n+1)/b <= 2).
    "pnsgd_poisson": (lambda: SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)),
                      lambda: PNSGDMechanism(learning_rate=0.05, radius=5.0, noise_multiplier=1.0, batch_size=3,
                                             sampling="poisson")),
    # Shuffled batches: the permutations' key is a second secret in the state.
    "pnsgd_shuffle": (lambda: SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)),
                      lambda: PNSGDMechanism(learning_rate=0.05, radius=5.0, noise_multiplier=1.0, batch_size=3,
                                             sampling="shuffle")),
    "dpsgd": (lambda: MLP((6, 4, 3), rngs=nnx.Rngs(0)),
              lambda: DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, learning_rate=0.1, batch_size=3)),
    "dpsgd_shuffle": (lambda: MLP((6, 4, 3), rngs=nnx.Rngs(0)),
                      lambda: DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, learning_rate=0.1, batch_size=3,
                                             sampler=samplers.Shuffle())),
    "dpsgd_truncated_poisson": (lambda: MLP((6, 4, 3), rngs=nnx.Rngs(0)),
                                lambda: DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, learning_rate=0.1,
                                                       batch_size=3, sampler=samplers.TruncatedPoisson(4))),
    "dpsbcd": (lambda: LipschitzMLP((6, 8, 3), rngs=nnx.Rngs(0), max_spectral_norm=2.0),
               lambda: DPSBCDMechanism(learning_rate=0.05, clip_norm=1.0, contraction=1.0,
                                       noise_temperature=[1e-3], batch_size=3)),
}

CLI = {
    "pnsgd": ["--algorithm", "pnsgd"],
    "pnsgd_random_stop": ["--algorithm", "pnsgd", "--schedule", "random-stop"],
    "dpsgd": ["--algorithm", "dpsgd"],
    "dpsgd_balls_in_bins": ["--algorithm", "dpsgd", "--sampler", "balls-in-bins"],
    "dpsbcd": ["--algorithm", "dpsbcd", "--model", "mlp", "--noise-temperature", "1e-3", "--contraction", "1",
               "--learning-rate", "0.05"],
}


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_words(state=None) -> list[np.ndarray]:
    """uint32 key data of the seed's key, its two splits, and every key in ``state``."""
    key = jax.random.key(SEED)
    keys = [key, *jax.random.split(key)]
    if state is not None:
        keys += [leaf for leaf in jax.tree.leaves(state) if _is_key(leaf)]
    return [np.asarray(jax.random.key_data(k), np.uint32).reshape(-1) for k in keys]


def _needles(words: list[np.ndarray]) -> tuple[list[bytes], list[str]]:
    raw, text = [], []
    for w in words:
        for order in ("<", ">"):
            raw.append(w.astype(order + "u4").tobytes())
        for v in w.tolist():
            if v > 0xFFFF:  # a word of the key (not a zero or a tiny number); its decimal and hex forms
                text += [str(v), f"{v:08x}", f"{v:x}", f"{v:08X}"]
                raw += [struct.pack("<I", v), struct.pack(">I", v)]
        text.append(w.astype("<u4").tobytes().hex())
        text.append(w.astype(">u4").tobytes().hex())
    return raw, text


def _png_text(data: bytes) -> str:
    """The text chunks of a PNG (tEXt, iTXt, zTXt decompressed)."""
    out, i = [], 8
    while i + 8 <= len(data):
        (length,), kind = struct.unpack(">I", data[i:i + 4]), data[i + 4:i + 8]
        body = data[i + 8:i + 8 + length]
        if kind == b"zTXt":
            name, _, rest = body.partition(b"\0")
            out.append(name.decode("latin-1") + " " + zlib.decompress(rest[1:]).decode("latin-1"))
        elif kind in (b"tEXt", b"iTXt"):
            out.append(body.decode("latin-1"))
        i += 12 + length
    return "\n".join(out)


def _token(n: int) -> re.Pattern:
    return re.compile(rf"(?<![\d.]){n}(?![\d.])")


def _check(blobs: dict[str, bytes], words, stop: int | None, public: set[int]):
    raw, text = _needles(words)
    if stop is not None:
        assert stop >= 10 and stop not in public, "pick a seed whose stopping step is a distinctive number"
    for where, blob in blobs.items():
        for needle in raw:
            assert needle not in blob, f"key bytes {needle.hex()} in {where}"
        s = blob.decode("latin-1")
        if where.endswith(".png"):
            s = _png_text(blob)
        for needle in text:
            assert needle.lower() not in s.lower(), f"key text {needle} in {where}"
        if stop is not None:
            assert not _token(stop).search(s), f"the stopping step {stop} in {where}: {s[:300]!r}"


def _files(root) -> dict[str, bytes]:
    """Every file under ``root`` by content, and every file name (as one blob)."""
    out = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    out["<file names>"] = "\n".join(str(p.relative_to(root)) for p in sorted(root.rglob("*"))).encode()
    return out


@pytest.mark.parametrize("name", sorted(API))
def test_the_public_api_writes_no_secret(name, tmp_path, capfd):
    make_model, make_mech = API[name]
    ck = tmp_path / "checkpoints"
    res = train(make_model(), _data(), make_mech(), order_seed=2, noise_seed=SEED,
                options=RunOptions(progress=True, checkpoint_dir=str(ck), checkpoint_every=4))
    out, err = capfd.readouterr()
    # The printed report leads with the release's ε (after the NOT PRIVATE line of a fixed seed).
    worst = res.privacy.summary()["worst"]
    first = 2 if res.privacy.note else 1  # a scheme without certified amplification says so first
    assert res.privacy.table().splitlines()[first].startswith(f"epsilon = {worst:.4g} at delta = 1e-05")
    blobs = {"stdout": out.encode(), "stderr": err.encode(), "report": res.privacy.table().encode(),
             "ledger.json": json.dumps(res.ledger.public()).encode(),
             "history": repr(res.history).encode()}
    stop = None
    led = res.ledger
    public = {led.records, led.batch_size, led.steps_per_pass, led.passes, 96, 6, 3}
    if name == "pnsgd_random_stop":
        stop = int(led.total_steps)  # the secret, kept in the full ledger for checkpoints
        assert stop == API_STOP and latest_checkpoint_step(ck) == stop
    _check(blobs, _key_words(res.state), stop, public)


@pytest.mark.parametrize("name", sorted(CLI))
def test_the_command_line_writes_no_secret(name, tmp_path, capfd, monkeypatch):
    out_dir, ck = tmp_path / "out", tmp_path / "checkpoints"
    out_dir.mkdir()
    monkeypatch.chdir(out_dir)  # anything written to the working folder is searched too
    base = ["train", "--smoke", "--batch-size", "16", "--insecure-noise-seed", str(SEED), "--order-seed", "2",
            "--checkpoint-dir", str(ck), *CLI[name]]
    blobs = {}
    assert main([*base, "--plot", str(out_dir / "eps.png")]) == 0
    text_out, text_err = capfd.readouterr()
    assert main([*base, "--resume", "--json", "--plot", str(out_dir / "eps_json.png")]) == 0
    json_out, json_err = capfd.readouterr()
    payload = json.loads(json_out)
    # Both outputs lead with the release's ε (the text after its NOT PRIVATE line).
    assert list(payload)[:2] == ["epsilon_worst", "delta"]
    first = 2 if payload.get("note") else 1  # a scheme without certified amplification says so first
    assert text_out.splitlines()[first].startswith("guarantee of the released model: epsilon = ")
    blobs.update({"stdout (text)": text_out.encode(), "stderr (text)": text_err.encode(),
                  "stdout (json)": json_out.encode(), "stderr (json)": json_err.encode()})
    if name == "dpsgd":
        assert main(["per-instance", "--checkpoint-dir", str(ck), "--out", str(out_dir / "per_point.csv"),
                     "--histogram", str(out_dir / "per_point.png")]) == 0
        pi_out, pi_err = capfd.readouterr()
        blobs.update({"stdout (per-instance)": pi_out.encode(), "stderr (per-instance)": pi_err.encode()})
        assert (out_dir / "per_point.csv").exists()
    blobs.update(_files(out_dir))
    led = payload["ledger"]
    public = {led["records"], led["batch_size"], led["steps_per_pass"], led["passes"], led.get("unused", 0), 1797,
              64, 10}
    stop = None
    if name == "pnsgd_random_stop":
        stop = latest_checkpoint_step(ck)  # the secret step, inside the checkpoints only
        assert stop == CLI_STOP and led["steps_per_pass"] == 89
    _check(blobs, _key_words(), stop, public)


def test_the_search_finds_a_leak():
    """The search is not vacuous: each form of the key and the stopping step is caught."""
    words = _key_words()
    raw, text = _needles(words)
    leaks = [raw[0], raw[-1], text[0].encode(), text[-1].encode(), f"stopped after {API_STOP} steps".encode(),
             f"step={API_STOP},".encode()]
    for leak in leaks:
        with pytest.raises(AssertionError):
            _check({"out": b"epsilon = 1.31 at 0.31 ... " + leak + b" 1.5"}, words, API_STOP, {32})
    _check({"out": f"epsilon = 1.{API_STOP} at delta 0.{API_STOP} n=1{API_STOP}".encode()}, words, API_STOP, {32})
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"zTXt", b"Comment\0\0" + zlib.compress(f"T={API_STOP}".encode()))
    with pytest.raises(AssertionError):
        _check({"plot.png": png}, words, API_STOP, {32})


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
