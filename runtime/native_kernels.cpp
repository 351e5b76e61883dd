// fairtick's native CPU kernels, each one MLX primitive (runtime/native.py builds and loads
// them): a prompt slice's attention against its cache and the decode rows' (runtime/attention.py
// `attend` calls them), the MLP's activation and the rope's rotation (runtime/fused.py), and
// RMSNorm (runtime/kernels.py).
//
// slice_attention(queries, keys, values, length, scale): queries (B, H, group * length, D),
// each multiplied by `scale` as it is read (one product, rounded as MLX's own scaling of the
// queries rounds it, so no op of MLX's scales them first), the rows of a key head's group of
// query heads one after another (row r is the slice's position r % length); keys and values
// (B, H, cached + length, D) float32, the last `length` the slice's own. Every query attends
// every cached key and its slice's keys up to its own position. Each query row's softmax runs
// online over blocks of KB keys (a running maximum, the sums and weighted values rescaled when
// it grows), the rows 8 or 16 at a time in one vector of floats.
//
// rows_attention(queries, keys, values, starts, scale): decode rows, one query token each,
// scaled as the slice's are: queries (B, H, group, D), row b attending its keys from starts[b]
// on (a batch cache's left padding).
//
// swiglu(gate, up): the MLP's gate, silu(gate) * up as mlx-lm computes it, (gate * sigmoid(gate))
// * up, with the exponential 16 floats at a time (MLX's CPU build takes each one alone).
//
// rotate_halves(x, cos, sin): a rope's rotation of x (B, H, L, D) by its angles' cosines and sines
// (B or 1, 1, L, D / 2), the pairs (x[i], x[i + D/2]), each product and sum rounded on its own
// as MLX's fallback rounds them: one op where the fallback's rotation is six.
//
// rms_norm(x, weight, eps): an RMSNorm of float32 rows, the floats MLX's fallback computes in its
// order (`rms_norm_row`), one op where the compiled fallback is four.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
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

// Calls attend(head, b) for every (batch b, key head) plane of q, k and v, with its place in
// `out` (contiguous, q's shape).
template <typename F>
void for_each_head(const mx::array& q, const mx::array& k, const mx::array& v, mx::array& out,
                   F attend) {
  const int batch = q.shape(0), heads = q.shape(1), rows = q.shape(2), dim = q.shape(3);
  std::vector<float> qc, kc, vc;
  for (int b = 0; b < batch; ++b)
    for (int hh = 0; hh < heads; ++hh) {
      Head h;
      h.q = plane(q, b, hh, qc, h.q_row);
      h.k = plane(k, b, hh, kc, h.k_row);
      h.v = plane(v, b, hh, vc, h.v_row);
      h.out = out.data<float>() + (static_cast<int64_t>(b) * heads + hh) * rows * dim;
      attend(h, b);
    }
}

// One key head: `rows` queries (group-major: row r is at position r % length of the slice)
// against `keys` keys, the last `length` of them the slice's own under the causal mask.
template <typename V, typename I>
void attend_head(const Head& h, int rows, int keys, int dim, int length, float q_scale) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int cached = keys - length;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<V> qc(dim), acc(dim);
  alignas(64) V s[KB];
  for (int c = 0; c < rows; c += W) {
    alignas(64) float lane[W];
    for (int e = 0; e < dim; ++e) {
      for (int w = 0; w < W; ++w)
        lane[w] = c + w < rows ? h.q[(c + w) * h.q_row + e] * q_scale : 0.0f;
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

// A primitive computed on the CPU only: its output allocated, its operands registered with the
// stream's encoder and work(inputs, out) queued on the stream, as MLX's own CPU ops do.
class CpuPrimitive : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

 protected:
  template <typename F>
  void queue(const std::vector<mx::array>& inputs, mx::array& out, F work) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in;
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      in.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out),
                      work = std::move(work)]() mutable { work(in, out); });
  }
};

