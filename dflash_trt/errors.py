"""One exception hierarchy for dflash_trt (docs/style.md R7).

Every message says what was found, what was expected, and the fix. Each class also
inherits the matching built-in so callers that catch ``ValueError`` keep working.
The CLI turns any ``DFlashError`` into one line and exit code 2.
"""

from __future__ import annotations


class DFlashError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointFormatError(DFlashError, ValueError):
    """A checkpoint file or folder is malformed, unsupported or unsafe to load."""


class IncompatiblePairError(DFlashError, ValueError):
    """A target and a drafter cannot be used together."""


class UnsupportedArchitectureError(CheckpointFormatError):
    """The checkpoint is a model family this version does not run (e.g. DFlash2)."""


class RequestError(DFlashError, ValueError):
    """A generation request is invalid (prompt too long, bad sampling parameters, ...)."""


class ConfigError(DFlashError, ValueError):
    """A configuration object (a build or session setting) has a field of the wrong type or out of range."""


class TokenizerError(DFlashError, ValueError):
    """Text cannot be encoded or decoded with the available tokenizer."""


class BackendUnavailableError(DFlashError, ImportError):
    """A backend was requested that cannot run on this machine or is not installed."""


def field_error(cls: type[DFlashError], source: str, field: str, found: object, expected: str, fix: str) -> DFlashError:
    """Build an error whose message names the field, what was found, what was expected, and the fix."""
    return cls(f"{source}: field `{field}` is {found!r}; expected {expected}. Fix: {fix}")


def validation_error(cls: type[DFlashError], source: str, exc: Exception, fix: str) -> DFlashError:
    """One line from a pydantic ``ValidationError``: its first problem's field, the value found and the rule."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(whole object)"
    found = first.get("input")
    shown = repr(found) if len(repr(found)) <= 80 else repr(found)[:77] + "..."
    rule = first["msg"][0].lower() + first["msg"][1:]
    return cls(f"{source}: field `{field}` is {shown}; expected a value where {rule}. Fix: {fix}")


class EngineFormatError(DFlashError, ValueError):
    """An engine folder is malformed, incomplete or was modified after the build (a hash mismatch)."""


class IncompatibleEngineError(DFlashError, ValueError):
    """An engine folder is valid but was built for another format version, device, toolchain or plugin ABI."""


class OutputExistsError(DFlashError, FileExistsError):
    """An output path already holds something a command would overwrite (without ``--force``, or not ours)."""


class EngineExistsError(OutputExistsError):
    """A build would overwrite an existing engine folder without ``--force``, or a path that is no engine folder."""


class InsufficientMemoryError(DFlashError, MemoryError):
    """What a session would allocate at start-up (its KV caches) does not fit in the memory available here."""


class ServingError(DFlashError, RuntimeError):
    """A Triton model repository cannot be written, or the bundled tritonserver failed to start or stop."""


class NumericalError(DFlashError, RuntimeError):
    """A network produced logits that are not a distribution (NaN or inf) for a request that samples from them."""


class TrainingError(DFlashError, ValueError):
    """A drafter-training or evaluation run cannot start or continue: bad settings, unusable data or prompt
    files, or a ``--resume`` whose checkpoint does not match the run."""
