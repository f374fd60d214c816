// Attention of new tokens over the quantized part of a KIVI layer on CPU, reading the packed codes
// directly: each slot is dequantized into a small buffer as it is used, never into a whole layer.
// Loaded with cpu_attention.cpp by kernels/cpu_attention.py; kernels/packed_attention.py folds the
// state it returns into its running softmax and goes on with the full-precision residual.
//
// Dequantizing the whole quantized prefix in every layer at every step (the pure-torch path) wrote
// and read 8 times the bytes of the codes it came from: a 4-bit draft step then cost more than a
// full-cache step. Here the codes are the only prefix bytes read.
//
// Every packed slot is older than every new token (the caller checks): no causal mask. Rows are
// the new tokens' query heads of one KV head, pre-scaled. The result is one online-softmax state
// per row (max, sum of exp, weighted value sum), combined over fixed chunks of slots in order, so
// it does not depend on how many threads ran.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunkGroups = 16;  // key groups per work item: 512 slots at group_size 32

// [256 * 8 / kBits]: the codes a byte holds as floats, lowest bits first (kernels/quant.py).
template <int kBits>
const float* byte_table() {
  constexpr int kPerByte = 8 / kBits;
  static const std::vector<float> table = [] {
    std::vector<float> t(256 * kPerByte);
    for (int byte = 0; byte < 256; ++byte) {
      for (int j = 0; j < kPerByte; ++j) t[byte * kPerByte + j] = float((byte >> (kBits * j)) & ((1 << kBits) - 1));
    }
    return t;
  }();
  return table.data();
}

// A slot's head_dim codes as floats, one table row copied per packed byte.
template <int kBits>
inline void unpack_codes(const uint8_t* packed, int64_t head_dim, const float* table, float* codes) {
  constexpr int kPerByte = 8 / kBits;
  for (int64_t i = 0; i < head_dim / kPerByte; ++i) {
    std::memcpy(codes + i * kPerByte, table + packed[i] * kPerByte, sizeof(float) * kPerByte);
  }
}

struct Layer {
  const float* rows;  // [H, R, D]
  const uint8_t* key_codes;  // [Tq, H, Bp]
  const at::Half* key_scale;  // [Tq / group_size, H, D]
  const at::Half* key_zero;
  const uint8_t* value_codes;  // [Tq, H, Bp]
  const at::Half* value_scale;  // [Tq, H]
  const at::Half* value_zero;
  int64_t num_heads, num_rows, head_dim, packed_dim, group_size;
};

// Partial state of rows of KV head h over slots first .. last - 1: max [R], sum [R], acc [R, D].
// Neither keys nor values are dequantized: with key = zero + code * scale per channel,
// q . key = (q * scale) . code + q . zero, so each key group's statistics fold into the rows once;
// with value = zero + code * scale per slot, sum_t w_t value_t = sum_t (w_t scale_t) code_t +
// (sum_t w_t zero_t), so a slot costs one multiply-add per dimension and row. The arithmetic
// differs from dequantize-then-attend by rounding only (tests/test_packed_attention.py).
template <int kBits>
void attend_chunk(const Layer& L, int64_t h, int64_t first, int64_t last, float* max, float* sum,
                  float* acc, std::vector<float>& scratch) {
  const int64_t D = L.head_dim, R = L.num_rows, width = last - first;
  scratch.resize(D + R * D + R + R * width + R);
  float* codes = scratch.data();
  float* scaled_rows = codes + D;  // [R, D]: q * key scale of the current group
  float* row_bias = scaled_rows + R * D;  // [R]: q . key zero of the current group
  float* scores = row_bias + R;  // [R, width]
  float* zero_sums = scores + R * width;  // [R]
  const float* rows = L.rows + h * R * D;
  const float* table = byte_table<kBits>();
  for (int64_t t = first; t < last; ++t) {
    if (t == first || t % L.group_size == 0) {  // this group's per-channel key statistics
      const int64_t stats = ((t / L.group_size) * L.num_heads + h) * D;
      for (int64_t r = 0; r < R; ++r) {
        float bias = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          scaled_rows[r * D + d] = rows[r * D + d] * float(L.key_scale[stats + d]);
          bias += rows[r * D + d] * float(L.key_zero[stats + d]);
        }
        row_bias[r] = bias;
      }
    }
    unpack_codes<kBits>(L.key_codes + (t * L.num_heads + h) * L.packed_dim, D, table, codes);
    for (int64_t r = 0; r < R; ++r) {
      const float* q = scaled_rows + r * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * codes[d];
      scores[r * width + (t - first)] = dot + row_bias[r];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * width;
    const float peak = at::vec::reduce_all<float>(
        [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, width);
    at::vec::map([peak](Vec x) { return (x - Vec(peak)).exp_u20(); }, row, row, width);
    max[r] = peak;
    sum[r] = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, row, width);
    zero_sums[r] = 0.f;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
  }
  for (int64_t t = first; t < last; ++t) {
    const int64_t slot = t * L.num_heads + h;
    const float v_scale = float(L.value_scale[slot]), v_zero = float(L.value_zero[slot]);
    unpack_codes<kBits>(L.value_codes + slot * L.packed_dim, D, table, codes);
    for (int64_t r = 0; r < R; ++r) {
      const float weight = scores[r * width + (t - first)];
      const float scaled = weight * v_scale;
      zero_sums[r] += weight * v_zero;
      float* out = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] += scaled * codes[d];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] += zero_sums[r];
  }
}

