"""``python -m enginelib.bench``: see :mod:`enginelib.bench.cli`."""
from enginelib.bench.cli import main

main()
