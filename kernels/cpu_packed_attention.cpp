// Attention of new tokens over the quantized part of a KIVI layer on CPU, reading the packed codes
// directly: each slot is dequantized into a small buffer as it is used, never into a whole layer.
// Loaded with cpu_attention.cpp by vericache/kernels/cpu_attention.py; packed_attention.py there
// folds the state it returns into its running softmax and goes on with the full-precision residual.
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
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunkGroups = 16;  // key groups per work item: 512 slots at group_size 32

// Codes in planes: byte i of a slot holds dimensions i * P + j (j = 0 .. P-1, P = 8 / kBits
// codes per byte, lowest bits first: quant.py), and plane j gathers code j of every byte,
// [P, D / P]. Unpacking a slot into planes is a shift and a mask per byte and plane, which the
// compiler vectorizes; query rows and accumulators are kept in the same order.
template <int kBits>
inline void unpack_planes(const uint8_t* packed, int64_t bytes, float* planes) {
  constexpr int kPerByte = 8 / kBits;
  constexpr int kMask = (1 << kBits) - 1;
  for (int j = 0; j < kPerByte; ++j) {
    float* plane = planes + j * bytes;
#pragma omp simd
    for (int64_t i = 0; i < bytes; ++i) plane[i] = float((packed[i] >> (kBits * j)) & kMask);
  }
}

// Dimension d = i * P + j of a row goes to plane position j * (D / P) + i, and back.
inline int64_t plane_index(int64_t d, int64_t per_byte, int64_t bytes) {
  return (d % per_byte) * bytes + d / per_byte;
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

// Partial state of rows of KV head h over slots first .. last - 1: max [R], sum [R], acc [R, D],
// for D = kVecs vectors (the loops over D unroll, and a row's partial sums stay in registers).
// Neither keys nor values are dequantized: with key = zero + code * scale per channel,
// q . key = (q * scale) . code + q . zero, so each key group's statistics fold into the rows once;
// with value = zero + code * scale per slot, sum_t w_t value_t = sum_t (w_t scale_t) code_t +
// (sum_t w_t zero_t), so a slot costs one multiply-add per dimension and row. The arithmetic
// differs from dequantize-then-attend by rounding only (tests/test_kernels.py).
template <int kBits, int kVecs>
void attend_chunk(const Layer& L, int64_t h, int64_t first, int64_t last, float* max, float* sum,
                  float* acc, std::vector<float>& scratch) {
  constexpr int64_t kPerByte = 8 / kBits;
  constexpr int64_t D = kVecs * Vec::size();
  constexpr int64_t B = D / kPerByte;
  const int64_t R = L.num_rows, width = last - first;
  scratch.resize(R * D + R + R * width + R + R * D);
  alignas(64) float codes[D];  // in planes
  alignas(64) float scale[D], zero[D];  // the group's key statistics, in channel order
  float* scaled_rows = scratch.data();  // [R, D] in planes: q * key scale of the current group
  float* row_bias = scaled_rows + R * D;  // [R]: q . key zero of the current group
  float* scores = row_bias + R;  // [R, width]
  float* zero_sums = scores + R * width;  // [R]
  float* planes_acc = zero_sums + R;  // [R, D] in planes
  const float* rows = L.rows + h * R * D;
  for (int64_t t = first; t < last; ++t) {
    if (t == first || t % L.group_size == 0) {  // this group's per-channel key statistics
      const int64_t group = ((t / L.group_size) * L.num_heads + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        scale[d] = float(L.key_scale[group + d]);
        zero[d] = float(L.key_zero[group + d]);
      }
      for (int64_t r = 0; r < R; ++r) {
        float bias = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          scaled_rows[r * D + plane_index(d, kPerByte, B)] = rows[r * D + d] * scale[d];
          bias += rows[r * D + d] * zero[d];
        }
        row_bias[r] = bias;
      }
    }
    unpack_planes<kBits>(L.key_codes + (t * L.num_heads + h) * B, B, codes);
    Vec code_vecs[kVecs];
    for (int j = 0; j < kVecs; ++j) code_vecs[j] = Vec::loadu(codes + j * Vec::size());
    for (int64_t r = 0; r < R; ++r) {
      const float* q = scaled_rows + r * D;
      Vec dot = Vec::loadu(q) * code_vecs[0];
      for (int j = 1; j < kVecs; ++j) {
        dot = at::vec::fmadd(Vec::loadu(q + j * Vec::size()), code_vecs[j], dot);
      }
      scores[r * width + (t - first)] = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return a + b; }, dot) + row_bias[r];
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
  }
  std::fill(planes_acc, planes_acc + R * D, 0.f);
  for (int64_t t = first; t < last; ++t) {
    const int64_t slot = t * L.num_heads + h;
    const float v_scale = float(L.value_scale[slot]), v_zero = float(L.value_zero[slot]);
    unpack_planes<kBits>(L.value_codes + slot * B, B, codes);
    Vec code_vecs[kVecs];
    for (int j = 0; j < kVecs; ++j) code_vecs[j] = Vec::loadu(codes + j * Vec::size());
    for (int64_t r = 0; r < R; ++r) {
      const float weight = scores[r * width + (t - first)];
      zero_sums[r] += weight * v_zero;
      const Vec scaled(weight * v_scale);
      float* out = planes_acc + r * D;
      for (int j = 0; j < kVecs; ++j) {
        float* part = out + j * Vec::size();
        at::vec::fmadd(scaled, code_vecs[j], Vec::loadu(part)).store(part);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      acc[r * D + d] = planes_acc[r * D + plane_index(d, kPerByte, B)] + zero_sums[r];
    }
  }
}

