"""A stand-in that makes Triton unavailable: gpu_check.sh puts this folder first on PYTHONPATH when
GPU_CHECK_DISABLE_TRITON=1, so that every ``import triton`` fails as on a machine without it (enginelib's Triton
kernels and torch.compile's GPU code generator both), and a maintainer sees the check fail on the fallbacks."""
raise ImportError("Triton is hidden by GPU_CHECK_DISABLE_TRITON=1 (.ci/no_triton/triton/__init__.py)")
