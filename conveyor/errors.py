"""Error roots shared by every service.

Retryable and terminal errors are distinct types, so middleware can decide
without parsing messages. Each start-up failure has its own exit code.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Root of every error Conveyor raises on purpose."""

    exit_code = 1


class RetryableError(ConveyorError):
    """Infrastructure was unavailable; the same operation may succeed later."""


class TerminalError(ConveyorError):
    """Retrying will not help (bad input, bad config, corrupt data)."""


class ConfigError(TerminalError):
    """A run config is invalid; the message names the field."""

    exit_code = 2


class TransportUnavailable(RetryableError):
    """The broker could not be reached within the configured deadline."""

    exit_code = 3


class ChecksumMismatch(TerminalError):
    """An object's bytes do not match the checksum recorded for them."""


class CheckpointRefused(TerminalError):
    """A checkpoint that must not be loaded: a pickle, or a pointer whose signature is missing or wrong."""
