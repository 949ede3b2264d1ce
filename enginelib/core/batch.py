"""The Batch lives in :mod:`enginelib.step.batch`, below both the core and the speed code (which both build on it);
its names stay importable from here, where chapter 5 and the tests take them."""
from enginelib.step.batch import Batch, SequenceWork, to_device

__all__ = ["Batch", "SequenceWork", "to_device"]
