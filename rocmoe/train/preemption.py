"""Stop cleanly on SIGUSR1/SIGTERM: finish the step, checkpoint, exit for a requeue.

Slurm warns a job before its time limit with ``--signal=B:USR1@<seconds>`` (the batch shell
forwards it to the ranks through the launcher) and ends a preempted or requeued job with
SIGTERM, then SIGKILL after KillWait. A handler only records the signal; the training loop
asks :meth:`StopSignals.agreed` once per step, a vote over all ranks, so every rank stops
after the same step even when the signal reached them at different moments. The program
then saves a checkpoint and exits with :data:`EXIT_REQUEUE`, which the sbatch templates
answer with ``scontrol requeue``.
"""

from __future__ import annotations

import signal

from .group import ProcessGroup

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry"
EXIT_REQUEUE = 75

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignals:
    """Records SIGUSR1/SIGTERM while active (a context manager restores the old handlers)."""

    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def request(self, why: str) -> None:
        """Stop as if a signal had come (a scheduled stop, e.g. --stop-after-step)."""
        if self.received is None:
            self.received = why

    def agreed(self, group: ProcessGroup) -> bool:
        """Collective: True on every rank when any rank has been asked to stop."""
        return group.any(self.received is not None, "stop-signal vote")
