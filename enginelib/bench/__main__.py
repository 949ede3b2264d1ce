"""``python -m enginelib.bench``: see :mod:`enginelib.bench.cli`."""
from .cli import main

main()
