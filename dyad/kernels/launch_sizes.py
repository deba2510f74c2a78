"""Integer helpers for sizing Triton launches, importable without Triton."""


def cdiv(n: int, block: int) -> int:
    """Blocks of `block` needed to cover n."""
    return -(-n // block)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (tl.arange needs power-of-two lengths)."""
    return 1 << (n - 1).bit_length()
