"""Kiln's error type: imported by every layer, so it imports nothing."""


class KilnError(Exception):
    """An error the user can act on: the message names the thing at fault."""


class InternalError(KilnError):
    """A bug in Kiln, reported with what it was working on (never a user mistake)."""