// attend_chunk for this bit width and head size.
template <int kBits>
void attend_chunk_bits(const Layer& L, int64_t h, int64_t first, int64_t last, float* max,
                       float* sum, float* acc, std::vector<float>& scratch) {
  switch (L.head_dim / Vec::size()) {
    case 1: attend_chunk<kBits, 1>(L, h, first, last, max, sum, acc, scratch); break;
    case 2: attend_chunk<kBits, 2>(L, h, first, last, max, sum, acc, scratch); break;
    case 4: attend_chunk<kBits, 4>(L, h, first, last, max, sum, acc, scratch); break;
    case 8: attend_chunk<kBits, 8>(L, h, first, last, max, sum, acc, scratch); break;
    case 16: attend_chunk<kBits, 16>(L, h, first, last, max, sum, acc, scratch); break;
    case 32: attend_chunk<kBits, 32>(L, h, first, last, max, sum, acc, scratch); break;
    default: TORCH_CHECK(false, "head_dim ", L.head_dim, " is not 1, 2, 4, 8, 16 or 32 vectors");
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

// Folds the full-precision residual into each row's state and normalizes: row r of a head is
// token m = r % num_new (rows are ordered group member, token), which sees residual slots
// 0 .. Rr - num_new + m. keys, values: [Rr, H, D] float32 with slot and head strides.
void attend_residual(const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& values,
                     int64_t num_new, float* max, float* sum, float* acc) {
  const int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2), Rr = keys.size(0);
  const float* q_all = rows.data_ptr<float>();
  const float* k_all = keys.data_ptr<float>();
  const float* v_all = values.data_ptr<float>();
  std::vector<float> scores(std::max<int64_t>(Rr, 1));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = h * R + r, seen = Rr - num_new + r % num_new + 1;
      const float* q = q_all + row * D;
      float peak = max[row];
      for (int64_t t = 0; t < seen; ++t) {
        const float* k = k_all + t * keys.stride(0) + h * keys.stride(1);
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
        scores[t] = dot;
        peak = std::max(peak, dot);
      }
      const float correction = std::exp(max[row] - peak);
      float total = sum[row] * correction;
      float* a = acc + row * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      for (int64_t t = 0; t < seen; ++t) {
        const float weight = std::exp(scores[t] - peak);
        total += weight;
        const float* v = v_all + t * values.stride(0) + h * values.stride(1);
        for (int64_t d = 0; d < D; ++d) a[d] += weight * v[d];
      }
      for (int64_t d = 0; d < D; ++d) a[d] /= total;
    }
  }
}

void check_residual(const at::Tensor& t, int64_t H, int64_t D, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
                  t.size(1) == H && t.size(2) == D && t.stride(2) == 1,
              name, " must be CPU float32 [Rr, H, D] with contiguous head rows");
}

// rows: [H, R, D] float32, each KV head's query rows (group member, token) pre-scaled by
// 1/sqrt(D); key_codes, value_codes: [Tq, H, D * bits / 8] uint8; key_scale, key_zero:
// [Tq / group_size, H, D] fp16; value_scale, value_zero: [Tq, H, 1] fp16; residual_keys,
// residual_values: [Rr, H, D] float32, whose last num_new slots are the new tokens (every packed
// slot is older than all of them).
// -> [H, R, D] float32: each row's attention over the Tq packed slots and the residual it sees.
at::Tensor packed_attention(const at::Tensor& rows, const at::Tensor& key_codes,
                            const at::Tensor& key_scale, const at::Tensor& key_zero,
                            const at::Tensor& value_codes, const at::Tensor& value_scale,
                            const at::Tensor& value_zero, const at::Tensor& residual_keys,
                            const at::Tensor& residual_values, int64_t num_new, int64_t bits,
                            int64_t group_size) {
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
  check_residual(residual_keys, H, D, "residual_keys");
  check_residual(residual_values, H, D, "residual_values");
  TORCH_CHECK(residual_values.size(0) == residual_keys.size(0), "residual keys and values differ");
  TORCH_CHECK(num_new >= 1 && R % num_new == 0 && num_new <= residual_keys.size(0) + 1,
              "num_new must divide the rows, and every packed slot be older than the new tokens");
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
        case 2: attend_chunk_bits<2>(L, h, first, last, max, sum, acc, scratch); break;
        case 4: attend_chunk_bits<4>(L, h, first, last, max, sum, acc, scratch); break;
        default: attend_chunk_bits<8>(L, h, first, last, max, sum, acc, scratch); break;
      }
    }
  });
  std::vector<float> max(H * R), sum(H * R);
  at::Tensor out = at::empty({H, R, D}, rows.options());
  float* acc = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    const int64_t item = h * num_chunks;
    float* m = max.data() + h * R;
    float* s = sum.data() + h * R;
    float* a = acc + h * R * D;
    std::copy_n(maxes.data() + item * R, R, m);
    std::copy_n(sums.data() + item * R, R, s);
    std::copy_n(accs.data() + item * R * D, R * D, a);
    for (int64_t c = 1; c < num_chunks; ++c) {
      combine(R, D, m, s, a, maxes.data() + (item + c) * R, sums.data() + (item + c) * R,
              accs.data() + (item + c) * R * D);
    }
  }
  attend_residual(rows, residual_keys, residual_values, num_new, max.data(), sum.data(), acc);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vericache_cpu, m) {
  m.def("packed_attention(Tensor rows, Tensor key_codes, Tensor key_scale, Tensor key_zero, "
        "Tensor value_codes, Tensor value_scale, Tensor value_zero, Tensor residual_keys, "
        "Tensor residual_values, int num_new, int bits, int group_size) -> Tensor",
        &packed_attention);
}
