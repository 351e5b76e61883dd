// A prompt slice's attention against its cache, as one MLX primitive on the CPU
// (runtime/native.py builds and loads it; runtime/attention.py `attend` calls it).
//
// slice_attention(queries, keys, values, length): queries (B, H, group * length, D), already
// scaled, the rows of a key head's group of query heads one after another (row r is the
// slice's position r % length); keys and values (B, H, cached + length, D) float32, the last
// `length` the slice's own. Every query attends every cached key and its slice's keys up to
// its own position. Each query row's softmax runs online over blocks of KB keys (a running
// maximum, the sums and weighted values rescaled when it grows), the rows 8 or 16 at a time in
// one vector of floats.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

constexpr int KB = 64;   // keys a block holds
constexpr float UNDERFLOW = -80.0f;

// Vectors of 8 and 16 floats (GCC's vector extensions: AVX-512, or pairs of AVX2 registers).
typedef float f8v __attribute__((vector_size(32)));
typedef int i8v __attribute__((vector_size(32)));
typedef float f16v __attribute__((vector_size(64)));
typedef int i16v __attribute__((vector_size(64)));

template <typename V>
inline V splat(float x) { return V{} + x; }

// exp(x) for x <= 0 as runtime/attention.py's fast softmax computes it: (P(y / 64))^64, P
// exp's Taylor polynomial of degree 7 in Estrin's form, y clamped to >= -80.
template <typename V>
inline V shifted_exp(V x) {
  V lo = splat<V>(UNDERFLOW);
  V z = (x > lo ? x : lo) * (1.0f / 64.0f);
  V z2 = z * z;
  V p = (1.0f + z) + z2 * (0.5f + (1.0f / 6) * z) +
      z2 * z2 * ((1.0f / 24 + (1.0f / 120) * z) + z2 * (1.0f / 720 + (1.0f / 5040) * z));
  p = p * p; p = p * p; p = p * p; p = p * p; p = p * p; p = p * p;
  return p;
}

struct Head {
  const float* q; int64_t q_row;   // rows x dim
  const float* k; int64_t k_row;   // keys x dim
  const float* v; int64_t v_row;
  float* out;                      // rows x dim, contiguous
};

// One (batch, head) plane of a 4-D float32 array as rows of contiguous floats: in place where
// its last axis is contiguous, else gathered into `copy`.
const float* plane(const mx::array& a, int b, int h, std::vector<float>& copy, int64_t& row) {
  const float* base = a.data<float>() + b * a.strides(0) + h * a.strides(1);
  if (a.strides(3) == 1 || a.shape(3) == 1) {
    row = a.strides(2);
    return base;
  }
  const int n = a.shape(2), dim = a.shape(3);
  copy.resize(static_cast<size_t>(n) * dim);
  for (int i = 0; i < n; ++i)
    for (int e = 0; e < dim; ++e) copy[static_cast<size_t>(i) * dim + e] =
        base[i * a.strides(2) + e * a.strides(3)];
  row = dim;
  return copy.data();
}

