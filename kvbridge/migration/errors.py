"""The migration errors: every failure of a plan, a transfer or its checks is one of these."""

from __future__ import annotations

from kvbridge.errors import KVBridgeError


class MigrationError(KVBridgeError):
    """A migration that could not complete; no destination page was claimed."""


class ChecksumError(MigrationError):
    """A page chunk whose XXH3-64 checksum on arrival differs from the sender's."""


class TransferError(MigrationError):
    """The peer died, the link broke, or a timeout passed before the transfer finished."""
