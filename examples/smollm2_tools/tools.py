"""The tool of the SmolLM2 tools example: exact multiplication."""


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b