class SliceAttention : public CpuPrimitive {
 public:
  SliceAttention(mx::Stream stream, int length, float scale)
      : CpuPrimitive(stream), length_(length), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    queue(inputs, out, [length = length_, scale = scale_](const std::vector<mx::array>& in,
                                                          mx::array& out) {
      const int rows = in[0].shape(2), keys = in[1].shape(2), dim = in[0].shape(3);
      for_each_head(in[0], in[1], in[2], out, [&](const Head& h, int) {
        if (rows <= 8) attend_head<f8v, i8v>(h, rows, keys, dim, length, scale);
        else attend_head<f16v, i16v>(h, rows, keys, dim, length, scale);
      });
    });
  }
  const char* name() const override { return "SliceAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SliceAttention&>(other);
    return length_ == o.length_ && scale_ == o.scale_;
  }

 private:
  int length_;
  float scale_;
};

void check_operands(const mx::array& queries, const mx::array& keys, const mx::array& values,
                    const std::string& op) {
  if (queries.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4)
    throw std::invalid_argument(op + ": queries, keys and values must be 4-D");
  if (queries.dtype() != mx::float32 || keys.dtype() != mx::float32 ||
      values.dtype() != mx::float32)
    throw std::invalid_argument(op + ": float32 only");
  if (keys.shape() != values.shape() || queries.shape(0) != keys.shape(0) ||
      queries.shape(1) != keys.shape(1) || queries.shape(3) != keys.shape(3))
    throw std::invalid_argument(
        op + ": keys and values (B, H, keys, D) must match queries (B, H, rows, D)");
}

mx::array slice_attention(const mx::array& queries, const mx::array& keys,
                          const mx::array& values, int length, float scale) {
  auto s = mx::to_stream({});
  check_operands(queries, keys, values, "slice_attention");
  if (length < 1 || length > keys.shape(2) || queries.shape(2) % length != 0)
    throw std::invalid_argument(
        "slice_attention: length must be 1 to the keys' count and divide the query rows");
  return mx::array(queries.shape(), mx::float32,
                   std::make_shared<SliceAttention>(s, length, scale), {queries, keys, values});
}


