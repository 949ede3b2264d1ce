"""The speed code (Part IV): C++ CPU kernels, Triton GPU kernels, quantized weights, compiled decode and
speculative decoding. The core never imports it: the model runner calls its one factory (factory.py), which
the package's ``__init__`` hands it, when a config asks; a plain engine loads none of it."""
