"""The example's tool, written as TRL's documentation writes tools: typed, with a docstring."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b
