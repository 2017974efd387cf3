// The ops of hetero.host.kernels' extension (module.cpp binds them): each an MLX primitive on the CPU, so it sits inside
// lazy and compiled graphs like any MLX op. Their parallel loops run on the OpenMP team MKL already runs (libiomp5,
// loaded globally by hetero.host.blas; the symbols are left for it to resolve), with `threads` threads.
#pragma once
#include <vector>
#include "mlx/mlx.h"

namespace hetero {
extern int threads;  // set by module.cpp's set_threads: the BLAS's thread count

// An evaluated float32 input as a row-contiguous buffer, read inside an op's task: its own data when it is one (a
// weight, or a row slice of a fused weight: MLX's `contiguous` would copy such a view of a larger buffer), else
// `copy` filled from its strides. No graph node around the op, which a decode step's count of ops pays for.
inline const float* row_contiguous(const mlx::core::array& a, std::vector<float>& copy) {
  if (a.flags().row_contiguous) return a.data<float>();
  copy.resize(a.size());
  const float* base = a.data<float>();
  const int nd = a.ndim();
  const int64_t last = a.shape(-1), step = a.strides()[nd - 1];
  std::vector<int64_t> index(nd - 1, 0);  // the position in the leading dimensions
  for (size_t row = 0; row * last < a.size(); row++) {
    int64_t at = 0;
    for (int d = 0; d + 1 < nd; d++) at += index[d] * a.strides()[d];
    float* to = copy.data() + row * last;
    for (int64_t j = 0; j < last; j++) to[j] = base[at + j * step];
    for (int d = nd - 2; d >= 0 && ++index[d] == a.shape(d); d--) index[d] = 0;
  }
  return copy.data();
}

// y [..., out] = x [..., in] @ w [out, in].T, float32, 1-8 rows in x's leading dimensions (few_rows.cpp).
mlx::core::array few_rows(const mlx::core::array& x, const mlx::core::array& w, mlx::core::StreamOrDevice s);

// One token of the gated delta rule per (row, value head) (delta_step.cpp): (out [..., Dv], state [..., Dk, Dv]).
std::vector<mlx::core::array> delta_step(const mlx::core::array& q, const mlx::core::array& k,
                                         const mlx::core::array& v, const mlx::core::array& g,
                                         const mlx::core::array& beta, const mlx::core::array& state,
                                         mlx::core::StreamOrDevice s);
}  // namespace hetero
