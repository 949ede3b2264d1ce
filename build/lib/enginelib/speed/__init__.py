"""The speed code (Part III): C++ CPU kernels, quantized weights, compiled decode and speculative
decoding. Only the model runner imports it, lazily, when a config asks for it."""
