"""Integer helpers shared by the scheduler and the executor."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (blocks needed for ``a`` tokens of size ``b``)."""
    return -(-a // b)
