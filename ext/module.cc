// nanobind module jzo.native: argument checks at the boundary, then the kernels.
// Arrays come in as numpy views; bf16/fp16 payloads arrive as uint16 views
// with a dtype code, since numpy has no native bf16 to exchange.
// Every array is .noconvert(): a converted temporary would silently drop the
// in-place update.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ffi_adam.h"
#include "host_ops.h"
#include "quant8.h"
#include "thread_pool.h"

namespace nb = nanobind;

namespace {

using ReadArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using WriteArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
using F32Array = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

jzo::DType to_dtype(int code, const char* name) {
#define JZO_KNOWN_CODE(enum_name, value, text) \
  if (code == value) return jzo::DType::enum_name;
  JZO_DTYPES(JZO_KNOWN_CODE)
#undef JZO_KNOWN_CODE
  throw std::invalid_argument(std::string(name) + ": unknown dtype code " + std::to_string(code));
}

// Checks that the array's storage matches the dtype code: float32 for f32,
// uint16 views for bf16/f16, uint8 codes for q8.
template <typename Array>
void check_storage(const Array& a, jzo::DType d, const char* name) {
  const bool ok = d == jzo::DType::kF32  ? a.dtype() == nb::dtype<float>()
                  : d == jzo::DType::kQ8 ? a.dtype() == nb::dtype<uint8_t>()
                                         : a.dtype() == nb::dtype<uint16_t>();
  if (!ok)
    throw nb::type_error((std::string(name) + ": storage does not match its dtype").c_str());
}

struct Span {
  const char* name;
  uintptr_t lo, hi;
};

bool same(const Span& a, const Span& b) { return a.lo == b.lo && a.hi == b.hi; }

// `in_place` (by index) may be exactly the same memory as `spans[0]`; any
// other overlap would let one array's writes feed another's reads mid-pass.
void check_disjoint(const std::vector<Span>& spans, size_t in_place = SIZE_MAX) {
  for (size_t i = 0; i < spans.size(); ++i)
    for (size_t j = i + 1; j < spans.size(); ++j)
      if (!(i == 0 && j == in_place && same(spans[i], spans[j])) &&
          spans[i].lo < spans[j].hi && spans[j].lo < spans[i].hi)
        throw std::invalid_argument(std::string(spans[i].name) + " and " + spans[j].name +
                                    " overlap in memory");
}

template <typename Array>
Span span_of(const char* name, const Array& a) {
  const auto lo = reinterpret_cast<uintptr_t>(a.data());
  return {name, lo, lo + a.nbytes()};
}

void adam_step(F32Array param, ReadArray grad, int grad_dtype, WriteArray mu, int mu_dtype,
               WriteArray nu, int nu_dtype, std::optional<F32Array> mu_scale,
               std::optional<F32Array> nu_scale, int64_t row, std::optional<WriteArray> lowp_out,
               int lowp_dtype,
               nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> scalars,
               bool nesterov, int num_threads) {
  jzo::AdamBuffers b;
  b.n = static_cast<int64_t>(param.size());
  b.grad_dtype = to_dtype(grad_dtype, "grad");
  b.mu_dtype = to_dtype(mu_dtype, "mu");
  b.nu_dtype = to_dtype(nu_dtype, "nu");
  if (b.mu_dtype == jzo::DType::kF16 || b.nu_dtype == jzo::DType::kF16)
    throw nb::type_error("mu and nu must be float32, bfloat16 or int8");
  if (b.grad_dtype == jzo::DType::kQ8) throw nb::type_error("grad cannot be int8");
  const bool q8 = b.mu_dtype == jzo::DType::kQ8;
  if (q8 != (b.nu_dtype == jzo::DType::kQ8))
    throw nb::type_error("int8 moments come in pairs: mu and nu both int8 or neither");
  if (mu_scale.has_value() != q8 || nu_scale.has_value() != q8)
    throw std::invalid_argument(q8 ? "int8 moments need mu_scale and nu_scale"
                                   : "mu_scale and nu_scale go with int8 moments only");
  check_storage(grad, b.grad_dtype, "grad");
  check_storage(mu, b.mu_dtype, "mu");
  check_storage(nu, b.nu_dtype, "nu");
  auto same_size = [&](size_t n, const char* name) {
    if (static_cast<int64_t>(n) != b.n)
      throw std::invalid_argument(std::string(name) + " has " + std::to_string(n) +
                                  " elements, param has " + std::to_string(b.n));
  };
  same_size(grad.size(), "grad");
  same_size(mu.size(), "mu");
  same_size(nu.size(), "nu");
  if (scalars.size() != jzo::kNumAdamScalars)
    throw std::invalid_argument("scalars must hold " + std::to_string(jzo::kNumAdamScalars) +
                                " values");
  // grad first: the low-precision copy may be written over it (each element
  // is read before its new weight is stored), which saves a staging buffer.
  std::vector<Span> spans = {span_of("grad", grad), span_of("param", param), span_of("mu", mu),
                             span_of("nu", nu)};
  if (q8) {
    if (row < 1 || b.n % row != 0)
      throw std::invalid_argument("row must divide the " + std::to_string(b.n) +
                                  " elements, got " + std::to_string(row));
    b.row = row;
    const int64_t blocks = b.n / row * jzo::quant_blocks(row);
    for (const auto& [scale, name] : {std::pair{&*mu_scale, "mu_scale"}, std::pair{&*nu_scale, "nu_scale"}}) {
      if (static_cast<int64_t>(scale->size()) != blocks)
        throw std::invalid_argument(std::string(name) + " has " + std::to_string(scale->size()) +
                                    " scales, " + std::to_string(b.n) + " elements need " +
                                    std::to_string(blocks));
      spans.push_back(span_of(name, *scale));
    }
    b.mu_scale = mu_scale->data();
    b.nu_scale = nu_scale->data();
  }
  size_t lowp_index = SIZE_MAX;  // the one array that may be grad's memory
  if (lowp_out) {
    b.lowp_dtype = to_dtype(lowp_dtype, "lowp_out");
    if (b.lowp_dtype == jzo::DType::kF32 || b.lowp_dtype == jzo::DType::kQ8)
      throw nb::type_error("lowp_out must be bfloat16 or float16");
    check_storage(*lowp_out, b.lowp_dtype, "lowp_out");
    same_size(lowp_out->size(), "lowp_out");
    lowp_index = spans.size();
    spans.push_back(span_of("lowp_out", *lowp_out));
    b.lowp_out = lowp_out->data();
  }
  check_disjoint(spans, /*in_place=*/lowp_index);
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0");

  b.grad = grad.data();
  b.mu = mu.data();
  b.nu = nu.data();
  b.param = param.data();
  b.update_param = true;
  const jzo::AdamScalars s = jzo::adam_scalars_from(scalars.data(), nesterov);
  nb::gil_scoped_release release;
  jzo::adam_parallel(b, s, num_threads);
}

// acc (optional: absent for a cast) = (add ? acc : 0) + grad, and a
// bf16/fp16 copy of the result into lowp_out (optional); returns the sum of
// the results' squares and whether all are finite.
std::pair<double, bool> accumulate(std::optional<F32Array> acc, ReadArray grad, int grad_dtype,
                                   bool add, std::optional<WriteArray> lowp_out,
                                   int lowp_dtype, int num_threads) {
  jzo::AccumBuffers b;
  b.n = static_cast<int64_t>(grad.size());
  b.grad_dtype = to_dtype(grad_dtype, "grad");
  if (b.grad_dtype == jzo::DType::kQ8) throw nb::type_error("grad cannot be int8");
  check_storage(grad, b.grad_dtype, "grad");
  if (add && !acc) throw std::invalid_argument("add needs acc");
  if (!acc && !lowp_out) throw std::invalid_argument("nothing to write: give acc or lowp_out");
  std::vector<Span> spans = {span_of("grad", grad)};
  auto same_size = [&](size_t n, const char* name) {
    if (static_cast<int64_t>(n) != b.n)
      throw std::invalid_argument(std::string(name) + " has " + std::to_string(n) +
                                  " elements, grad has " + std::to_string(b.n));
  };
  if (acc) {
    same_size(acc->size(), "acc");
    spans.push_back(span_of("acc", *acc));
    b.acc = acc->data();
  }
  if (lowp_out) {
    b.lowp_dtype = to_dtype(lowp_dtype, "lowp_out");
    if (b.lowp_dtype == jzo::DType::kF32 || b.lowp_dtype == jzo::DType::kQ8)
      throw nb::type_error("lowp_out must be bfloat16 or float16");
    check_storage(*lowp_out, b.lowp_dtype, "lowp_out");
    same_size(lowp_out->size(), "lowp_out");
    spans.push_back(span_of("lowp_out", *lowp_out));
    b.lowp_out = lowp_out->data();
  }
  check_disjoint(spans);
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0");
  b.grad = grad.data();
  b.add = add;
  jzo::AccumStats stats;
  {
    nb::gil_scoped_release release;
    stats = jzo::accumulate_parallel(b, num_threads);
  }
  return {stats.sumsq, stats.finite};
}

void parallel_copy(WriteArray dst, ReadArray src, int num_threads) {
  if (dst.nbytes() != src.nbytes())
    throw std::invalid_argument("dst has " + std::to_string(dst.nbytes()) + " bytes, src has " +
                                std::to_string(src.nbytes()));
  check_disjoint({span_of("dst", dst), span_of("src", src)});
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0");
  nb::gil_scoped_release release;
  jzo::parallel_copy(dst.data(), src.data(), dst.nbytes(), num_threads);
}

}  // namespace

