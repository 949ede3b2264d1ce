"""The engine you build: every file here is written by a `%%writefile` cell of the book, and its first line names
the chapter. Only the model and the tokenizer come from enginelib; the rest is yours."""
import sys


def forget() -> None:
    """Forget the files imported so far, so that the next import reads them as they are now (after an edit)."""
    for name in [name for name in sys.modules if name.startswith(__name__ + ".")]:
        del sys.modules[name]
