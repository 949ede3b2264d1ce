// A decode step's attention over the paged KV cache (attention.cpp) in its parts, for a caller that runs its own
// threads, as the one-call decode step (q8.cpp) does, as well as for decode_attention's own.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// The arguments checked (the constructor throws; the parts do not, so they may run inside a parallel region),
// then store(s0, s1): rows s0:s1's new keys and values written into the pools, then, once every row's are,
// attend(i0, i1, out): the (sequence, head) pairs i0:i1 (pair i: sequence i / H, head i % H) into out [S, H, D].
struct PagedDecode {
  PagedDecode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool, at::Tensor& v_pool,
              const at::Tensor& block_tables, const at::Tensor& context_lens);
  void store(int64_t s0, int64_t s1) const;
  void attend(int64_t i0, int64_t i1, float* out, bool simd) const;

  int64_t S, H, D, NB, BS, KV, W, keys = 0;
  const int64_t *bt, *lens;
  const float *qp, *kn, *vn;
  float *kp, *vp;  // the pools a layer's attention reads (and writes the new keys and values into)
};