NB_MODULE(native, m) {
  m.doc() = "jzo's C++ host kernels, their arguments checked and nothing more (jzo.kernels wraps them)";
  m.def("adam_step", &adam_step, nb::arg("param").noconvert(), nb::arg("grad").noconvert(),
        nb::arg("grad_dtype"), nb::arg("mu").noconvert(), nb::arg("mu_dtype"),
        nb::arg("nu").noconvert(), nb::arg("nu_dtype"), nb::arg("mu_scale").noconvert().none(),
        nb::arg("nu_scale").noconvert().none(), nb::arg("row"),
        nb::arg("lowp_out").noconvert().none(),
        nb::arg("lowp_dtype"), nb::arg("scalars").noconvert(), nb::arg("nesterov"),
        nb::arg("num_threads"),
        "Fused in-place Adam(W) step over host arrays; releases the GIL.");
  m.def("accumulate", &accumulate, nb::arg("acc").noconvert().none(), nb::arg("grad").noconvert(),
        nb::arg("grad_dtype"), nb::arg("add"), nb::arg("lowp_out").noconvert().none(),
        nb::arg("lowp_dtype"), nb::arg("num_threads"),
        "Sums a gradient into a float32 accumulator (or casts); returns (sum of squares, "
        "finite). Releases the GIL.");
  m.def("parallel_copy", &parallel_copy, nb::arg("dst").noconvert(), nb::arg("src").noconvert(),
        nb::arg("num_threads"), "memcpy split over threads; releases the GIL.");
  m.def("num_threads", &jzo::num_threads);
  m.def("set_num_threads", &jzo::set_num_threads, nb::arg("n"));
  m.def("available_cpus", &jzo::available_cpus);
  m.def("simd_level", &jzo::simd_level);
  m.def("set_simd_level", &jzo::set_simd_level, nb::arg("level"));
  m.def("int8_codes", &jzo::int8_codes);
  m.def("set_int8_codes", &jzo::set_int8_codes, nb::arg("way"));
  m.def("prefetch_above", &jzo::prefetch_above);
  m.def("set_prefetch_above", &jzo::set_prefetch_above, nb::arg("bytes"));
  m.def("adam_update_ffi", [] { return nb::capsule(reinterpret_cast<void*>(JzoAdamUpdateFfi)); });
  m.def("adam_moments_ffi", [] { return nb::capsule(reinterpret_cast<void*>(JzoAdamMomentsFfi)); });
  m.def("adam_step_ffi", [] { return nb::capsule(reinterpret_cast<void*>(JzoAdamStepFfi)); });
  m.def("quant8_map", [](bool is_signed) {
    const jzo::Quant8Map& map = is_signed ? jzo::quant8_signed() : jzo::quant8_unsigned();
    return std::pair{std::vector<float>(map.code, map.code + 256),
                     std::vector<float>(map.mid, map.mid + map.num_mid)};
  }, nb::arg("is_signed"),
        "The int8 moments' map, signed (mu) or unsigned (nu): (the 256 codes' values, the "
        "midpoints between consecutive magnitudes).");
  m.attr("QUANT_BLOCK") = jzo::kQuantBlock;
  m.attr("NUM_ADAM_SCALARS") = jzo::kNumAdamScalars;
  nb::list scalar_names;
#define JZO_SCALAR_NAME(name) scalar_names.append(#name);
  JZO_ADAM_SCALARS(JZO_SCALAR_NAME)
#undef JZO_SCALAR_NAME
  m.attr("ADAM_SCALARS") = nb::tuple(scalar_names);
  nb::dict dtype_codes;
#define JZO_DTYPE_CODE(enum_name, value, text) dtype_codes[text] = value;
  JZO_DTYPES(JZO_DTYPE_CODE)
#undef JZO_DTYPE_CODE
  m.attr("DTYPE_CODES") = dtype_codes;
}
