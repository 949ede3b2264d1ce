"""``python -m enginelib.serve``: start the OpenAI-compatible server."""
from enginelib.serve.cli import main

main()
