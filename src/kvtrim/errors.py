"""Exception types raised by kvtrim. Each message names the offending parameter and what is allowed."""

from __future__ import annotations


class KVTrimError(Exception):
    """Base class for kvtrim errors."""


class InvalidParameterError(KVTrimError, ValueError):
    """A user-supplied parameter is outside its allowed range; nothing was changed."""


class UnsupportedModelError(KVTrimError, ValueError):
    """The model's architecture or attention implementation is not supported."""


class ModelNotAvailableError(KVTrimError, FileNotFoundError):
    """A model could not be found locally and could not be provisioned."""


class MissingArtifactError(KVTrimError, FileNotFoundError):
    """A method needs an offline calibration artifact that does not exist yet."""


class HaystackUnavailableError(KVTrimError, FileNotFoundError):
    """A haystack text could not be found locally and could not be provisioned."""
