"""Atomic, integrity-checked checkpoints of a training run with orbax-checkpoint.

A checkpoint is one directory per save, ``<directory>/<index>/``, named by an opaque save
counter (1, 2, 3, ...), never by the training step: with random stopping the step is
secret, and a directory listing must not show it. Each holds two items:

* ``state``: a flat dict of arrays (every leaf of the train state: parameters, optimiser
  state with its PRNG key as raw key data, step counter, data order, stopping time,
  clipping statistics), written by ``orbax.checkpoint.args.StandardSave``;
* ``meta``: JSON (the privacy ledger, the run's configuration, a fingerprint of the data,
  the training step ``_step`` and the integrity record ``_integrity``), written by
  ``orbax.checkpoint.args.JsonSave`` and padded to a multiple of 1 KiB, so that its size
  does not tell the number of digits of the (possibly secret) step either.

Integrity: ``_integrity`` is the SHA-256 of a canonical JSON of the metadata (configuration,
ledger, step) followed by every array's name, dtype, shape and bytes. :meth:`Checkpointer.restore`
recomputes it and refuses a checkpoint that does not match, in one line. This detects
accidental corruption and naive edits; it is **not** a signature: someone who edits the
files on purpose can recompute the hash. The training loop therefore also recomputes the
privacy ledger from the configuration and the restored step counter and refuses any
disagreement (see ``jaxdp.training.train``); a forger who rewrites the arrays themselves
(e.g. rewinds the step counter together with the ledger) is beyond what a file on the
user's own disk can prevent without a secret key.

Authentication (optional): with a key (``Checkpointer(key=...)``, ``train``'s
``checkpoint_key`` or the ``JAXDP_CHECKPOINT_KEY`` environment variable) each checkpoint
also carries an HMAC-SHA-256 of the same digest under that key, and :meth:`Checkpointer.restore`
refuses any checkpoint without a valid one: someone who edits the files (e.g. the
configuration's noise multiplier, the step counter or ``fixed_noise_seed``) and recomputes
the SHA-256 cannot forge it without the key. A signed checkpoint read without a key is
refused too (it cannot be checked). Without a key, checkpoints are *unauthenticated*
(:attr:`Checkpointer.authenticated` is False) and the command says so.

Ownership: a run holds a lock on its folder (``.jaxdp.lock``, through ``filelock``) from
:meth:`Checkpointer.acquire` until :meth:`Checkpointer.close`, so a second run started on
the same folder fails at once, in one line; the lock dies with its process (a killed run
can be resumed). Every save also records a random run identifier (``_run``, public: it is
drawn independently of every secret), kept across resumes, so that readers can refuse a
folder that holds checkpoints of two runs.

Atomicity: orbax writes into ``<index>.orbax-checkpoint-tmp*`` and renames it to ``<index>``
only once every item is complete, so a run killed mid-save leaves no directory that looks
like a checkpoint; leftover temporary directories are ignored and removed the next time
the directory is opened. If a save raises, this module removes that save's temporary
directory before re-raising. Saving is synchronous.

Fallback: a newer directory that is not an intact checkpoint (empty, without its metadata
or arrays, unreadable) is skipped with a warning naming it, and the newest intact one is
restored. A checkpoint that reads but fails the integrity check is refused (it was edited
or corrupted in place): remove it to resume from an older one.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Checkpointer", "CheckpointError", "latest_checkpoint_step"]

_TMP_MARK = ".orbax-checkpoint-tmp"
_RESERVED = ("_integrity", "_pad")
_PAD_TO = 1024
_LOCK_NAME = ".jaxdp.lock"
KEY_ENV = "JAXDP_CHECKPOINT_KEY"


def _key_bytes(key) -> bytes | None:
    """The HMAC key: ``key`` (str or bytes), else ``$JAXDP_CHECKPOINT_KEY``, else None."""
    if key is None:
        key = os.environ.get(KEY_ENV) or None
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ValueError(f"checkpoint_key (or ${KEY_ENV}) must be a string or bytes of at least 16 characters.")
    return bytes(key)


def _mac(key: bytes, digest: str) -> str:
    return hmac.new(key, digest.encode(), hashlib.sha256).hexdigest()


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, edited or from another run."""


class _Refused(CheckpointError):
    """A checkpoint that reads but must not be used (edited, corrupted in place, another run): no fallback."""