// Decode rows: one query token a row, `group` query heads a key head, row b attending its
// keys from starts[b] on (a left-padded batch cache). Few query rows share a key, so the rows
// are not a vector here: each key's dot product runs over the head dimension, 8 floats at once.
inline float hsum(f8v x) {
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// (hsum(d[0]), ..., hsum(d[7])): three levels of pairwise folds, each two shuffles and an add.
inline f8v sum_lanes(const f8v* d) {
  f8v e[4], f[2];
  for (int i = 0; i < 4; ++i)  // e[i]: d[2i] folded to 4 lanes, then d[2i+1]
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // f[i]: d[4i], d[4i+2], d[4i+1], d[4i+3], 2 lanes each
    f[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(e[2 * i], e[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // d0, d2, d4, d6, d1, d3, d5, d7
  const f8v g = __builtin_shufflevector(f[0], f[1], 0, 2, 8, 10, 4, 6, 12, 14) +
                __builtin_shufflevector(f[0], f[1], 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(g, g, 0, 4, 1, 5, 2, 6, 3, 7);
}

inline f8v load8(const float* p) {
  f8v x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

void attend_rows(const Head& h, int rows, int keys, int dim, int start, float q_scale) {
  constexpr int MAX_ROWS = 16;
  const int chunks = dim / 8;
  std::vector<f8v> acc(static_cast<size_t>(rows) * chunks);
  std::vector<f8v> q(static_cast<size_t>(rows) * chunks);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < chunks; ++c)
      q[r * chunks + c] = load8(h.q + r * h.q_row + 8 * c) * splat<f8v>(q_scale);
  float most[MAX_ROWS], total[MAX_ROWS];
  for (int r = 0; r < rows; ++r) {
    most[r] = -1e30f;
    total[r] = 0.0f;
  }
  for (auto& a : acc) a = splat<f8v>(0.0f);
  alignas(64) float s[MAX_ROWS][KB];
  for (int kb = start; kb < keys; kb += KB) {
    const int nb_keys = std::min(KB, keys - kb);
    int j = 0;
    for (; j + 8 <= nb_keys; j += 8) {  // eight keys' sums reduced together
      const float* k0 = h.k + (kb + j) * h.k_row;
      for (int r = 0; r < rows; ++r) {
        f8v d[8];
        for (int t = 0; t < 8; ++t) {
          d[t] = splat<f8v>(0.0f);
          for (int c = 0; c < chunks; ++c)
            d[t] += q[r * chunks + c] * load8(k0 + t * h.k_row + 8 * c);
        }
        const f8v sums = sum_lanes(d);
        std::memcpy(&s[r][j], &sums, sizeof(sums));
      }
    }
    for (; j < nb_keys; ++j) {
      const float* kj = h.k + (kb + j) * h.k_row;
      for (int r = 0; r < rows; ++r) {
        f8v d = splat<f8v>(0.0f);
        for (int c = 0; c < chunks; ++c) d += q[r * chunks + c] * load8(kj + 8 * c);
        s[r][j] = hsum(d);
      }
    }
    for (int r = 0; r < rows; ++r) {
      float block = most[r];
      for (int j = 0; j < nb_keys; ++j) block = std::max(block, s[r][j]);
      for (int j = nb_keys; j < KB; ++j) s[r][j] = block - 1000.0f;  // weight ~0, not summed
      const f16v shift = splat<f16v>(block);
      float sum = 0.0f;
      for (int j = 0; j < KB; j += 16) {
        f16v x;
        std::memcpy(&x, &s[r][j], sizeof(x));
        x = shifted_exp(x - shift);
        std::memcpy(&s[r][j], &x, sizeof(x));
      }
      for (int j = 0; j < nb_keys; ++j) sum += s[r][j];
      const float scale = shifted_exp(splat<f16v>(most[r] - block))[0];
      most[r] = block;
      total[r] = total[r] * scale + sum;
      for (int c = 0; c < chunks; ++c) acc[r * chunks + c] *= scale;
    }
    for (int j = 0; j < nb_keys; ++j) {
      const float* vj = h.v + (kb + j) * h.v_row;
      for (int c = 0; c < chunks; ++c) {
        const f8v vc = load8(vj + 8 * c);
        for (int r = 0; r < rows; ++r) acc[r * chunks + c] += s[r][j] * vc;
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < chunks; ++c) {
      const f8v out = acc[r * chunks + c] / total[r];
      std::memcpy(h.out + r * dim + 8 * c, &out, sizeof(out));
    }
}

class RowsAttention : public CpuPrimitive {
 public:
  RowsAttention(mx::Stream stream, float scale) : CpuPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    queue(inputs, out, [scale = scale_](const std::vector<mx::array>& in, mx::array& out) {
      const mx::array& starts = in[3];
      const int rows = in[0].shape(2), keys = in[1].shape(2), dim = in[0].shape(3);
      for_each_head(in[0], in[1], in[2], out, [&](const Head& h, int b) {
        const int start = std::clamp(starts.data<int32_t>()[b * starts.strides(0)], 0, keys);
        attend_rows(h, rows, keys, dim, start, scale);
      });
    });
  }
  const char* name() const override { return "RowsAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const RowsAttention&>(other).scale_;
  }

 private:
  float scale_;
};

mx::array rows_attention(const mx::array& queries, const mx::array& keys,
                         const mx::array& values, const mx::array& starts, float scale) {
  auto s = mx::to_stream({});
  check_operands(queries, keys, values, "rows_attention");
  if (queries.shape(2) > 16 || queries.shape(3) % 8 != 0)
    throw std::invalid_argument(
        "rows_attention: at most 16 query rows a key head, head dim a multiple of 8");
  if (starts.ndim() != 1 || starts.shape(0) != queries.shape(0))
    throw std::invalid_argument("rows_attention: starts must be (B,), one per row");
  return mx::array(queries.shape(), mx::float32, std::make_shared<RowsAttention>(s, scale),
                   {queries, keys, values, mx::astype(starts, mx::int32, s)});
}

// exp(x) for x <= 0, 16 at a time: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts,
// so n ln 2 is exact), exp(r) by its Taylor polynomial of degree 7 (error < 2e-8 there), times
// 2^n built in the exponent's bits; 0 below -87.3, where exp(x) leaves float32's normal range.
inline f16v exp_nonpositive(f16v x) {
  const f16v low = splat<f16v>(-88.0f);
  const f16v xc = x > low ? x : low;  // bounded for the conversions below (-inf, NaN: -88)
  // n = round(x / ln 2): truncation of y - 0.5 rounds y <= 0 to nearest.
  const i16v ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, i16v);
  const f16v n = __builtin_convertvector(ni, f16v);
  const f16v r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  const f16v r2 = r * r;
  const f16v p = (1.0f + r) + r2 * (0.5f + (1.0f / 6) * r) +
      r2 * r2 * ((1.0f / 24 + (1.0f / 120) * r) + r2 * (1.0f / 720 + (1.0f / 5040) * r));
  const i16v bits = (ni + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? splat<f16v>(0.0f) : p * scale;
}

// (g * sigmoid(g)) * u for 16 floats: sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e)
// below, e = exp(-|g|) (never past 1, so never overflows).
inline f16v swiglu16(f16v g, f16v u) {
  const f16v e = exp_nonpositive(g < 0.0f ? g : -g);
  const f16v sigmoid = (g < 0.0f ? e : splat<f16v>(1.0f)) / (1.0f + e);
  return (g * sigmoid) * u;
}

// `a`'s elements in row-major order: its own buffer where it is row-contiguous (a product's
// output always is), else gathered into `copy` (a view: transposed, broadcast, sliced).
const float* row_major(const mx::array& a, std::vector<float>& copy) {
  if (a.flags().row_contiguous) return a.data<float>();
  copy.resize(a.size());
  const int nd = a.ndim();
  std::vector<int64_t> at(nd, 0);
  const float* base = a.data<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t offset = 0;
    for (int d = 0; d < nd; ++d) offset += at[d] * a.strides(d);
    copy[i] = base[offset];
    for (int d = nd - 1; d >= 0 && ++at[d] == a.shape(d); --d) at[d] = 0;
  }
  return copy.data();
}

class Swiglu : public CpuPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    queue(inputs, out, [](const std::vector<mx::array>& in, mx::array& out) {
      std::vector<float> gate_copy, up_copy;
      const float* g = row_major(in[0], gate_copy);
      const float* u = row_major(in[1], up_copy);
      float* o = out.data<float>();
      const size_t size = out.size();
      size_t i = 0;
      for (; i + 16 <= size; i += 16) {
        f16v gv, uv;
        std::memcpy(&gv, g + i, sizeof(gv));
        std::memcpy(&uv, u + i, sizeof(uv));
        const f16v ov = swiglu16(gv, uv);
        std::memcpy(o + i, &ov, sizeof(ov));
      }
      if (i < size) {  // the last few, in a vector padded with zeros
        const size_t bytes = (size - i) * sizeof(float);
        f16v gv{}, uv{};
        std::memcpy(&gv, g + i, bytes);
        std::memcpy(&uv, u + i, bytes);
        const f16v ov = swiglu16(gv, uv);
        std::memcpy(o + i, &ov, bytes);
      }
    });
  }
  const char* name() const override { return "Swiglu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  auto s = mx::to_stream({});
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32)
    throw std::invalid_argument("swiglu: float32 only");
  if (gate.shape() != up.shape())
    throw std::invalid_argument("swiglu: gate and up must have one shape");
  // The kernel walks its operands as flat buffers, a view's gathered first (`row_major`): no
  // op of MLX's to make them contiguous, two fewer a layer to dispatch.
  return mx::array(gate.shape(), mx::float32, std::make_shared<Swiglu>(s), {gate, up});
}

// Four products and two sums, each rounded alone: no contraction into a fused multiply-add,
// which -march=native would otherwise allow (GCC's pragma, or clang's where $CXX is clang), so
// the result is MLX's fallback's bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_row(const float* x, int64_t x_step, const float* c, int64_t c_step, const float* s,
                int64_t s_step, int half, float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  for (int i = 0; i < half; ++i) {
    const float x1 = x[i * x_step], x2 = x[(i + half) * x_step];
    const float ci = c[i * c_step], si = s[i * s_step];
    out[i] = x1 * ci - x2 * si;
    out[i + half] = x1 * si + x2 * ci;
  }
}
#pragma GCC pop_options

class RotateHalves : public CpuPrimitive {
 public:
  explicit RotateHalves(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    queue(inputs, out, [](const std::vector<mx::array>& in, mx::array& out) {
      const mx::array &x = in[0], &c = in[1], &s = in[2];
      const int batch = x.shape(0), heads = x.shape(1), length = x.shape(2);
      const int half = x.shape(3) / 2;
      float* o = out.data<float>();
      for (int b = 0; b < batch; ++b) {
        const int cb = c.shape(0) == 1 ? 0 : b;  // one table for every row, or one a row
        for (int h = 0; h < heads; ++h)
          for (int l = 0; l < length; ++l) {
            rotate_row(x.data<float>() + b * x.strides(0) + h * x.strides(1) + l * x.strides(2),
                       x.strides(3),
                       c.data<float>() + cb * c.strides(0) + l * c.strides(2), c.strides(3),
                       s.data<float>() + cb * s.strides(0) + l * s.strides(2), s.strides(3),
                       half, o + ((static_cast<int64_t>(b) * heads + h) * length + l) * 2 * half);
          }
      }
    });
  }
  const char* name() const override { return "RotateHalves"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array rotate_halves(const mx::array& x, const mx::array& cos, const mx::array& sin) {
  auto s = mx::to_stream({});
  if (x.dtype() != mx::float32 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32)
    throw std::invalid_argument("rotate_halves: float32 only");
  if (x.ndim() != 4 || x.shape(3) % 2 != 0 || cos.shape() != sin.shape() || cos.ndim() != 4 ||
      (cos.shape(0) != 1 && cos.shape(0) != x.shape(0)) || cos.shape(1) != 1 ||
      cos.shape(2) != x.shape(2) || 2 * cos.shape(3) != x.shape(3))
    throw std::invalid_argument(
        "rotate_halves: x (B, H, L, D) with D even; cos and sin (B or 1, 1, L, D / 2)");
  return mx::array(x.shape(), mx::float32, std::make_shared<RotateHalves>(s), {x, cos, sin});
}

// An RMSNorm's row as MLX's CPU fallback computes it (mlx/fast.cpp, and runtime/kernels.py's
// compiled form): the squares' sum in order from 0 (MLX's CPU reduction, one float at a time
// where its vectors are one wide, as on x86-64), times 1/n as MLX's mean rounds it, plus eps,
// 1 / sqrt of that, then (x * it) * weight; each product and sum rounded alone, as MLX's kernels
// (built for the default x86-64 target, no FMA) round them.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rms_norm_row(const float* x, const float* w, int64_t w_step, int n, float inv_n, float eps,
                  float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float square = x[i] * x[i];
    sum = sum + square;
  }
  const float r = 1.0f / std::sqrt(sum * inv_n + eps);
  for (int i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i * w_step];
}
#pragma GCC pop_options

class RmsNorm : public CpuPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    queue(inputs, out, [eps = eps_](const std::vector<mx::array>& in, mx::array& out) {
      std::vector<float> x_copy;
      const float* x = row_major(in[0], x_copy);
      const mx::array& w = in[1];
      const int n = in[0].shape(-1);
      const int64_t rows = n == 0 ? 0 : in[0].size() / n;
      // MLX's mean: the sum times its number_of_elements, inverted in double, as a float.
      const float inv_n = static_cast<float>(1.0 / n);
      float* o = out.data<float>();
      for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(x + r * n, w.data<float>(), w.strides(0), n, inv_n, eps, o + r * n);
    });
  }
  const char* name() const override { return "RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  auto s = mx::to_stream({});
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32)
    throw std::invalid_argument("rms_norm: float32 only");
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: x (..., D) and weight (D,)");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), {x, weight});
}

}  // namespace

NB_MODULE(_fairtick_native, m) {
  m.def("slice_attention", &slice_attention, "queries"_a, "keys"_a, "values"_a, "length"_a,
        "scale"_a = 1.0f);
  m.def("rows_attention", &rows_attention, "queries"_a, "keys"_a, "values"_a, "starts"_a,
        "scale"_a = 1.0f);
  m.def("swiglu", &swiglu, "gate"_a, "up"_a);
  m.def("rotate_halves", &rotate_halves, "x"_a, "cos"_a, "sin"_a);
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a);
}
