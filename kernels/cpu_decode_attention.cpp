// Decode attention on CPU for a batch of sequences, one new token each, every sequence over its own
// KV cache (no copy into a padded batch). Loaded by kernels/cpu_decode.py, which compiles it with
// CPU_CAPABILITY set to the vector width torch uses on this machine.
//
// One work item is one (sequence, KV head): its G query rows (the GQA group) take one pass over the
// head's keys and one over its values, so each cached byte is read from memory once per step.
// Library attention on CPU runs one call per sequence and reads a KV head once per query head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kSlotChunk = 128;  // value rows folded per pass over the group: stays in L1

struct HeadView {
  const float* keys;  // slot t at keys + t * key_stride: D contiguous floats
  const float* values;
  int64_t num_slots;
  int64_t key_stride;
  int64_t value_stride;
};

// scores[g * T + t] = (q[g] . key_t) * scale. q: [G, D] with D = kVecs * Vec::size().
template <int kVecs>
void score_keys(const float* q, const HeadView& head, int64_t group, float scale, float* scores) {
  constexpr int64_t kDim = kVecs * Vec::size();
  for (int64_t t = 0; t < head.num_slots; ++t) {
    const float* key = head.keys + t * head.key_stride;
    Vec key_vecs[kVecs];
    for (int j = 0; j < kVecs; ++j) key_vecs[j] = Vec::loadu(key + j * Vec::size());
    for (int64_t g = 0; g < group; ++g) {
      const float* row = q + g * kDim;
      Vec dot = Vec::loadu(row) * key_vecs[0];
      for (int j = 1; j < kVecs; ++j) dot = at::vec::fmadd(Vec::loadu(row + j * Vec::size()), key_vecs[j], dot);
      scores[g * head.num_slots + t] = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return a + b; }, dot) * scale;
    }
  }
}

// In place: scores -> exp(scores - max); returns the row's sum.
float exponentiate(float* scores, int64_t n) {
  const float peak = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, scores, n);
  at::vec::map([peak](Vec x) { return (x - Vec(peak)).exp_u20(); }, scores, scores, n);
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, scores, n);
}

// out[g] = sum_t weights[g * T + t] * value_t / totals[g], chunk by chunk of slots.
template <int kVecs>
void weigh_values(const float* weights, const float* totals, const HeadView& head, int64_t group,
                  float* out) {
  constexpr int64_t kDim = kVecs * Vec::size();
  std::fill(out, out + group * kDim, 0.f);
  for (int64_t first = 0; first < head.num_slots; first += kSlotChunk) {
    const int64_t last = std::min(first + kSlotChunk, head.num_slots);
    for (int64_t g = 0; g < group; ++g) {
      Vec acc[kVecs];
      for (int j = 0; j < kVecs; ++j) acc[j] = Vec::loadu(out + g * kDim + j * Vec::size());
      const float* row_weights = weights + g * head.num_slots;
      for (int64_t t = first; t < last; ++t) {
        const float* value = head.values + t * head.value_stride;
        const Vec weight(row_weights[t]);
        for (int j = 0; j < kVecs; ++j) acc[j] = at::vec::fmadd(weight, Vec::loadu(value + j * Vec::size()), acc[j]);
      }
      for (int j = 0; j < kVecs; ++j) acc[j].store(out + g * kDim + j * Vec::size());
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const Vec inverse(1.f / totals[g]);
    for (int j = 0; j < kVecs; ++j) {
      float* slot = out + g * kDim + j * Vec::size();
      (Vec::loadu(slot) * inverse).store(slot);
    }
  }
}

template <int kVecs>
void attend_head(const float* q, float* out, const HeadView& head, int64_t group, float scale,
                 std::vector<float>& scratch) {
  scratch.resize(group * head.num_slots);
  score_keys<kVecs>(q, head, group, scale, scratch.data());
  std::vector<float> totals(group);
  for (int64_t g = 0; g < group; ++g) {
    totals[g] = exponentiate(scratch.data() + g * head.num_slots, head.num_slots);
  }
  weigh_values<kVecs>(scratch.data(), totals.data(), head, group, out);
}

void check_layer(const at::Tensor& t, int64_t num_kv_heads, int64_t head_dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be CPU float32");
  TORCH_CHECK(t.dim() == 3 && t.size(1) == num_kv_heads && t.size(2) == head_dim,
              name, " must be [T, Hkv, D]");
  TORCH_CHECK(t.stride(2) == 1, name, " must have contiguous head rows");
}

template <int kVecs>
void attend_all(const float* q, float* out, const std::vector<HeadView>& heads, int64_t group,
                float scale) {
  constexpr int64_t kDim = kVecs * Vec::size();
  at::parallel_for(0, static_cast<int64_t>(heads.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      // Query head j attends with KV head j / G, so item (b, h) owns query rows h*G .. h*G + G-1.
      const int64_t offset = item * group * kDim;
      attend_head<kVecs>(q + offset, out + offset, heads[item], group, scale, scratch);
    }
  });
}

