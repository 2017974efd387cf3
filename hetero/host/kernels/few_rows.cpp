// The few-row product of hetero.host.kernels: y [..., out] = x [..., in] @ w [out, in].T for 1-8 rows in float32 on
// the CPU, as an MLX primitive (so it sits inside lazy and compiled graphs like any op). A decode step's products
// are bound by reading the weights; MKL's sgemm under MLX reads them about twice for 4 rows (hetero/models/linear.py),
// this kernel once for all rows: AVX2 + FMA, register-blocked over 8 / 4 / 3 output channels for 1 / 2-3 / 4-8
// rows (rows in groups of at most 4; each (channel, row) one chain whatever the block), the
// output channels split in blocks over the threads of the OpenMP runtime MKL already runs (libiomp5, loaded
// globally by hetero.host.blas: the symbols are left for it to resolve, so both share one team of threads).
#include <immintrin.h>
#include <cstdint>
#include "kernels.h"
#include "mlx/primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mx = mlx::core;

namespace hetero {

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// C output channels x R rows from channel o: every (channel, row) sums the same 8-lane FMA chain in the same
// order whatever C and R are, so a row's result does not depend on the rows beside it.
template <int C, int R>
static void block(const float* w, const float* x, float* y, int64_t out, int64_t in, int64_t o) {
  __m256 acc[C][R];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    __m256 wc[C];
    for (int c = 0; c < C; c++) wc[c] = _mm256_loadu_ps(w + (o + c) * in + k);
    for (int r = 0; r < R; r++) {
      __m256 xr = _mm256_loadu_ps(x + r * in + k);
      for (int c = 0; c < C; c++) acc[c][r] = _mm256_fmadd_ps(wc[c], xr, acc[c][r]);
    }
  }
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) {
      float s = hsum(acc[c][r]);
      for (int64_t j = k; j < in; j++) s += w[(o + c) * in + j] * x[r * in + j];
      y[r * out + o + c] = s;
    }
}

// Rows in groups of at most 4 over each block of C channels: the block's weights are read from memory once, by the
// first group, and from the L1 cache by the next.
template <int C, int R>
static void rows_of(const float* w, const float* x, float* y, int64_t out, int64_t in, int64_t o) {
  if constexpr (R <= 4) {
    block<C, R>(w, x, y, out, in, o);
  } else {
    block<C, 4>(w, x, y, out, in, o);
    block<C, R - 4>(w, x + 4 * in, y + 4 * out, out, in, o);
  }
}

template <int R>
static void channels(const float* w, const float* x, float* y, int64_t out, int64_t in, int64_t o0, int64_t o1) {
  // channels per block: enough weight rows streaming at once to keep memory busy (2 were too few: 4 rows cost
  // about 1.6x one), and about 8-12 independent FMA chains (the FMA's latency hidden) within AVX2's 16 registers
  constexpr int C = R == 1 ? 8 : R <= 3 ? 4 : 3;
  int64_t o = o0;
  for (; o + C <= o1; o += C) rows_of<C, R>(w, x, y, out, in, o);
  for (; o < o1; o++) rows_of<1, R>(w, x, y, out, in, o);
}

using kernel_t = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
static const kernel_t KERNELS[9] = {nullptr, channels<1>, channels<2>, channels<3>, channels<4>,
                                    channels<5>, channels<6>, channels<7>, channels<8>};
constexpr int64_t SHARE = 48;  // output channels per parallel task (a multiple of every block's C)

static void few_rows_cpu(const float* w, const float* x, float* y, int64_t rows, int64_t out, int64_t in) {
  kernel_t kern = KERNELS[rows];
  int64_t tasks = (out + SHARE - 1) / SHARE;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; t++) {
    int64_t o0 = t * SHARE, o1 = o0 + SHARE < out ? o0 + SHARE : out;
    kern(w, x, y, out, in, o0, o1);
  }
}

class FewRows : public mx::Primitive {
 public:
  explicit FewRows(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& y = outputs[0];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(y);
    const auto& w = inputs[1];
    enc.dispatch([inputs, yp = y.data<float>(), out = w.shape(0), in = w.shape(1)]() {
      std::vector<float> copies[2];
      const float* xp = row_contiguous(inputs[0], copies[0]);
      const float* wp = row_contiguous(inputs[1], copies[1]);
      few_rows_cpu(wp, xp, yp, inputs[0].size() / in, out, in);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("few_rows runs on the CPU only");
  }
  const char* name() const override { return "FewRows"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

mx::array few_rows(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  // x [..., in]: the rows are every position of its leading dimensions (no reshape in the graph around the op)
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("few_rows: x [..., in] and w [out, in] expected");
  const auto rows = x.shape(-1) ? x.size() / x.shape(-1) : 0;
  if (rows < 1 || rows > 8) throw std::invalid_argument("few_rows: 1 to 8 rows");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) throw std::invalid_argument("few_rows: float32 only");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<FewRows>(mx::to_stream(s, mx::Device::cpu)), {x, w});
}

}  // namespace hetero
