"""Chapter 9: a prefix's identity, one chained hash per full block."""


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """One hash per *full* block: hash(parent's hash, this block's tokens); the first block's parent is 0."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        hashes.append(parent)
    return hashes
