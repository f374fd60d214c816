// Causal attention on CPU for a batch of sequences, each over its own KV cache (no copy into a
// padded batch): the new tokens of sequence b are the last num_new[b] slots of its cache. Loaded
// by cpu_attention.py, which compiles it with CPU_CAPABILITY set to the vector width torch
// uses on this machine.
//
// Every query row is computed on its own, in a fixed order over the slots it sees: its result
// depends on its query and those slots alone, never on how many other rows, tokens or sequences
// share the call. So a token verified among 31 gets the bits it gets decoded alone, which is what
// makes VeriCache's output identical to full decoding (vericache/model/kernels.py).
//
// One work item is one (sequence, KV head, block of new tokens): the block's query rows (its
// tokens times the GQA group) share each key and value read, so a one-token step reads each cached
// byte once. Library attention on CPU reads a KV head once per query head.
//
// A cache holds float32 slots, or 16-bit ones (a draft cache stored in bfloat16 or float16, which
// halves the bytes a draft step reads): they are widened to float32 as they are read, exactly, so
// the arithmetic is the float32 kernel's on the widened slots.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kSlotChunk = 128;  // value rows folded per pass over the rows: stays in L1
constexpr int64_t kTokenBlock = 8;   // new tokens per work item: keeps both cores busy on one verify

struct HeadView {
  const void* keys;  // slot t at keys + t * key_stride elements: D contiguous ones
  const void* values;
  int64_t key_stride;
  int64_t value_stride;
  at::ScalarType type;  // of keys and values: float, bfloat16 or half
};

// Vec::size() elements of a slot from p, widened to float32 (exact).
template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// One work item: tokens first..first+count-1 of a sequence whose token m sees slots
// [0, seen_before + m + 1), against one KV head. Query and output rows of token m: G rows of D
// floats at queries + m * token_stride (and out + m * token_stride).
struct WorkItem {
  HeadView head;
  const float* queries;
  float* out;
  int64_t token_stride;
  int64_t first;
  int64_t count;
  int64_t seen_before;  // slots before the sequence's first new token
  int64_t stride = 0;  // floats per row of the score scratch: the slots seen, in whole tiles

  int64_t num_seen(int64_t m) const { return seen_before + m + 1; }
};

// Slots per transposed key tile: two vectors, so that each broadcast query element feeds two
// multiply-adds.
constexpr int64_t kTileVecs = 2;
constexpr int64_t kTile = kTileVecs * Vec::size();

// Where row r of the item starts in queries and in out (floats): token first + r / G, group
// member r % G.
inline int64_t row_offset(const WorkItem& item, int64_t group, int64_t r, int64_t dim) {
  return (item.first + r / group) * item.token_stride + (r % group) * dim;
}

// Rows row0 .. row0 + kRows - 1 against one key tile transposed to [D, kTile]: the tile's scores,
// each the sum over d = 0 .. D-1 in order of q[d] * key[d], one multiply-add at a time (the same
// arithmetic for every row and slot, whatever the block).
template <int kVecs, int kRows>
void score_tile(const WorkItem& item, int64_t group, const float* tile, int64_t row0, float scale,
                float* scores) {
  constexpr int64_t kDim = kVecs * Vec::size();
  const float* rows[kRows];
  for (int b = 0; b < kRows; ++b) rows[b] = item.queries + row_offset(item, group, row0 + b, kDim);
  Vec acc[kRows][kTileVecs];
  for (int v = 0; v < kTileVecs; ++v) {
    const Vec slots = Vec::loadu(tile + v * Vec::size());
    for (int b = 0; b < kRows; ++b) acc[b][v] = Vec(rows[b][0]) * slots;
  }
  for (int64_t d = 1; d < kDim; ++d) {
    Vec slots[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) slots[v] = Vec::loadu(tile + d * kTile + v * Vec::size());
    for (int b = 0; b < kRows; ++b) {
      const Vec q(rows[b][d]);
      for (int v = 0; v < kTileVecs; ++v) acc[b][v] = at::vec::fmadd(q, slots[v], acc[b][v]);
    }
  }
  for (int b = 0; b < kRows; ++b) {
    for (int v = 0; v < kTileVecs; ++v) {
      (acc[b][v] * Vec(scale)).store(scores + b * item.stride + v * Vec::size());
    }
  }
}

