"""The noise key is secret: separate from the public order seed, from the OS entropy by
default, never printed or written to the report or ledger, only to checkpoints."""

import json
import os
import secrets

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdp.cli import main
from jaxdp.models import LogisticRegression
from jaxdp.training import train

# 16 records, batches of 4: 4 steps; clipping inactive (the logistic loss's own bound).
RUN = dict(learning_rate=0.5, noise_multiplier=1.0, radius=1.0, batch_size=4, progress=False, account=False)


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    return x.astype(np.float32), (rng.random(16) < 0.5).astype(np.int32)


def _params(res):
    return np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(res.state.params)])


def _train(**kw):
    return train(LogisticRegression(3, rngs=nnx.Rngs(0)), _data(), lipschitz=2.0, smoothness=1.0, convex=True,
                 **{**RUN, **kw})


def test_default_noise_is_fresh_and_not_derived_from_the_public_seed():
    a, b = _train(order_seed=3), _train(order_seed=3)
    # Same public configuration, same order: different noise (OS entropy each time).
    np.testing.assert_array_equal(np.asarray(a.state.order), np.asarray(b.state.order))
    assert not np.allclose(_params(a), _params(b))
    # Not the noise any key derived from the order seed gives (as the single seed used to).
    for derived in (3, 0):
        with pytest.warns(UserWarning, match="NOT PRIVATE"):
            c = _train(order_seed=3, noise_seed=derived)
        assert not np.allclose(_params(a), _params(c))
    led = a.state.ledger
    assert led.order_seed == 3 and led.fixed_noise_seed is False and "seed" not in led.to_json()


def test_fixed_noise_seed_is_reproducible_and_reported_as_not_private():
    with pytest.warns(UserWarning, match="NOT PRIVATE"):
        a = _train(noise_seed=11, account=True)
    with pytest.warns(UserWarning, match="NOT PRIVATE"):
        b = _train(noise_seed=11)
    np.testing.assert_array_equal(_params(a), _params(b))
    assert a.state.ledger.fixed_noise_seed is True and a.privacy.not_private
    assert a.privacy.table().startswith("NOT PRIVATE")


def test_bad_noise_seed_is_rejected():
    with pytest.raises(ValueError, match="noise_seed"):
        _train(noise_seed="7")
    with pytest.raises(ValueError, match="order_seed"):
        _train(order_seed=1.5)


def _words(raw: bytes) -> set[str]:
    """Every way the key could be written: words in decimal and hex, the bytes in hex."""
    like = jax.random.key_data(jax.random.key(0))
    words = np.frombuffer(raw, dtype=like.dtype).tolist()
    out = {raw.hex(), raw[::-1].hex()}
    for w in words:
        out |= {str(w), f"{w:x}", f"{w:08x}"}
    return {s for s in out if len(s) >= 6}  # short strings match by chance


def test_report_and_ledger_contain_no_value_from_which_the_noise_key_can_be_derived(
        monkeypatch, tmp_path, capsys):
    raw = bytes.fromhex("9e3779b97f4a7c15")  # the entropy the run will use
    monkeypatch.setattr(secrets, "token_bytes", lambda n: raw[:n])
    ck = tmp_path / "ck"
    argv = ["train", "--smoke", "--plot", "none", "--order-seed", "5", "--checkpoint-dir", str(ck)]
    assert main([*argv, "--json"]) == 0
    text_json = capsys.readouterr()
    payload = json.loads(text_json.out)
    assert payload["private"] is True and payload["ledger"]["order_seed"] == 5
    assert not any("key" in k or k == "seed" or k == "noise_seed" for k in payload["ledger"])
    assert main(["train", "--smoke", "--plot", "none", "--order-seed", "5"]) == 0
    text = capsys.readouterr()
    printed = text_json.out + text_json.err + text.out + text.err
    # Nowhere in what the command printed (text and JSON), nor in a checkpoint's file names.
    for w in _words(raw):
        assert w not in printed, w
    for _, dirs, files in os.walk(ck):
        for name in dirs + files:
            assert not any(w in name for w in _words(raw))


def test_the_noise_comes_from_the_entropy(monkeypatch):
    """With the entropy patched, the run equals one whose noise key is exactly those bytes."""
    raw = bytes.fromhex("0123456789abcdef")
    monkeypatch.setattr(secrets, "token_bytes", lambda n: raw[:n])
    a, b = _train(), _train()
    np.testing.assert_array_equal(_params(a), _params(b))  # same entropy, same noise
    monkeypatch.setattr(secrets, "token_bytes", lambda n: bytes.fromhex("fedcba9876543210")[:n])
    assert not np.allclose(_params(a), _params(_train()))


def test_insecure_noise_seed_is_announced_first(capsys):
    assert main(["train", "--smoke", "--plot", "none", "--insecure-noise-seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NOT PRIVATE (--insecure-noise-seed)")
    assert main(["train", "--smoke", "--plot", "none", "--insecure-noise-seed", "3", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["private"] is False and payload["ledger"]["fixed_noise_seed"] is True
