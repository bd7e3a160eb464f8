"""Atomic checkpoints of a training run with orbax-checkpoint.

A checkpoint is one directory per step, ``<directory>/<step>/``, holding two items:

* ``state``: a flat dict of arrays (every leaf of the train state: parameters, optimiser
  state with its PRNG key as raw key data, step counter, data order, stopping time,
  clipping statistics), written by ``orbax.checkpoint.args.StandardSave``;
* ``meta``: JSON (the privacy ledger, the run's configuration and a fingerprint of the
  data), written by ``orbax.checkpoint.args.JsonSave``.

Atomicity: orbax writes into ``<step>.orbax-checkpoint-tmp*`` and renames it to
``<step>`` only once every item is complete, so a run killed mid-save leaves no directory
that looks like a checkpoint; leftover temporary directories are ignored and removed the
next time the directory is opened. If a save raises, this module removes that step's
temporary directory before re-raising, so no partial checkpoint is left behind. Saving is
synchronous (the call returns once the checkpoint is committed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Checkpointer", "latest_checkpoint_step"]

_TMP_MARK = ".orbax-checkpoint-tmp"


def _is_step_dir(p: Path) -> bool:
    return p.is_dir() and p.name.isdigit()


def latest_checkpoint_step(directory) -> int | None:
    """Largest committed checkpoint step in ``directory``, or ``None`` (no orbax import needed).

    Temporary (uncommitted) directories are not counted.

    Examples:
      >>> import tempfile
      >>> latest_checkpoint_step(tempfile.mkdtemp()) is None
      True
    """
    d = Path(directory)
    if not d.is_dir():
        return None
    steps = [int(p.name) for p in d.iterdir() if _is_step_dir(p)]
    return max(steps) if steps else None


def _remove_tmp(directory: Path, step: int | None = None) -> None:
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if _TMP_MARK in p.name and (step is None or p.name.split(".", 1)[0] == str(step)):
            shutil.rmtree(p, ignore_errors=True)


class Checkpointer:
    """Save and restore ``(arrays, metadata)`` pairs atomically, one directory per step.

    Args:
      directory: where checkpoints live (created on the first save).
      max_to_keep: how many of the newest checkpoints to keep (older ones are deleted
        after a new one is committed); ``None`` keeps every one (DP-SGD runs do, for
        per-instance accounting at the recorded checkpoints).

    Examples:
      >>> import tempfile, numpy as np
      >>> ck = Checkpointer(tempfile.mkdtemp())
      >>> ck.save(3, {"w": np.arange(3.0)}, {"note": "hi"})
      >>> arrays, meta = ck.restore({"w": np.zeros(3)})
      >>> arrays["w"].tolist(), meta["note"], ck.latest_step()
      ([0.0, 1.0, 2.0], 'hi', 3)
      >>> ck.close()
    """

    def __init__(self, directory, *, max_to_keep: int | None = 2):
        self.directory = Path(directory).expanduser().absolute()
        self.max_to_keep = None if max_to_keep is None else int(max_to_keep)
        self._manager = None

    def _mngr(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            _remove_tmp(self.directory)  # leftovers of a run killed mid-save
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep, create=True, enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_names=("state", "meta"))
        return self._manager

    def latest_step(self) -> int | None:
        """Largest committed step, or ``None``."""
        return latest_checkpoint_step(self.directory)

    def save(self, step: int, arrays: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Write checkpoint ``step`` atomically (synchronously).

        Raises:
          ValueError: if ``metadata`` is not JSON-serialisable (checked before anything is
            written) or ``step`` already exists.
        """
        import orbax.checkpoint as ocp

        try:
            json.dumps(metadata, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"checkpoint metadata must be JSON-serialisable: {err}") from None
        step = int(step)
        if (self.directory / str(step)).exists():
            raise ValueError(f"checkpoint step {step} already exists in {self.directory}.")
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        mngr = self._mngr()
        try:
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                    meta=ocp.args.JsonSave(metadata)), force=True)
            mngr.wait_until_finished()
        except BaseException:
            _remove_tmp(self.directory, step)
            raise
        if not (self.directory / str(step)).is_dir():  # pragma: no cover - orbax contract
            _remove_tmp(self.directory, step)
            raise RuntimeError(f"checkpoint {step} was not committed in {self.directory}.")

    def restore(self, like: dict[str, Any], step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """Read checkpoint ``step`` (default: the latest) into arrays shaped like ``like``.

        Raises:
          FileNotFoundError: if there is no committed checkpoint.
          ValueError: if the stored arrays do not match ``like`` (names, shapes, dtypes).
        """
        import orbax.checkpoint as ocp

        step = self.latest_step() if step is None else int(step)
        if step is None or not (self.directory / str(step)).is_dir():
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}.")
        like = {k: np.asarray(v) for k, v in like.items()}
        mngr = self._mngr()
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        stored = meta.get("_arrays")
        expected = {k: [list(v.shape), str(v.dtype)] for k, v in like.items()}
        if stored is not None and stored != expected:
            raise ValueError(
                "the checkpoint's arrays do not match this run (different model, data or settings): "
                f"{_first_difference(stored, expected)}."
            )
        out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like))).state
        arrays = {k: np.asarray(out[k]) for k in like}
        return arrays, meta

    def steps(self) -> list[int]:
        """Every committed step, in increasing order."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if _is_step_dir(p))

    def metadata(self, step: int | None = None) -> dict:
        """The JSON metadata of checkpoint ``step`` (default: the latest), without its arrays.

        Raises:
          FileNotFoundError: if there is no such committed checkpoint.
        """
        import orbax.checkpoint as ocp

        step = self.latest_step() if step is None else int(step)
        if step is None or not (self.directory / str(step)).is_dir():
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}.")
        return self._mngr().restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def save_train(self, step: int, arrays: dict[str, Any], metadata: dict[str, Any]) -> None:
        """:meth:`save` with the array signature recorded (checked by :meth:`restore`)."""
        meta = dict(metadata)
        meta["_arrays"] = {k: [list(np.shape(v)), str(np.asarray(v).dtype)] for k, v in arrays.items()}
        self.save(step, arrays, meta)

    def close(self) -> None:
        """Release orbax's resources."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


def _first_difference(a: dict, b: dict) -> str:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"{k}: stored {a.get(k)}, expected {b.get(k)}"
    return "?"
