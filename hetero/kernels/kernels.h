// The ops of hetero.kernels' extension (module.cpp binds them): each an MLX primitive on the CPU, so it sits inside
// lazy and compiled graphs like any MLX op. Their parallel loops run on the OpenMP team MKL already runs (libiomp5,
// loaded globally by hetero.blas; the symbols are left for it to resolve), with `threads` threads.
#pragma once
#include "mlx/mlx.h"

namespace hetero {
extern int threads;  // set by module.cpp's set_threads: the BLAS's thread count

// y [rows, out] = x [rows, in] @ w [out, in].T, float32, 1-8 rows (few_rows.cpp).
mlx::core::array few_rows(const mlx::core::array& x, const mlx::core::array& w, mlx::core::StreamOrDevice s);

// One token of the gated delta rule per (row, value head) (delta_step.cpp): (out [..., Dv], state [..., Dk, Dv]).
std::vector<mlx::core::array> delta_step(const mlx::core::array& q, const mlx::core::array& k,
                                         const mlx::core::array& v, const mlx::core::array& g,
                                         const mlx::core::array& beta, const mlx::core::array& state,
                                         mlx::core::StreamOrDevice s);
}  // namespace hetero
