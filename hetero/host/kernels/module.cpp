// The Python module of hetero.host.kernels' extension: its ops (kernels.h) and the thread count they run on.
#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>
#include "kernels.h"

namespace nb = nanobind;

int hetero::threads = 1;

NB_MODULE(_kernels, m) {
  m.def("set_threads", [](int n) { hetero::threads = n < 1 ? 1 : n; }, nb::arg("n"), "Threads for every later op.");
  m.def("few_rows", &hetero::few_rows, nb::arg("x"), nb::arg("w"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "x [..., in] @ w [out, in].T -> [..., out], float32, 1-8 rows (x's leading positions), on the CPU.");
  m.def("delta_step", &hetero::delta_step, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("state"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "One gated delta rule token: q, k [..., Dk], v [..., Dv], g (log decay), beta [...], state [..., Dk, Dv] -> "
        "(out [..., Dv], state), float32, on the CPU.");
}