// Calls op.template operator()<kRows>(row) over rows begin .. end-1 in blocks of kMaxRows, then
// one block of what is left: the register blocking, which changes no row's arithmetic.
template <int kMaxRows, typename Op>
void for_row_blocks(int64_t begin, int64_t end, const Op& op) {
  int64_t r = begin;
  for (; r + kMaxRows <= end; r += kMaxRows) op.template operator()<kMaxRows>(r);
  switch (end - r) {
    case 0: break;
    case 1: op.template operator()<1>(r); break;
    case 2: if constexpr (kMaxRows > 2) op.template operator()<2>(r); break;
    case 3: if constexpr (kMaxRows > 3) op.template operator()<3>(r); break;
  }
}

// `width` 16-bit key slots (slot stride `key_stride` elements) into tile [D, kTile], as float32.
// Out of line: inlined into score_keys, its buffer changed the code of the float32 path too, which
// then ran 20-60% slower (verifications and full decode steps, measured).
template <int kVecs, typename T>
[[gnu::noinline]] void transpose_widened(const T* keys, int64_t key_stride, int width, float* tile) {
  constexpr int64_t kDim = kVecs * Vec::size();
  alignas(64) float rows[kTile * kDim];
  for (int s = 0; s < width; ++s) {
    for (int j = 0; j < kVecs; ++j) {
      load_floats(keys + s * key_stride + j * Vec::size()).store(rows + s * kDim + j * Vec::size());
    }
  }
  at::vec::transpose_mxn<float>(rows, kDim, tile, kTile, width, kDim);
}

// scores[r * stride + t] = (q_r . key_t) * scale for every row r of the item and slot t it sees
// (and a few slots past it, in its last tile). The keys go kTile slots at a time into a tile
// transposed to [D, kTile]: a vector then holds one dimension of Vec::size() slots, and a row's
// scores take D multiply-adds per vector, with no horizontal sums. 16-bit keys are widened to
// float32 (exactly) a tile at a time on the way.
template <int kVecs, typename T>
void score_keys(const WorkItem& item, int64_t group, float scale, float* scores) {
  constexpr int64_t kDim = kVecs * Vec::size();
  float tile[kDim * kTile] = {};
  const int64_t num_rows = item.count * group;
  const int64_t num_slots = item.num_seen(item.first + item.count - 1);
  const T* keys = static_cast<const T*>(item.head.keys);
  for (int64_t t0 = 0; t0 < num_slots; t0 += kTile) {
    const int width = static_cast<int>(std::min(kTile, num_slots - t0));
    if constexpr (std::is_same_v<T, float>) {
      at::vec::transpose_mxn<float>(keys + t0 * item.head.key_stride, item.head.key_stride, tile,
                                    kTile, width, kDim);
    } else {
      transpose_widened<kVecs>(keys + t0 * item.head.key_stride, item.head.key_stride, width, tile);
    }
    // Token m sees slot t0 from m = t0 - seen_before on.
    const int64_t first_row = (std::max(item.first, t0 - item.seen_before) - item.first) * group;
    for_row_blocks<4>(first_row, num_rows, [&]<int kRows>(int64_t r) {
      score_tile<kVecs, kRows>(item, group, tile, r, scale, scores + r * item.stride + t0);
    });
  }
}

// In place: scores -> exp(scores - max); returns the row's sum.
float exponentiate(float* scores, int64_t n) {
  const float peak = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, scores, n);
  at::vec::map([peak](Vec x) { return (x - Vec(peak)).exp_u20(); }, scores, scores, n);
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, scores, n);
}

// Rows row0 .. row0 + kRows - 1 fold slots first .. last-1 into their accumulators, slot by slot
// in order: each value vector read once for the block.
template <int kVecs, int kRows, typename T>
void weigh_chunk(const WorkItem& item, const float* weights, int64_t row0, int64_t first,
                 int64_t last, Vec* acc) {
  Vec sums[kRows][kVecs];  // in registers while it folds the chunk
  for (int b = 0; b < kRows; ++b) std::copy_n(acc + (row0 + b) * kVecs, kVecs, sums[b]);
  for (int64_t t = first; t < last; ++t) {
    const T* value = static_cast<const T*>(item.head.values) + t * item.head.value_stride;
    Vec value_vecs[kVecs];
    for (int j = 0; j < kVecs; ++j) value_vecs[j] = load_floats(value + j * Vec::size());
    for (int b = 0; b < kRows; ++b) {
      const Vec weight(weights[(row0 + b) * item.stride + t]);
      for (int j = 0; j < kVecs; ++j) sums[b][j] = at::vec::fmadd(weight, value_vecs[j], sums[b][j]);
    }
  }
  for (int b = 0; b < kRows; ++b) std::copy_n(sums[b], kVecs, acc + (row0 + b) * kVecs);
}

