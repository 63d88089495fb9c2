"""One error hierarchy for everything rocmoe raises.

Every message says what was expected, what came, and what to do about it.
Subclasses also derive from the matching builtin (ValueError, TypeError,
TimeoutError, ...) so generic ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class RocmoeError(Exception):
    """Base class of every error rocmoe raises on purpose."""


# --- configuration and input ----------------------------------------------
class InvalidArgumentError(RocmoeError, ValueError):
    """An argument has the wrong value, shape or length."""


class DTypeError(RocmoeError, TypeError):
    """A tensor has a dtype the operation does not accept."""


class DeviceMismatchError(RocmoeError, ValueError):
    """Tensors live on different devices, or on a device the backend cannot use."""


class ConfigurationError(RocmoeError, ValueError):
    """A layer or runtime configuration that cannot work (e.g. top_k > experts)."""


class PlacementError(ConfigurationError):
    """A vExpert placement that cannot work: no free slot, an expert's last replica removed,
    ranks holding different placements, or a placement that does not fit the layer."""


# --- build and backends ------------------------------------------------------
class BackendUnavailableError(RocmoeError, RuntimeError):
    """The requested backend was not compiled in, or its hardware is absent."""


class NativeLibraryError(RocmoeError, ImportError):
    """librocmoe or its cffi module could not be loaded."""


class SystemCallError(RocmoeError, OSError):
    """An operating-system or GPU-driver call inside librocmoe failed."""


# --- context lifecycle ------------------------------------------------------
class ContextError(RocmoeError, RuntimeError):
    """The context is in the wrong state (used after finalize, not initialised)."""


# --- symmetric heap -----------------------------------------------------------
class HeapError(RocmoeError, RuntimeError):
    """Base class of symmetric-heap errors."""


class HeapMismatchError(HeapError):
    """Ranks made different collective heap calls (size, dtype or order differ)."""


class HeapExhaustedError(HeapError, MemoryError):
    """The symmetric heap has no room for the request."""


class NotOnHeapError(HeapError, ValueError):
    """A tensor that should live on the symmetric heap does not."""


class PeerUnreachableError(HeapError):
    """A peer's memory is not directly addressable from this rank."""


# --- communication ------------------------------------------------------------
class CommError(RocmoeError, RuntimeError):
    """Base class of communication errors."""


class CommTimeoutError(CommError, TimeoutError):
    """A bounded wait ran out (ROCMOE_TIMEOUT_S)."""


class PeerDeadError(CommError):
    """A peer process exited while this rank was waiting for it."""


class CollectiveMismatchError(CommError):
    """Ranks entered different collectives, or the same one with different arguments."""


# --- training runs ------------------------------------------------------------
class CheckpointError(RocmoeError, RuntimeError):
    """A checkpoint is incomplete, corrupt, or from another run (world size, configuration)."""


class DataFormatError(RocmoeError, ValueError):
    """An input data file has a malformed record (the message names the file and line)."""


__all__ = [name for name, obj in globals().items()
           if isinstance(obj, type) and issubclass(obj, RocmoeError)]
