"""How the processes of a multi-process (multi-host) run agree during one checkpoint save.

Every process writes its own shards into ONE shared staging directory; only process 0
prepares that directory, computes the manifest and publishes it. A `SaveGroup` carries the
few messages this needs, in order:

1. process 0 -> all: the staging directory it created (or why it could not);
2. every other process -> process 0: its part of the Orbax payload is written (or failed);
3. process 0 -> all: the step is published (or why not); then a barrier, so no process
   leaves `save` before the checkpoint is visible.

The messages go through the JAX coordination service (the key-value store and barriers
behind `jax.distributed`), not through device collectives: they move no device data, they
time out instead of hanging forever, and they are safe to use from the background thread of
an `AsyncCheckpointer` while the main thread runs collective train steps.

Keys are `jrl_checkpoint/<n>/...` where n counts this process's saves: every process must
call `save` the same number of times, in the same order (with the same step and root,
which is checked).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

# Seconds any process waits for another (process 0 may first wait for the writer lock,
# and it hashes every payload file before publishing, so this is generous).
TIMEOUT_S = 3600

_OK = "ok"
_FAILED = "failed: "
_sequence = itertools.count()


class SaveGroup:
    """The processes taking part in one checkpoint save, and the messages between them."""

    def __init__(self, step: int, root: Path):
        self.step = step
        self.root = Path(os.path.abspath(root))
        self.process = jax.process_index()
        self.process_count = jax.process_count()
        self.number = next(_sequence)
        self._client = ocp.multihost.get_jax_distributed_client()
        self._prefix = f"jrl_checkpoint/{self.number}"

    @classmethod
    def for_save(cls, step: int, root: Path) -> SaveGroup | None:
        """The group of a save by every process of this run; None for a single process."""
        return cls(step, root) if jax.process_count() > 1 else None

    @property
    def is_primary(self) -> bool:
        return self.process == 0

    def orbax_options(self) -> ocp.options.MultiprocessingOptions:
        """Orbax's own barriers of this save get names no other save uses."""
        return ocp.options.MultiprocessingOptions(
            primary_host=0, barrier_sync_key_prefix=f"jrl_checkpoint_{self.number}")

    # ------------------------------------------------------------------ messages

    def _get(self, key: str, waiting_for: str) -> str:
        try:
            return self._client.blocking_key_value_get(f"{self._prefix}/{key}", TIMEOUT_S * 1000)
        except jax.errors.JaxRuntimeError as e:
            raise TimeoutError(f"checkpoint save of step {self.step} (save #{self.number}): process "
                               f"{self.process} waited {TIMEOUT_S} s for {waiting_for}: {e}") from e

    def _set(self, key: str, value: str) -> None:
        self._client.key_value_set(f"{self._prefix}/{key}", value)

    def share_staging(self, staging: Path | None, error: BaseException | None = None) -> Path:
        """Process 0 passes the staging directory it created (or the error that stopped it);
        every other process gets that directory back, or a RuntimeError saying why not."""
        expected = f"step={self.step} root={self.root}"
        if self.is_primary:
            if error is not None:
                self._set("staging", f"{_FAILED}{type(error).__name__}: {error}")
            else:
                self._set("staging", f"{_OK} {expected} staging={Path(os.path.abspath(staging))}")
            return staging
        message = self._get("staging", "process 0 to create the staging directory")
        if message.startswith(_FAILED):
            raise RuntimeError(f"checkpoint save of step {self.step}: process 0 could not prepare it: "
                               f"{message.removeprefix(_FAILED)}")
        head, _, staging_path = message.partition(" staging=")
        if head != f"{_OK} {expected}":
            error = RuntimeError(f"checkpoint save #{self.number}: processes disagree on what to save: "
                                 f"process 0 saves {head.removeprefix(_OK).strip()}, process "
                                 f"{self.process} {expected}; every process must call save with the "
                                 "same step and root, in the same order")
            self.report_payload(error)  # process 0 stops waiting for this process's shards
            raise error
        return Path(staging_path)

    def report_payload(self, error: BaseException | None) -> None:
        """A process other than 0 says its part of the payload is complete (or failed)."""
        self._set(f"payload/{self.process}",
                  _OK if error is None else f"{_FAILED}{type(error).__name__}: {error}")

    def collect_payloads(self) -> None:
        """Process 0 waits until every other process wrote its part; raises RuntimeError
        naming the first process that failed."""
        for process in range(1, self.process_count):
            message = self._get(f"payload/{process}", f"process {process} to write its shards")
            if message != _OK:
                raise RuntimeError(f"checkpoint save of step {self.step}: process {process} failed to "
                                   f"write its shards: {message.removeprefix(_FAILED)}")

    def announce_publication(self, error: BaseException | None) -> None:
        """Process 0 tells every process whether the step was published; after a success
        all processes leave together (barrier) and the save's keys are removed."""
        self._set("published", _OK if error is None else f"{_FAILED}{type(error).__name__}: {error}")
        if error is None:
            self._barrier()
            self._client.key_value_delete(f"{self._prefix}/")

    def wait_for_publication(self) -> None:
        """A process other than 0 waits until process 0 published the step; raises
        RuntimeError with process 0's error when it did not."""
        message = self._get("published", "process 0 to publish the checkpoint")
        if message != _OK:
            raise RuntimeError(f"checkpoint save of step {self.step}: process 0 did not publish it: "
                               f"{message.removeprefix(_FAILED)}")
        self._barrier()

    def _barrier(self) -> None:
        try:
            self._client.wait_at_barrier(f"{self._prefix}/done", TIMEOUT_S * 1000)
        except jax.errors.JaxRuntimeError as e:
            raise TimeoutError(f"checkpoint save of step {self.step} (save #{self.number}): process "
                               f"{self.process} waited {TIMEOUT_S} s for the other processes after "
                               f"publication: {e}") from e
