"""Kiln's errors as the compiler raises them. KilnError itself lives with the artifacts, so a
deployed module's loader has it without the compiler."""
from ..artifacts.errors import KilnError

__all__ = ["KilnError", "InternalError", "ShapeError"]


class ShapeError(KilnError):
    """Shapes that do not fit: a wrong --shape, incompatible operands (the message names the node)."""


class InternalError(KilnError):
    """A bug in Kiln, reported with what it was working on (never a user mistake)."""