// out_r = sum_t weights[r * stride + t] * value_t / totals[r], the sum over t in order for every
// row, chunk by chunk of slots that stay in L1 while every row seeing them folds them in.
template <int kVecs, typename T>
void weigh_values(const WorkItem& item, int64_t group, const float* weights, const float* totals) {
  constexpr int64_t kDim = kVecs * Vec::size();
  constexpr int kMaxRows = kVecs >= 8 ? 2 : 4;  // accumulators that fit the vector registers
  const int64_t num_rows = item.count * group;
  const int64_t last_token = item.first + item.count - 1;
  const int64_t num_slots = item.num_seen(last_token);
  std::vector<Vec> acc(num_rows * kVecs, Vec(0.f));
  for (int64_t first = 0; first < num_slots; first += kSlotChunk) {
    const int64_t last = std::min(first + kSlotChunk, num_slots);
    // Tokens from m = last - 1 - seen_before on see the whole chunk: their rows go in blocks.
    // The tokens before them that see part of it go row group by row group.
    const int64_t whole = std::max(item.first, last - 1 - item.seen_before);
    for (int64_t m = std::max(item.first, first - item.seen_before); m < whole; ++m) {
      const int64_t r = (m - item.first) * group;
      for_row_blocks<kMaxRows>(r, r + group, [&]<int kRows>(int64_t row) {
        weigh_chunk<kVecs, kRows, T>(item, weights, row, first, item.num_seen(m), acc.data());
      });
    }
    for_row_blocks<kMaxRows>((whole - item.first) * group, num_rows, [&]<int kRows>(int64_t row) {
      weigh_chunk<kVecs, kRows, T>(item, weights, row, first, last, acc.data());
    });
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const Vec inverse(1.f / totals[r]);
    float* out = item.out + row_offset(item, group, r, kDim);
    for (int j = 0; j < kVecs; ++j) (acc[r * kVecs + j] * inverse).store(out + j * Vec::size());
  }
}

template <int kVecs, typename T>
void attend_typed(WorkItem item, int64_t group, float scale, std::vector<float>& scratch) {
  const int64_t num_slots = item.num_seen(item.first + item.count - 1);
  item.stride = (num_slots + kTile - 1) / kTile * kTile;
  const int64_t stride = item.stride;
  const int64_t num_rows = item.count * group;
  scratch.resize(num_rows * stride + num_rows);
  float* scores = scratch.data();
  float* totals = scores + num_rows * stride;
  score_keys<kVecs, T>(item, group, scale, scores);
  for (int64_t m = item.first; m < item.first + item.count; ++m) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (m - item.first) * group + g;
      totals[r] = exponentiate(scores + r * stride, item.num_seen(m));
    }
  }
  weigh_values<kVecs, T>(item, group, scores, totals);
}

template <int kVecs>
void attend_item(const WorkItem& item, int64_t group, float scale, std::vector<float>& scratch) {
  switch (item.head.type) {
    case at::kBFloat16: attend_typed<kVecs, at::BFloat16>(item, group, scale, scratch); break;
    case at::kHalf: attend_typed<kVecs, at::Half>(item, group, scale, scratch); break;
    default: attend_typed<kVecs, float>(item, group, scale, scratch); break;
  }
}

// Items differ in cost a hundredfold when a draft step shares the call with a verification (a
// block of 8 verified tokens over 7k slots, one draft token over 1.7k): split into two equal
// halves of the list, one thread would get every verification block while the other waited. So
// the threads take items one at a time, in list order, which keeps a head's blocks together as
// the static split did (sorting by cost scattered them, and a lock-step batch of verifications
// ran 10-15% slower). Which thread computes an item changes none of its bits.
template <int kVecs>
void attend_all(const std::vector<WorkItem>& items, int64_t group, float scale) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < num_items; i = next++) {
      attend_item<kVecs>(items[i], group, scale, scratch);
    }
  });
}

