"""Kiln's error type: imported by every layer (a deployed bundle's loader too), so it
imports nothing."""


class KilnError(Exception):
    """An error the user can act on: the message names the thing at fault."""