// queries: [B, Hq, D]; keys[b], values[b]: [T_b, Hkv, D] (any slot and head strides). -> [B, Hq, D]
at::Tensor decode_attention(const at::Tensor& queries, at::TensorList keys, at::TensorList values,
                            double scale) {
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == at::kFloat && queries.device().is_cpu(),
              "queries must be CPU float32 [B, Hq, D]");
  const int64_t batch = queries.size(0), num_heads = queries.size(1), head_dim = queries.size(2);
  TORCH_CHECK(batch > 0 && static_cast<int64_t>(keys.size()) == batch && values.size() == keys.size(),
              "one keys and one values tensor per query");
  const int64_t num_kv_heads = keys[0].size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv");
  std::vector<HeadView> heads;
  heads.reserve(batch * num_kv_heads);
  for (int64_t b = 0; b < batch; ++b) {
    check_layer(keys[b], num_kv_heads, head_dim, "keys");
    check_layer(values[b], num_kv_heads, head_dim, "values");
    TORCH_CHECK(keys[b].size(0) == values[b].size(0) && keys[b].size(0) > 0,
                "keys and values need the same, non-zero number of slots");
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      heads.push_back({keys[b].data_ptr<float>() + h * keys[b].stride(1),
                       values[b].data_ptr<float>() + h * values[b].stride(1), keys[b].size(0),
                       keys[b].stride(0), values[b].stride(0)});
    }
  }
  TORCH_CHECK(head_dim % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  const at::Tensor q = queries.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t group = num_heads / num_kv_heads;
  const float s = static_cast<float>(scale);
  switch (head_dim / Vec::size()) {
    case 1: attend_all<1>(q.data_ptr<float>(), out.data_ptr<float>(), heads, group, s); break;
    case 2: attend_all<2>(q.data_ptr<float>(), out.data_ptr<float>(), heads, group, s); break;
    case 4: attend_all<4>(q.data_ptr<float>(), out.data_ptr<float>(), heads, group, s); break;
    case 8: attend_all<8>(q.data_ptr<float>(), out.data_ptr<float>(), heads, group, s); break;
    case 16: attend_all<16>(q.data_ptr<float>(), out.data_ptr<float>(), heads, group, s); break;
    // 128 floats in 4-float vectors (NEON on ARM, where torch reports no x86 capability).
    case 32: attend_all<32>(q.data_ptr<float>(), out.data_ptr<float>(), heads, group, s); break;
    default: TORCH_CHECK(false, "head_dim ", head_dim, " is not 1, 2, 4, 8, 16 or 32 vectors");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(vericache_cpu, m) {
  m.def("decode_attention(Tensor queries, Tensor[] keys, Tensor[] values, float scale) -> Tensor",
        &decode_attention);
}