void check_layer(const at::Tensor& t, int64_t num_kv_heads, int64_t head_dim, const char* name) {
  const auto type = t.scalar_type();
  const bool is_served = type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
  TORCH_CHECK(t.device().is_cpu() && is_served, name, " must be CPU float32, bfloat16 or float16");
  TORCH_CHECK(t.dim() == 3 && t.size(1) == num_kv_heads && t.size(2) == head_dim,
              name, " must be [T, Hkv, D]");
  TORCH_CHECK(t.stride(2) == 1, name, " must have contiguous head rows");
}

// Where KV head h of a [T, Hkv, D] layer starts.
const void* head_start(const at::Tensor& t, int64_t h) {
  return static_cast<const char*>(t.data_ptr()) + h * t.stride(1) * t.element_size();
}

// queries: [N, Hq, D], the new tokens of every sequence in order; keys[b], values[b]: [T_b, Hkv, D]
// (any slot and head strides; float32, bfloat16 or float16 per sequence), whose last num_new[b]
// slots are sequence b's new tokens.
// -> [N, Hq, D]
at::Tensor attention(const at::Tensor& queries, at::TensorList keys, at::TensorList values,
                     at::IntArrayRef num_new, double scale) {
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == at::kFloat && queries.device().is_cpu(),
              "queries must be CPU float32 [N, Hq, D]");
  const int64_t num_heads = queries.size(1), head_dim = queries.size(2);
  const int64_t batch = static_cast<int64_t>(keys.size());
  TORCH_CHECK(batch > 0 && static_cast<int64_t>(values.size()) == batch &&
                  static_cast<int64_t>(num_new.size()) == batch,
              "one keys tensor, one values tensor and one num_new per sequence");
  const int64_t num_kv_heads = keys[0].size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(head_dim % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  const int64_t group = num_heads / num_kv_heads;
  const at::Tensor q = queries.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t token_stride = num_heads * head_dim;
  std::vector<WorkItem> items;
  int64_t offset = 0;  // the sequence's first query token
  for (int64_t b = 0; b < batch; ++b) {
    check_layer(keys[b], num_kv_heads, head_dim, "keys");
    check_layer(values[b], num_kv_heads, head_dim, "values");
    const int64_t num_slots = keys[b].size(0), count = num_new[b];
    TORCH_CHECK(values[b].size(0) == num_slots, "keys and values need the same number of slots");
    TORCH_CHECK(values[b].scalar_type() == keys[b].scalar_type(), "keys and values need one dtype");
    TORCH_CHECK(count >= 1 && count <= num_slots, "num_new[", b, "] must lie in [1, ", num_slots, "]");
    TORCH_CHECK(offset + count <= q.size(0), "num_new adds up to more tokens than queries holds");
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const HeadView head{head_start(keys[b], h), head_start(values[b], h), keys[b].stride(0),
                          values[b].stride(0), keys[b].scalar_type()};
      // Query head j attends with KV head j / G: head h owns rows h*G .. h*G + G-1 of a token.
      const int64_t rows = (offset * num_heads + h * group) * head_dim;
      for (int64_t first = 0; first < count; first += kTokenBlock) {
        items.push_back({head, q.data_ptr<float>() + rows, out.data_ptr<float>() + rows,
                         token_stride, first, std::min(kTokenBlock, count - first), num_slots - count});
      }
    }
    offset += count;
  }
  TORCH_CHECK(offset == q.size(0), "num_new must add up to the number of query tokens");
  const float s = static_cast<float>(scale);
  switch (head_dim / Vec::size()) {
    case 1: attend_all<1>(items, group, s); break;
    case 2: attend_all<2>(items, group, s); break;
    case 4: attend_all<4>(items, group, s); break;
    case 8: attend_all<8>(items, group, s); break;
    case 16: attend_all<16>(items, group, s); break;
    // 128 floats in 4-float vectors (NEON on ARM, where torch reports no x86 capability).
    case 32: attend_all<32>(items, group, s); break;
    default: TORCH_CHECK(false, "head_dim ", head_dim, " is not 1, 2, 4, 8, 16 or 32 vectors");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(vericache_cpu, m) {
  m.def("attention(Tensor queries, Tensor[] keys, Tensor[] values, int[] num_new, float scale) -> Tensor",
        &attention);
}
