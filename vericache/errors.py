"""Typed errors. Each carries one line that tells the user what to do."""


class VeriCacheError(Exception):
    """Base class of every error VeriCache raises on purpose."""


class ModelNotFoundError(VeriCacheError):
    """The named model or checkpoint directory is not available locally."""


class UnsupportedModelError(VeriCacheError):
    """The checkpoint exists but its architecture or settings are not supported."""


class InvalidRequestError(VeriCacheError, ValueError):
    """A request or option is malformed: bad parameters, prompt too long, unsupported sampling."""


class CacheStateError(VeriCacheError):
    """A KV cache was asked for what its contents cannot give (e.g. rolling back evicted KV)."""


class PrefixNotFoundError(VeriCacheError):
    """No registered prefix has this id (or it was deleted)."""


class DataLossError(VeriCacheError):
    """Stored data failed its integrity check and cannot be rebuilt: register the prefix again."""


class QueueFullError(VeriCacheError):
    """The server holds as many requests as it may queue: retry later."""


class DeadlineExceededError(VeriCacheError):
    """The request did not finish within the time its caller gave it; its work was stopped."""


class WorkerUnavailableError(VeriCacheError):
    """No worker of the kind a request needs is running (none placed, or it died)."""


class WorkerGoneError(WorkerUnavailableError):
    """The worker a call was made to did not answer: its process died (or is restarting)."""
