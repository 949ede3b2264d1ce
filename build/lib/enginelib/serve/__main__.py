"""``python -m enginelib.serve``: start the OpenAI-compatible server."""
from enginelib.serve.app import main

main()
