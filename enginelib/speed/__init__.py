"""The speed code (Part IV): C++ CPU kernels, Triton GPU kernels, quantized weights, compiled decode and
speculative decoding. Only the model runner imports it, lazily, when a config asks for it."""