def _index_dirs(directory: Path) -> list[int]:
    """Save indices of the committed checkpoint directories (intact or not), newest first."""
    if not directory.is_dir():
        return []
    return sorted((int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)


def _read_meta(directory: Path, index: int) -> dict:
    """The metadata of checkpoint ``index`` read as plain JSON; raises CheckpointError if absent."""
    path = directory / str(index) / "meta" / "metadata"
    if not (directory / str(index) / "state").is_dir():
        raise CheckpointError(f"checkpoint {index} has no arrays")
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {index} has no metadata") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {index} has unreadable metadata ({type(err).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("_step"), int) or "_integrity" not in meta:
        raise CheckpointError(f"checkpoint {index} has incomplete metadata (no step or integrity record)")
    return meta


def latest_checkpoint_step(directory) -> int | None:
    """Training step of the newest intact checkpoint in ``directory``, or ``None``.

    Read from the checkpoint's metadata (directory names are save counters, not steps);
    directories that are not intact checkpoints are passed over. No orbax import needed.

    Examples:
      >>> import tempfile
      >>> latest_checkpoint_step(tempfile.mkdtemp()) is None
      True
    """
    d = Path(directory)
    for index in _index_dirs(d):
        try:
            return int(_read_meta(d, index)["_step"])
        except CheckpointError:
            continue
    return None


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def _digest(metadata: dict, arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over the metadata (without the reserved keys) and the arrays' bytes."""
    h = hashlib.sha256()
    h.update(_canonical({k: v for k, v in metadata.items() if k not in _RESERVED}))
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(_canonical([name, a.dtype.str, list(a.shape)]))
        h.update(a.tobytes())
    return h.hexdigest()


def _remove_tmp(directory: Path, index: int | None = None) -> None:
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if _TMP_MARK in p.name and (index is None or p.name.split(".", 1)[0] == str(index)):
            shutil.rmtree(p, ignore_errors=True)


class Checkpointer:
    """Save and restore ``(arrays, metadata)`` pairs atomically, with an integrity check.

    Args:
      directory: where checkpoints live (created on the first save).
      max_to_keep: how many of the newest checkpoints to keep (older ones are deleted
        after a new one is committed); keep at least 2 so that resuming can fall back.
        ``None`` keeps every one (DP-SGD runs do, for per-instance accounting at the
        recorded checkpoints).

    Examples:
      >>> import tempfile, numpy as np
      >>> ck = Checkpointer(tempfile.mkdtemp())
      >>> ck.save(3, {"w": np.arange(3.0)}, {"note": "hi"})
      >>> arrays, meta = ck.restore({"w": np.zeros(3)})
      >>> arrays["w"].tolist(), meta["note"], meta["_step"], ck.latest_step()
      ([0.0, 1.0, 2.0], 'hi', 3, 3)
      >>> ck.close()
    """

    def __init__(self, directory, *, max_to_keep: int | None = 2, key=None):
        self.directory = Path(directory).expanduser().absolute()
        self.max_to_keep = None if max_to_keep is None else int(max_to_keep)
        self._manager = None
        self._key = _key_bytes(key)
        self._lock = None
        self.run_id = secrets.token_hex(8)  # public: drawn independently of every secret

    @property
    def authenticated(self) -> bool:
        """True when checkpoints are signed and checked with a key (HMAC-SHA-256)."""
        return self._key is not None

    def acquire(self) -> None:
        """Create the folder if needed and take its lock; one line if another run holds it.

        Raises:
          ValueError: the folder is a file, cannot be written, or another run holds its lock.
        """
        from filelock import FileLock, Timeout  # lazy: only a run with a checkpoint folder takes the lock

        where = str(self.directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint_dir {where!r} is a file, not a folder.")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".jaxdp-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise
            raise ValueError(f"checkpoint_dir {where!r} cannot be written ({err.strerror or err}).") from None
        lock = FileLock(str(self.directory / _LOCK_NAME))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise ValueError(f"checkpoint_dir {where!r} is in use by another run (it holds the folder's lock): "
                             "wait for it to finish, or use another folder.") from None
        self._lock = lock

    def _mngr(self):
        if self._manager is None:
            import orbax.checkpoint as ocp  # lazy: a heavy import, needed only by checkpoints

            _remove_tmp(self.directory)  # leftovers of a run killed mid-save
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep, create=True, enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_names=("state", "meta"))
        return self._manager

    def latest_step(self) -> int | None:
        """Training step of the newest intact checkpoint, or ``None``."""
        return latest_checkpoint_step(self.directory)

    def save(self, step: int, arrays: dict[str, Any], metadata: dict[str, Any], *, index: int | None = None,
             only: bool = False) -> None:
        """Write a checkpoint of training step ``step`` atomically (synchronously).

        Args:
          step: the training step, recorded in the metadata (``_step``), not in any name.
          arrays: a flat dict of arrays.
          metadata: JSON-serialisable dict (keys ``_step``, ``_integrity``, ``_pad`` are reserved).
          index: the save counter naming the directory (default: one more than the largest
            present); must exceed every present one.
          only: remove every other checkpoint once this one is committed.

        Raises:
          ValueError: if ``metadata`` is not JSON-serialisable (checked before anything is
            written) or ``index`` is not above the present ones.
        """
        import orbax.checkpoint as ocp  # lazy: a heavy import, needed only by checkpoints

        meta = {k: v for k, v in metadata.items() if k not in _RESERVED}
        meta["_step"] = int(step)
        meta["_run"] = self.run_id
        try:
            meta = json.loads(json.dumps(meta, allow_nan=True))  # what will be read back
        except (TypeError, ValueError) as err:
            raise ValueError(f"checkpoint metadata must be JSON-serialisable: {err}") from None
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        digest = _digest(meta, arrays)
        meta["_integrity"] = {"sha256": digest}
        if self._key is not None:
            meta["_integrity"]["hmac_sha256"] = _mac(self._key, digest)
        size = len(json.dumps(meta, allow_nan=True)) + len(', "_pad": ""')
        meta["_pad"] = " " * (-size % _PAD_TO)
        present = _index_dirs(self.directory)
        top = present[0] if present else 0
        index = top + 1 if index is None else int(index)
        if index <= top:
            raise ValueError(f"checkpoint index {index} is not above the present ones in {self.directory}.")
        mngr = self._mngr()
        try:
            mngr.save(index, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
            mngr.wait_until_finished()
        except BaseException:
            _remove_tmp(self.directory, index)
            raise
        if not (self.directory / str(index)).is_dir():  # pragma: no cover - orbax contract
            _remove_tmp(self.directory, index)
            raise RuntimeError(f"checkpoint {index} was not committed in {self.directory}.")
        if only:
            for other in _index_dirs(self.directory):
                if other != index:
                    shutil.rmtree(self.directory / str(other), ignore_errors=True)
            self._close_manager()  # orbax's manager caches the list of steps

    def restore(self, like: dict[str, Any], step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """Read the newest intact checkpoint (or the one of training ``step``) into arrays like ``like``.

        Newer directories that are not intact checkpoints are skipped with a warning that
        names them.

        Raises:
          FileNotFoundError: if there is no intact checkpoint (of that step).
          CheckpointError: (a ``ValueError``, one line) if the stored arrays do not match
            ``like`` or the integrity check fails.
        """
        like = {k: np.asarray(v) for k, v in like.items()}
        skipped = []
        for index in _index_dirs(self.directory):
            try:
                meta = _read_meta(self.directory, index)
                if step is not None and meta["_step"] != int(step):
                    continue
                arrays = self._read_arrays(index, meta, like)
            except _Refused:
                raise
            except CheckpointError as err:
                skipped.append(str(err))
                continue
            if skipped:
                warnings.warn(f"skipped what is not an intact checkpoint in {self.directory}: "
                              f"{'; '.join(skipped)}; resuming from checkpoint {index}.", UserWarning, stacklevel=3)
            if isinstance(meta.get("_run"), str):
                self.run_id = meta["_run"]  # a resumed run keeps its identifier
            return arrays, meta
        extra = f" ({'; '.join(skipped)})" if skipped else ""
        raise FileNotFoundError(f"no intact checkpoint to restore in {self.directory}{extra}.")

    def _read_arrays(self, index: int, meta: dict, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import orbax.checkpoint as ocp  # lazy: a heavy import, needed only by checkpoints

        stored = meta.get("_arrays")
        expected = {k: [list(v.shape), str(v.dtype)] for k, v in like.items()}
        if stored is not None and stored != expected:
            raise _Refused(
                "the checkpoint's arrays do not match this run (different model, data or settings): "
                f"{_first_difference(stored, expected)}."
            )
        try:
            out = self._mngr().restore(index, args=ocp.args.Composite(state=ocp.args.StandardRestore(like))).state
            arrays = {k: np.asarray(out[k]) for k in like}
        except Exception as err:  # orbax/tensorstore errors are pages long: one line instead
            raise CheckpointError(f"checkpoint {index} has unreadable arrays ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:120] if str(err) else ''})") from None
        digest = _digest(meta, arrays)
        record = meta.get("_integrity") or {}
        if digest != record.get("sha256"):
            raise _Refused(
                f"checkpoint {index} in {str(self.directory)!r} fails its integrity check (its metadata or arrays "
                "were edited or corrupted): refusing it; delete that folder to resume from an older checkpoint.")
        mac = record.get("hmac_sha256")
        if self._key is None and mac is not None:
            raise _Refused(f"checkpoint {index} in {str(self.directory)!r} is signed: set the checkpoint key "
                           f"(${KEY_ENV} or checkpoint_key) to check it.")
        if self._key is not None and (not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self._key, digest))):
            what = "is not signed" if mac is None else "has a wrong signature"
            raise _Refused(f"checkpoint {index} in {str(self.directory)!r} {what} under the checkpoint key: it was "
                           "not written by a run holding that key (or was edited); refusing it.")
        return arrays

    def steps(self) -> list[int]:
        """Training steps of every checkpoint whose metadata is intact, in increasing order."""
        found = set()
        for index in _index_dirs(self.directory):
            try:
                found.add(int(_read_meta(self.directory, index)["_step"]))
            except CheckpointError:
                continue
        return sorted(found)

    def metadata(self, step: int | None = None) -> dict:
        """The JSON metadata of the checkpoint of training ``step`` (default: the newest), without its arrays.

        The arrays and the integrity record are checked by :meth:`restore`, not here.

        Raises:
          FileNotFoundError: if there is no checkpoint of that step with intact metadata.
        """
        for index in _index_dirs(self.directory):
            try:
                meta = _read_meta(self.directory, index)
            except CheckpointError:
                continue
            if step is None or meta["_step"] == int(step):
                return meta
        raise FileNotFoundError(f"no checkpoint{'' if step is None else f' of step {int(step)}'} in {self.directory}.")

    def save_train(self, step: int, arrays: dict[str, Any], metadata: dict[str, Any], **kwargs) -> None:
        """:meth:`save` with the array signature recorded (checked by :meth:`restore`)."""
        meta = dict(metadata)
        meta["_arrays"] = {k: [list(np.shape(v)), str(np.asarray(v).dtype)] for k, v in arrays.items()}
        self.save(step, arrays, meta, **kwargs)

    def runs(self) -> set[str]:
        """Run identifiers recorded in the intact metadata of this folder (one per run; old checkpoints: none)."""
        found = set()
        for index in _index_dirs(self.directory):
            try:
                run = _read_meta(self.directory, index).get("_run")
            except CheckpointError:
                continue
            if isinstance(run, str):
                found.add(run)
        return found

    def check_one_run(self) -> None:
        """Raise a one-line ValueError if this folder holds checkpoints of more than one run.

        Two runs show as two run identifiers, or (checkpoints without one) as two
        checkpoints of the same training step.
        """
        runs, seen = set(), set()
        for index in _index_dirs(self.directory):
            try:
                meta = _read_meta(self.directory, index)
            except CheckpointError:
                continue
            if isinstance(meta.get("_run"), str):
                runs.add(meta["_run"])
            if meta["_step"] in seen or len(runs) > 1:
                raise ValueError(f"checkpoint_dir {str(self.directory)!r} holds checkpoints of more than one run: "
                                 "use a folder written by one run only.")
            seen.add(meta["_step"])

    def _close_manager(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    def close(self) -> None:
        """Release orbax's resources and the folder's lock."""
        self._close_manager()
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _first_difference(a: dict, b: dict) -> str:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"{k}: stored {a.get(k)}, expected {b.get(k)}"
    return "?"
