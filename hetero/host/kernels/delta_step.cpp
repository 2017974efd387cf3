// One token of the gated delta rule, for every (row, value head) n at once, in float32 on the CPU:
//     S = exp(g) * S;  u = beta * (v - S^T k);  S = S + k u^T;  o = S^T q       (S [Dk, Dv] per n)
// MLX runs this as five ops over the whole state [N, Dk, Dv], each a pass over memory on one thread (the
// elementwise ones) or N tiny matmuls (the two products): about 0.8 ms a GDN layer of the large bench model at 4
// rows (`python bench/cpu_kernels.py --part ops`). Here each n's state is read once and written once, in two sweeps
// while it sits in the L1 cache (16 KB for Dk = Dv = 64), and the n are split over the threads. Every n runs the
// same loops in the same order whatever N is, so a request's state in a batch is bit for bit its state alone, and a
// verify pass (one step per token) leaves the same states as the decode steps it replaces.
#include <cmath>
#include <cstdint>
#include "kernels.h"
#include "mlx/primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mx = mlx::core;

namespace hetero {

static void step_one(const float* q, const float* k, const float* v, float g, float beta, const float* s,
                     float* o, float* t, int64_t dk, int64_t dv) {
  float remembered[512], u[512];  // dv <= 512 (checked by delta_step)
  const float decay = std::exp(g);
  for (int64_t j = 0; j < dv; j++) remembered[j] = 0.0f;
  for (int64_t i = 0; i < dk; i++) {  // S = decay * S; remembered = S^T k
    const float* si = s + i * dv;
    float* ti = t + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; j++) {
      ti[j] = si[j] * decay;
      remembered[j] += ki * ti[j];
    }
  }
  for (int64_t j = 0; j < dv; j++) {
    u[j] = beta * (v[j] - remembered[j]);
    o[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; i++) {  // S = S + k u^T; o = S^T q
    float* ti = t + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; j++) {
      ti[j] += ki * u[j];
      o[j] += qi * ti[j];
    }
  }
}

static void delta_step_cpu(const float* q, const float* k, const float* v, const float* g, const float* beta,
                           const float* s, float* o, float* t, int64_t n, int64_t dk, int64_t dv) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; i++)
    step_one(q + i * dk, k + i * dk, v + i * dv, g[i], beta[i], s + i * dk * dv, o + i * dv, t + i * dk * dv, dk,
             dv);
}

class DeltaStep : public mx::Primitive {
 public:
  explicit DeltaStep(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    const auto& state = inputs[5];
    auto& out = outputs[0];
    auto& next = outputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    // the new state overwrites the old one in place when nothing else holds it (a decode step's state, as MLX's
    // own elementwise ops donate their inputs): no fresh buffer of the whole state each step
    const bool in_place = state.flags().row_contiguous && state.is_donatable();
    if (in_place)
      next.copy_shared_buffer(state);
    else
      next.set_data(mx::allocator::malloc(next.nbytes()));
    enc.set_output_array(out);
    enc.set_output_array(next);
    const int64_t dk = state.shape(-2), dv = state.shape(-1), n = state.size() / (dk * dv);
    enc.dispatch([inputs, in_place, o = out.data<float>(), t = next.data<float>(), n, dk, dv]() {
      std::vector<float> copies[6];
      const float* p[6];
      for (int i = 0; i < 6; i++) p[i] = i == 5 && in_place ? t : row_contiguous(inputs[i], copies[i]);
      delta_step_cpu(p[0], p[1], p[2], p[3], p[4], p[5], o, t, n, dk, dv);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("delta_step runs on the CPU only");
  }
  const char* name() const override { return "DeltaStep"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[2].shape(), inputs[5].shape()};
  }
};

std::vector<mx::array> delta_step(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                  const mx::array& beta, const mx::array& state, mx::StreamOrDevice s) {
  // lead: the (row, head) dimensions every input shares; one op, no reshapes or copies in the graph around it
  if (state.ndim() < 3 || q.ndim() != state.ndim() - 1 || k.shape() != q.shape() || v.ndim() != q.ndim() ||
      g.ndim() != q.ndim() - 1 || beta.shape() != g.shape())
    throw std::invalid_argument("delta_step: q, k [..., Dk], v [..., Dv], g, beta [...], state [..., Dk, Dv] expected");
  const int nd = g.ndim();
  for (int d = 0; d < nd; d++)
    if (q.shape(d) != state.shape(d) || v.shape(d) != state.shape(d) || g.shape(d) != state.shape(d))
      throw std::invalid_argument("delta_step: q, k, v, g and beta must match the state [..., Dk, Dv]");
  if (q.shape(-1) != state.shape(-2) || v.shape(-1) != state.shape(-1))
    throw std::invalid_argument("delta_step: q, k, v, g and beta must match the state [..., Dk, Dv]");
  if (state.shape(-1) > 512) throw std::invalid_argument("delta_step: Dv up to 512");
  for (auto* a : {&q, &k, &v, &g, &beta, &state})
    if (a->dtype() != mx::float32) throw std::invalid_argument("delta_step: float32 only");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array::make_arrays({v.shape(), state.shape()}, {mx::float32, mx::float32},
                                std::make_shared<DeltaStep>(stream), {q, k, v, g, beta, state});
}

}  // namespace hetero