// One key head: `rows` queries (group-major: row r is at position r % length of the slice)
// against `keys` keys, the last `length` of them the slice's own under the causal mask.
template <typename V, typename I>
void attend_head(const Head& h, int rows, int keys, int dim, int length) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int cached = keys - length;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<V> qc(dim), acc(dim);
  alignas(64) V s[KB];
  for (int c = 0; c < rows; c += W) {
    alignas(64) float lane[W];
    for (int e = 0; e < dim; ++e) {
      for (int w = 0; w < W; ++w) lane[w] = c + w < rows ? h.q[(c + w) * h.q_row + e] : 0.0f;
      std::memcpy(&qc[e], lane, sizeof(lane));
    }
    I position;
    for (int w = 0; w < W; ++w) position[w] = (c + w) % length;
    V most = splat<V>(-1e30f), total = splat<V>(0.0f);
    for (int e = 0; e < dim; ++e) acc[e] = splat<V>(0.0f);
    for (int kb = 0; kb < keys; kb += KB) {
      const int nb_keys = std::min(KB, keys - kb);
      V block = most;
      int j = 0;
      for (; j + 4 <= nb_keys; j += 4) {  // four keys at once: four independent sums
        const float* k0 = h.k + (kb + j) * h.k_row;
        const float* k1 = k0 + h.k_row;
        const float* k2 = k1 + h.k_row;
        const float* k3 = k2 + h.k_row;
        V d0 = splat<V>(0.0f), d1 = d0, d2 = d0, d3 = d0;
        for (int e = 0; e < dim; ++e) {
          d0 += k0[e] * qc[e];
          d1 += k1[e] * qc[e];
          d2 += k2[e] * qc[e];
          d3 += k3[e] * qc[e];
        }
        s[j] = d0; s[j + 1] = d1; s[j + 2] = d2; s[j + 3] = d3;
      }
      for (; j < nb_keys; ++j) {
        const float* kj = h.k + (kb + j) * h.k_row;
        V dot = splat<V>(0.0f);
        for (int e = 0; e < dim; ++e) dot += kj[e] * qc[e];
        s[j] = dot;
      }
      for (j = std::max(0, cached - kb); j < nb_keys; ++j) {  // the slice's own keys
        const int own = kb + j - cached;
        s[j] = (I{} + own) > position ? splat<V>(-inf) : s[j];
      }
      for (j = 0; j < nb_keys; ++j) block = block > s[j] ? block : s[j];
      const V scale = shifted_exp(most - block);
      most = block;
      total *= scale;
      for (int e = 0; e < dim; ++e) acc[e] *= scale;
      for (j = 0; j < nb_keys; ++j) {
        s[j] = shifted_exp(s[j] - most);
        total += s[j];
      }
      for (j = 0; j + 4 <= nb_keys; j += 4) {
        const float* v0 = h.v + (kb + j) * h.v_row;
        const float* v1 = v0 + h.v_row;
        const float* v2 = v1 + h.v_row;
        const float* v3 = v2 + h.v_row;
        for (int e = 0; e < dim; ++e)
          acc[e] += (s[j] * v0[e] + s[j + 1] * v1[e]) + (s[j + 2] * v2[e] + s[j + 3] * v3[e]);
      }
      for (; j < nb_keys; ++j) {
        const float* vj = h.v + (kb + j) * h.v_row;
        for (int e = 0; e < dim; ++e) acc[e] += s[j] * vj[e];
      }
    }
    for (int w = 0; w < W && c + w < rows; ++w)
      for (int e = 0; e < dim; ++e) h.out[(c + w) * dim + e] = acc[e][w] / total[w];
  }
}

class SliceAttention : public mx::UnaryPrimitive {
 public:
  SliceAttention(mx::Stream stream, int length) : mx::UnaryPrimitive(stream), length_(length) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(q);
    encoder.set_input_array(k);
    encoder.set_input_array(v);
    encoder.set_output_array(out);
    encoder.dispatch([q = mx::array::unsafe_weak_copy(q), k = mx::array::unsafe_weak_copy(k),
                      v = mx::array::unsafe_weak_copy(v),
                      out = mx::array::unsafe_weak_copy(out), length = length_]() mutable {
      const int batch = q.shape(0), heads = q.shape(1), rows = q.shape(2), dim = q.shape(3);
      const int keys = k.shape(2);
      std::vector<float> qc, kc, vc;
      for (int b = 0; b < batch; ++b)
        for (int hh = 0; hh < heads; ++hh) {
          Head h;
          h.q = plane(q, b, hh, qc, h.q_row);
          h.k = plane(k, b, hh, kc, h.k_row);
          h.v = plane(v, b, hh, vc, h.v_row);
          h.out = out.data<float>() + (static_cast<int64_t>(b) * heads + hh) * rows * dim;
          if (rows <= 8) attend_head<f8v, i8v>(h, rows, keys, dim, length);
          else attend_head<f16v, i16v>(h, rows, keys, dim, length);
        }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("slice_attention runs on the CPU only");
  }
  const char* name() const override { return "SliceAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return length_ == static_cast<const SliceAttention&>(other).length_;
  }

 private:
  int length_;
};

mx::array slice_attention(const mx::array& queries, const mx::array& keys,
                          const mx::array& values, int length) {
  auto s = mx::to_stream({});
  if (queries.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4)
    throw std::invalid_argument("slice_attention: queries, keys and values must be 4-D");
  if (queries.dtype() != mx::float32 || keys.dtype() != mx::float32 ||
      values.dtype() != mx::float32)
    throw std::invalid_argument("slice_attention: float32 only");
  if (keys.shape() != values.shape() || queries.shape(0) != keys.shape(0) ||
      queries.shape(1) != keys.shape(1) || queries.shape(3) != keys.shape(3))
    throw std::invalid_argument(
        "slice_attention: keys and values (B, H, keys, D) must match queries (B, H, rows, D)");
  if (length < 1 || length > keys.shape(2) || queries.shape(2) % length != 0)
    throw std::invalid_argument(
        "slice_attention: length must be 1 to the keys' count and divide the query rows");
  return mx::array(queries.shape(), mx::float32, std::make_shared<SliceAttention>(s, length),
                   {queries, keys, values});
}

}  // namespace

NB_MODULE(_fairtick_native, m) {
  m.def("slice_attention", &slice_attention, "queries"_a, "keys"_a, "values"_a, "length"_a);
}
