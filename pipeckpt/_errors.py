"""One error type for every bad setting, so that users and the CLI can tell a
configuration mistake (fix the config) from a bug (report it).

Every message follows one shape: the value received, the rule it breaks, and a
``HINT`` naming the setting to change. Messages are built in one place so they
stay uniform.
"""

from typing import List

__all__: List[str] = []


class PipeckptConfigError(ValueError):
    """A setting of the pipeline breaks a rule; raised before any training step."""


class PipeckptCheckpointError(PipeckptConfigError):
    """A checkpoint cannot be used as given (damaged, incomplete, another model's, or holding
    something that loading would run); raised before it is loaded into anything."""


class PipeckptWarning(UserWarning):
    """A setting was accepted but adjusted, or an environment was ignored."""


def config_error(what: str, rule: str, hint: str) -> PipeckptConfigError:
    """Builds the uniform message: ``<what>: <rule>. HINT: <hint>``."""
    return PipeckptConfigError(f"{what}: {rule}. HINT: {hint}")


def checkpoint_error(what: str, rule: str, hint: str) -> PipeckptCheckpointError:
    """:func:`config_error`'s message, for a checkpoint that cannot be used."""
    return PipeckptCheckpointError(f"{what}: {rule}. HINT: {hint}")


class PipeckptSaveError(OSError):
    """A checkpoint could not be written: the filesystem refused it (full, over quota, read-only,
    no permission). An ``OSError`` with the filesystem's ``errno``, whose text is pipeckpt's message."""

    def __str__(self) -> str:
        return str(self.strerror)


def save_error(code: int, what: str, rule: str, hint: str) -> PipeckptSaveError:
    """:func:`config_error`'s message, for a save the filesystem refused with ``code`` (an errno)."""
    return PipeckptSaveError(code, f"{what}: {rule}. HINT: {hint}")