// Folds the partial state (max2, sum2, acc2) into (max, sum, acc), row by row.
void combine(int64_t num_rows, int64_t D, float* max, float* sum, float* acc, const float* max2,
             const float* sum2, const float* acc2) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float peak = std::max(max[r], max2[r]);
    const float a = std::exp(max[r] - peak), b = std::exp(max2[r] - peak);
    sum[r] = sum[r] * a + sum2[r] * b;
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] = acc[r * D + d] * a + acc2[r * D + d] * b;
    max[r] = peak;
  }
}

void check_half(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.device().is_cpu() && t.is_contiguous(), name,
              " must be contiguous CPU float16");
  TORCH_CHECK(t.sizes() == shape, name, " has shape ", t.sizes(), ", expected ", shape);
}

// rows: [H, R, D] float32, each KV head's query rows pre-scaled by 1/sqrt(D); key_codes,
// value_codes: [Tq, H, D * bits / 8] uint8; key_scale, key_zero: [Tq / group_size, H, D] fp16;
// value_scale, value_zero: [Tq, H, 1] fp16.
// -> (max [H, R], sum [H, R], acc [H, R, D]) float32 over all Tq slots (Tq >= 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_attention_state(
    const at::Tensor& rows, const at::Tensor& key_codes, const at::Tensor& key_scale,
    const at::Tensor& key_zero, const at::Tensor& value_codes, const at::Tensor& value_scale,
    const at::Tensor& value_zero, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kFloat && rows.device().is_cpu() &&
                  rows.is_contiguous(),
              "rows must be contiguous CPU float32 [H, R, D]");
  const int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2);
  TORCH_CHECK(key_codes.dim() == 3 && key_codes.scalar_type() == at::kByte &&
                  key_codes.is_contiguous() && key_codes.size(1) == H,
              "key_codes must be contiguous uint8 [Tq, H, D * bits / 8]");
  const int64_t Tq = key_codes.size(0), packed_dim = key_codes.size(2);
  TORCH_CHECK(Tq >= 1 && group_size >= 1 && Tq % group_size == 0, "Tq must be whole groups");
  TORCH_CHECK(packed_dim * (8 / bits) == D, "packed codes do not hold D dimensions");
  TORCH_CHECK(value_codes.sizes() == key_codes.sizes() && value_codes.scalar_type() == at::kByte &&
                  value_codes.is_contiguous(),
              "value_codes must be shaped like key_codes");
  check_half(key_scale, {Tq / group_size, H, D}, "key_scale");
  check_half(key_zero, {Tq / group_size, H, D}, "key_zero");
  check_half(value_scale, {Tq, H, 1}, "value_scale");
  check_half(value_zero, {Tq, H, 1}, "value_zero");
  const Layer L{rows.data_ptr<float>(),         key_codes.data_ptr<uint8_t>(),
                key_scale.data_ptr<at::Half>(), key_zero.data_ptr<at::Half>(),
                value_codes.data_ptr<uint8_t>(), value_scale.data_ptr<at::Half>(),
                value_zero.data_ptr<at::Half>(), H, R, D, packed_dim, group_size};
  const int64_t chunk = kChunkGroups * group_size;
  const int64_t num_chunks = (Tq + chunk - 1) / chunk;
  // Partial states of every (head, chunk), then combined per head in chunk order.
  std::vector<float> maxes(H * num_chunks * R), sums(H * num_chunks * R), accs(H * num_chunks * R * D);
  at::parallel_for(0, H * num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / num_chunks, first = (item % num_chunks) * chunk;
      const int64_t last = std::min(first + chunk, Tq);
      float* max = maxes.data() + item * R;
      float* sum = sums.data() + item * R;
      float* acc = accs.data() + item * R * D;
      switch (bits) {
        case 2: attend_chunk<2>(L, h, first, last, max, sum, acc, scratch); break;
        case 4: attend_chunk<4>(L, h, first, last, max, sum, acc, scratch); break;
        default: attend_chunk<8>(L, h, first, last, max, sum, acc, scratch); break;
      }
    }
  });
  at::Tensor max = at::empty({H, R}, rows.options());
  at::Tensor sum = at::empty({H, R}, rows.options());
  at::Tensor acc = at::empty({H, R, D}, rows.options());
  for (int64_t h = 0; h < H; ++h) {
    const int64_t item = h * num_chunks;
    float* m = max.data_ptr<float>() + h * R;
    float* s = sum.data_ptr<float>() + h * R;
    float* a = acc.data_ptr<float>() + h * R * D;
    std::copy_n(maxes.data() + item * R, R, m);
    std::copy_n(sums.data() + item * R, R, s);
    std::copy_n(accs.data() + item * R * D, R * D, a);
    for (int64_t c = 1; c < num_chunks; ++c) {
      combine(R, D, m, s, a, maxes.data() + (item + c) * R, sums.data() + (item + c) * R,
              accs.data() + (item + c) * R * D);
    }
  }
  return {max, sum, acc};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vericache_cpu, m) {
  m.def("packed_attention_state(Tensor rows, Tensor key_codes, Tensor key_scale, Tensor key_zero, "
        "Tensor value_codes, Tensor value_scale, Tensor value_zero, int bits, int group_size) "
        "-> (Tensor, Tensor, Tensor)",
        &packed_attention_state);
}
