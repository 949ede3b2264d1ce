"""llama.cpp in a child process: a segfault in native code is reported by name and ends the child, not us.

No llama.cpp here: a stand-in ``llama_cpp`` module (tests/fixtures/fake_llama_cpp) answers every call
:class:`LlamaCpp` makes and reads address 0 in the one named by ``FAKE_LLAMA_CPP_CRASH_IN``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from enginelib.bench import llama_cpp as llama
from enginelib.bench.child import Child, ChildCrashed

FAKE = Path(__file__).parent / "fixtures" / "fake_llama_cpp"


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """The stand-in on sys.path (children inherit it through PYTHONPATH), import_error asked afresh."""
    monkeypatch.syspath_prepend(str(FAKE))
    llama.import_error.cache_clear()
    yield
    llama.import_error.cache_clear()


def test_a_segfault_in_llama_decode_is_reported_with_the_call_and_the_parent_lives(fake_llama_cpp):
    assert llama.import_error() is None  # the import is tried in a child too: the stand-in imports there
    with llama.LlamaCppProcess(Path("model.gguf"), threads=2, max_num_seqs=4, n_ctx=4096, n_batch=512) as peer:
        assert (peer.version, peer.max_num_seqs, peer.threads, peer.device) == ("0.0-fake", 4, 2, "cpu")
        with pytest.raises(ChildCrashed) as crash:
            peer.step_times([[1, 2, 3]], 4)
        assert str(crash.value) == "llama.cpp crashed: signal 11 (SIGSEGV) in llama_decode"
        assert crash.value.signal == 11 and crash.value.call == "llama_decode" and peer.crashed is crash.value
        summary = crash.value.summary()
        assert summary["crashed"] == str(crash.value) and summary["returncode"] == -11
        assert "string_at" in summary["python_frame"]  # faulthandler's innermost frame: the stand-in's bad read
        assert "Segmentation fault" in summary["log_tail"] and "in decode" in summary["log_tail"]
        with pytest.raises(ChildCrashed, match="in llama_decode"):  # a dead peer stays dead, and says why
            peer.serve_requests([([1, 2], 4, 0.0, 0)], None, 1)


def test_a_crash_while_loading_names_the_load(fake_llama_cpp, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CPP_CRASH_IN", "llama_model_load_from_file")
    with pytest.raises(ChildCrashed, match=r"^llama.cpp crashed: signal 11 \(SIGSEGV\) in llama_model_load_from_file$"):
        llama.LlamaCppProcess(Path("model.gguf"), threads=1)


def test_a_python_error_in_the_child_is_raised_here_and_the_child_goes_on(fake_llama_cpp, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CPP_CRASH_IN", "nowhere")  # llama_decode raises instead of crashing
    with llama.LlamaCppProcess(Path("model.gguf"), threads=1, max_num_seqs=2) as peer:
        with pytest.raises(RuntimeError, match="the stand-in computes no logits"):
            peer.step_times([[1, 2, 3]], 2)
        with pytest.raises(ValueError, match="batch 3 > the 2 sequences"):
            peer.step_times([[1]] * 3, 2)
        assert peer.crashed is None and peer.child.call("describe")["max_num_seqs"] == 2


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed here")
def test_without_llama_cpp_the_child_says_how_to_install_it():
    with pytest.raises(ValueError, match=r"pip install llama-cpp-python==0\.3\.36"):
        Child("enginelib.bench.llama_cpp_native:LlamaCpp", "model.gguf", 1, label="llama.cpp").close()


def test_a_child_that_exits_without_a_signal_says_its_exit_code(tmp_path, monkeypatch):
    (tmp_path / "quits.py").write_text("import os\n\nclass Quits:\n    def now(self):\n        os._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with Child("quits:Quits", label="stand-in") as child:
        with pytest.raises(ChildCrashed, match=r"^stand-in crashed: exited with code 3 outside any marked native call"):
            child.call("now")
