"""Type stub of the C extension ``kvcache/_blockhash.c`` (built with the compiled core)."""

from collections.abc import Sequence

def sha256_chain(
    parent: object, tokens: Sequence[int], start: int, stop: int, block_size: int, /
) -> list[bytes] | None:
    """The chained keyless sha256 hashes of the blocks of ``tokens[start:stop]``, each
    ``sha256(pickle.dumps((parent, tuple(block), None), protocol=5)).digest()``; None
    where an input is not one encoded exactly (the caller then uses pickle)."""
