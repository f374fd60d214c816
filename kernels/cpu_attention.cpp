// Causal attention on CPU for a batch of sequences, each over its own KV cache (no copy into a
// padded batch): the new tokens of sequence b are the last num_new[b] slots of its cache, which
// may follow a prefix shared read-only with other sequences. Loaded by
// vericache/kernels/cpu_attention.py, which compiles it with CPU_CAPABILITY set to the vector width
// torch uses on this machine (kernels/README.md).
//
// Every query row is computed on its own, in a fixed order over the slots it sees: its result
// depends on its query and those slots alone, never on how many other rows, tokens or sequences
// share the call. So a token verified among 31 gets the bits it gets decoded alone, which is what
// makes VeriCache's output identical to full decoding (vericache/model/kernels.py).
//
// A row runs an online softmax over chunks of kSlotChunk slots aligned to its first slot: per
// chunk, the chunk's maximum, its weights relative to the running maximum, and the running sum and
// weighted value sum rescaled to it. Over [shared prefix | own slots] the chunks stay where they
// lie in one buffer: the prefix's whole chunks first, then chunks of the sequence's own item, whose
// first slots are the prefix's last, partial chunk (its "lead", read in place from the prefix), so
// the chunk that straddles the two is folded as one. A row then takes the very steps it takes over
// one buffer: sharing a prefix, of any length, changes no bit.
//
// One work item is one (segment, KV head, block of new tokens): the block's query rows (its tokens
// times the GQA group) share each key and value read, so a one-token step reads each cached byte
// once. A shared prefix is one segment for every sequence of the call that uses it: its keys and
// values are read once per block of those sequences' tokens (cascade attention), not once per
// sequence. Library attention on CPU reads a KV head once per query head.
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
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
// Slots per softmax chunk (stays in L1 while every row seeing it folds it in); a shared prefix is
// a whole number of them.
constexpr int64_t kSlotChunk = 128;
constexpr int64_t kTokenBlock = 8;     // new tokens per item: keeps both cores busy on one verify
constexpr int64_t kPrefixBlock = 128;  // tokens per item over a shared prefix: one read serves all

struct HeadView {
  const void* keys = nullptr;  // slot t at keys + t * key_stride elements: D contiguous ones
  const void* values = nullptr;
  int64_t key_stride = 0;
  int64_t value_stride = 0;
  at::ScalarType type = at::kFloat;  // of keys and values: float, bfloat16 or half
};

// Per query row of the call (row = token * Hq + query head): the online softmax's running maximum
// and sum, and its weighted value sum, which is the output buffer ([N, Hq, D]) until the end.
struct RowState {
  const float* queries;  // [N, Hq, D]
  float* max;            // [N * Hq]
  float* sum;            // [N * Hq]
  float* acc;            // [N, Hq, D]
  int64_t num_heads;
};

// One work item: `count` tokens (their indices in the call's queries at tokens[0 .. count-1])
// against one KV head of one segment of slots. Causal (a sequence's own slots): token j sees slots
// [0, seen_before + j + 1). Not causal (a shared prefix's whole chunks): every token sees all
// num_slots. A causal segment's first lead_slots slots are in `lead` (a shared prefix's partial
// last chunk), the rest in `head`.
struct WorkItem {
  HeadView head;
  HeadView lead;
  int64_t lead_slots;
  int64_t kv_head;
  const int64_t* tokens;
  int64_t count;
  int64_t num_slots;
  int64_t seen_before;
  bool causal;

  // Slot t's keys and values (D contiguous elements each).
  template <typename T>
  const T* key(int64_t t) const {
    if (t < lead_slots) return static_cast<const T*>(lead.keys) + t * lead.key_stride;
    return static_cast<const T*>(head.keys) + (t - lead_slots) * head.key_stride;
  }
  template <typename T>
  const T* value(int64_t t) const {
    if (t < lead_slots) return static_cast<const T*>(lead.values) + t * lead.value_stride;
    return static_cast<const T*>(head.values) + (t - lead_slots) * head.value_stride;
  }
  // Elements between slot t's keys and slot t + 1's, where both lie in one buffer.
  int64_t key_stride(int64_t t) const { return t < lead_slots ? lead.key_stride : head.key_stride; }

  int64_t num_seen(int64_t j) const { return causal ? seen_before + j + 1 : num_slots; }
  // The first token that sees slot t.
  int64_t first_seeing(int64_t t) const {
    return causal ? std::max<int64_t>(0, t - seen_before) : 0;
  }
};

// Where the item's row r lives among the call's rows: token r / G, group member r % G.
inline int64_t call_row(const WorkItem& item, const RowState& state, int64_t group, int64_t r) {
  return item.tokens[r / group] * state.num_heads + item.kv_head * group + r % group;
}

// Slots per transposed key tile: two vectors, so that each broadcast query element feeds two
// multiply-adds.
constexpr int64_t kTileVecs = 2;
constexpr int64_t kTile = kTileVecs * Vec::size();
static_assert(kSlotChunk % kTile == 0, "a chunk is whole tiles");

// Rows row0 .. row0 + kRows - 1 against one key tile transposed to [D, kTile]: the tile's scores,
// each the sum over d = 0 .. D-1 in order of q[d] * key[d], one multiply-add at a time (the same
// arithmetic for every row and slot, whatever the block).
template <int kVecs, int kRows>
void score_tile(const float* const* rows, const float* tile, float scale, float* scores) {
  constexpr int64_t kDim = kVecs * Vec::size();
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
      (acc[b][v] * Vec(scale)).store(scores + b * kSlotChunk + v * Vec::size());
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

// `width` 16-bit key slots (slot stride `key_stride` elements) into tile [D, kTile], as float32.
// Out of line: inlined into score_chunk, its buffer changed the code of the float32 path too, which
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

// `width` key slots from t0 that straddle the lead and the sequence's own slots, gathered into one
// buffer and transposed into tile [D, kTile] as a run of one buffer would be: the same tile, bit
// for bit. Out of line, so that the common path's code stays as it was (see transpose_widened).
template <int kVecs, typename T>
[[gnu::noinline]] void transpose_straddling(const WorkItem& item, int64_t t0, int width,
                                            float* tile) {
  constexpr int64_t kDim = kVecs * Vec::size();
  alignas(64) T rows[kTile * kDim];
  for (int s = 0; s < width; ++s) std::copy_n(item.key<T>(t0 + s), kDim, rows + s * kDim);
  if constexpr (std::is_same_v<T, float>) {
    at::vec::transpose_mxn<float>(rows, kDim, tile, kTile, width, kDim);
  } else {
    transpose_widened<kVecs>(rows, kDim, width, tile);
  }
}

// scores[r * kSlotChunk + t - first] = (q_r . key_t) * scale for slots first .. last-1 and every
// row from first_row on (the rows that see slot `first`; a row seeing fewer slots gets scores past
// its last, never read). The keys go kTile slots at a time into a tile transposed to [D, kTile]:
// a vector then holds one dimension of Vec::size() slots, and a row's scores take D multiply-adds
// per vector, with no horizontal sums. 16-bit keys are widened to float32 (exactly) on the way.
template <int kVecs, typename T>
void score_chunk(const WorkItem& item, const float* const* queries, int64_t num_rows,
                 int64_t group, int64_t first, int64_t last, float scale, float* scores) {
  constexpr int64_t kDim = kVecs * Vec::size();
  float tile[kDim * kTile] = {};
  for (int64_t t0 = first; t0 < last; t0 += kTile) {
    const int width = static_cast<int>(std::min(kTile, last - t0));
    if (t0 < item.lead_slots && t0 + width > item.lead_slots) {
      transpose_straddling<kVecs, T>(item, t0, width, tile);
    } else if constexpr (std::is_same_v<T, float>) {
      at::vec::transpose_mxn<float>(item.key<T>(t0), item.key_stride(t0), tile, kTile, width,
                                    kDim);
    } else {
      transpose_widened<kVecs>(item.key<T>(t0), item.key_stride(t0), width, tile);
    }
    for_row_blocks<4>(item.first_seeing(t0) * group, num_rows, [&]<int kRows>(int64_t r) {
      score_tile<kVecs, kRows>(queries + r, tile, scale, scores + r * kSlotChunk + (t0 - first));
    });
  }
}

// One chunk of a row's online softmax, its `width` scores in place -> weights exp(score - new
// maximum); updates the row's maximum and sum and returns the factor its weighted value sum takes
// (exactly 1 where the maximum did not move, exactly 0 before its first chunk).
float fold_scores(float* scores, int64_t width, float* max, float* sum) {
  const float chunk_max = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, scores, width);
  const float peak = std::max(*max, chunk_max);
  at::vec::map([peak](Vec x) { return (x - Vec(peak)).exp_u20(); }, scores, scores, width);
  const float chunk_sum =
      at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, scores, width);
  const float rescale = std::exp(*max - peak);
  *max = peak;
  *sum = *sum * rescale + chunk_sum;
  return rescale;
}

// Rows row0 .. row0 + kRows - 1 rescale their weighted value sums and fold in slots first ..
// last-1, slot by slot in order: each value vector read once for the block.
template <int kVecs, int kRows, typename T>
void weigh_chunk(const WorkItem& item, float* const* acc, const float* weights,
                 const float* rescale, int64_t row0, int64_t first, int64_t last) {
  Vec sums[kRows][kVecs];  // in registers while it folds the chunk
  for (int b = 0; b < kRows; ++b) {
    const Vec factor(rescale[row0 + b]);
    for (int j = 0; j < kVecs; ++j) sums[b][j] = Vec::loadu(acc[row0 + b] + j * Vec::size()) * factor;
  }
  for (int64_t t = first; t < last; ++t) {
    const T* value = item.value<T>(t);
    Vec value_vecs[kVecs];
    for (int j = 0; j < kVecs; ++j) value_vecs[j] = load_floats(value + j * Vec::size());
    for (int b = 0; b < kRows; ++b) {
      const Vec weight(weights[(row0 + b) * kSlotChunk + t - first]);
      for (int j = 0; j < kVecs; ++j) sums[b][j] = at::vec::fmadd(weight, value_vecs[j], sums[b][j]);
    }
  }
  for (int b = 0; b < kRows; ++b) {
    for (int j = 0; j < kVecs; ++j) sums[b][j].store(acc[row0 + b] + j * Vec::size());
  }
}

// Per-thread buffers of an item: its rows' indices among the call's rows, their query and
// accumulator pointers, the chunk's scores, and each row's rescale factor for the chunk.
struct Scratch {
  std::vector<int64_t> rows;
  std::vector<const float*> queries;
  std::vector<float*> acc;
  std::vector<float> scores;
  std::vector<float> rescale;
};

template <int kVecs, typename T>
void attend_typed(const WorkItem& item, int64_t group, float scale, const RowState& state,
                  Scratch& scratch) {
  constexpr int64_t kDim = kVecs * Vec::size();
  constexpr int kMaxRows = kVecs >= 8 ? 2 : 4;  // accumulators that fit the vector registers
  const int64_t num_rows = item.count * group;
  scratch.rows.resize(num_rows);
  scratch.queries.resize(num_rows);
  scratch.acc.resize(num_rows);
  scratch.scores.resize(num_rows * kSlotChunk);
  scratch.rescale.resize(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t row = call_row(item, state, group, r);
    scratch.rows[r] = row;
    scratch.queries[r] = state.queries + row * kDim;
    scratch.acc[r] = state.acc + row * kDim;
  }
  float* scores = scratch.scores.data();
  const int64_t end = item.num_seen(item.count - 1);
  for (int64_t first = 0; first < end; first += kSlotChunk) {
    const int64_t last = std::min(first + kSlotChunk, end);
    const int64_t first_row = item.first_seeing(first) * group;
    score_chunk<kVecs, T>(item, scratch.queries.data(), num_rows, group, first, last, scale, scores);
    for (int64_t r = first_row; r < num_rows; ++r) {
      const int64_t row = scratch.rows[r];
      const int64_t width = std::min(last, item.num_seen(r / group)) - first;
      scratch.rescale[r] =
          fold_scores(scores + r * kSlotChunk, width, state.max + row, state.sum + row);
    }
    // Tokens from `whole` on see the whole chunk: their rows go in blocks. The tokens before
    // them that see part of it go row group by row group.
    const int64_t whole = item.first_seeing(last - 1);
    for (int64_t j = item.first_seeing(first); j < whole; ++j) {
      for_row_blocks<kMaxRows>(j * group, (j + 1) * group, [&]<int kRows>(int64_t r) {
        weigh_chunk<kVecs, kRows, T>(item, scratch.acc.data(), scores, scratch.rescale.data(), r,
                                     first, item.num_seen(j));
      });
    }
    for_row_blocks<kMaxRows>(whole * group, num_rows, [&]<int kRows>(int64_t r) {
      weigh_chunk<kVecs, kRows, T>(item, scratch.acc.data(), scores, scratch.rescale.data(), r,
                                   first, last);
    });
  }
}

template <int kVecs>
void attend_item(const WorkItem& item, int64_t group, float scale, const RowState& state,
                 Scratch& scratch) {
  switch (item.head.type) {
    case at::kBFloat16: attend_typed<kVecs, at::BFloat16>(item, group, scale, state, scratch); break;
    case at::kHalf: attend_typed<kVecs, at::Half>(item, group, scale, state, scratch); break;
    default: attend_typed<kVecs, float>(item, group, scale, state, scratch); break;
  }
}

// Items differ in cost a hundredfold when a draft step shares the call with a verification (a
// block of 8 verified tokens over 7k slots, one draft token over 1.7k): split into two equal
// halves of the list, one thread would get every verification block while the other waited. So
// the threads take items one at a time, in list order, which keeps a head's blocks together as
// the static split did (sorting by cost scattered them, and a lock-step batch of verifications
// ran 10-15% slower). Which thread computes an item changes none of its bits: no two items of
// one list touch the same row.
template <int kVecs>
void attend_all(const std::vector<WorkItem>& items, int64_t group, float scale,
                const RowState& state) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
  if (num_workers == 0) return;
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next++; i < num_items; i = next++) {
      attend_item<kVecs>(items[i], group, scale, state, scratch);
    }
  });
}

// out = acc / sum, row by row.
void normalize(const RowState& state, int64_t num_rows, int64_t head_dim) {
  at::parallel_for(0, num_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const Vec inverse(1.f / state.sum[row]);
      float* out = state.acc + row * head_dim;
      for (int64_t d = 0; d < head_dim; d += Vec::size()) (Vec::loadu(out + d) * inverse).store(out + d);
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

// KV head h of a [T, Hkv, D] pair of layers, from slot `first_slot` on.
HeadView head_view(const at::Tensor& keys, const at::Tensor& values, int64_t h,
                   int64_t first_slot = 0) {
  auto start = [h, first_slot](const at::Tensor& t) {
    const int64_t offset = h * t.stride(1) + first_slot * t.stride(0);
    return static_cast<const char*>(t.data_ptr()) + offset * t.element_size();
  };
  return {start(keys), start(values), keys.stride(0), values.stride(0), keys.scalar_type()};
}

// Slots a segment reads in place from a shared prefix before its own: the prefix's last, partial
// chunk, from slot `first` on (none where `keys` is null).
struct Lead {
  const at::Tensor* keys = nullptr;
  const at::Tensor* values = nullptr;
  int64_t first = 0;
  int64_t num_slots = 0;
};

// Items of one segment for the given tokens, per KV head in blocks of `block` tokens; `lead`'s
// slots come first in the segment, then those of keys and values.
void add_items(std::vector<WorkItem>& items, const at::Tensor& keys, const at::Tensor& values,
               const Lead& lead, const int64_t* tokens, int64_t count, int64_t block,
               int64_t seen_before, bool causal) {
  for (int64_t h = 0; h < keys.size(1); ++h) {
    const HeadView head = head_view(keys, values, h);
    const HeadView lead_head =
        lead.num_slots ? head_view(*lead.keys, *lead.values, h, lead.first) : HeadView{};
    for (int64_t first = 0; first < count; first += block) {
      items.push_back({head, lead_head, lead.num_slots, h, tokens + first,
                       std::min(block, count - first), lead.num_slots + keys.size(0),
                       seen_before + first, causal});
    }
  }
}

template <int kVecs>
void attend_passes(const std::vector<WorkItem>& prefix_items, const std::vector<WorkItem>& items,
                   int64_t group, float scale, const RowState& state) {
  attend_all<kVecs>(prefix_items, group, scale, state);  // then each row carries on in its own
  attend_all<kVecs>(items, group, scale, state);
}

// A shared prefix's keys and values ([P, Hkv, D], any P) checked, and the slots of its last,
// partial chunk that each of its sequences reads first in its own item.
Lead prefix_lead(const at::Tensor& keys, const at::Tensor& values, int64_t num_kv_heads,
                 int64_t head_dim) {
  check_layer(keys, num_kv_heads, head_dim, "prefix keys");
  check_layer(values, num_kv_heads, head_dim, "prefix values");
  const int64_t num_slots = keys.size(0);
  TORCH_CHECK(values.size(0) == num_slots, "a prefix's keys and values need the same slots");
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), "a prefix's keys and values need one dtype");
  const int64_t whole = num_slots / kSlotChunk * kSlotChunk;
  return {&keys, &values, whole, num_slots - whole};
}

// queries: [N, Hq, D], the new tokens of every sequence in order; keys[b], values[b]: [T_b, Hkv, D]
// (any slot and head strides; float32, bfloat16 or float16 per sequence), whose last num_new[b]
// slots are sequence b's new tokens; prefix_of[b]: -1, or the index in prefix_keys and
// prefix_values ([P, Hkv, D], any P, the sequence's dtype) of the shared prefix that precedes
// sequence b's slots, seen whole by each of its tokens.
// -> [N, Hq, D]
at::Tensor attention(const at::Tensor& queries, at::TensorList keys, at::TensorList values,
                     at::IntArrayRef num_new, at::TensorList prefix_keys,
                     at::TensorList prefix_values, at::IntArrayRef prefix_of, double scale) {
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == at::kFloat && queries.device().is_cpu(),
              "queries must be CPU float32 [N, Hq, D]");
  const int64_t num_heads = queries.size(1), head_dim = queries.size(2);
  const int64_t batch = static_cast<int64_t>(keys.size());
  const int64_t num_prefixes = static_cast<int64_t>(prefix_keys.size());
  TORCH_CHECK(batch > 0 && static_cast<int64_t>(values.size()) == batch &&
                  static_cast<int64_t>(num_new.size()) == batch &&
                  static_cast<int64_t>(prefix_of.size()) == batch,
              "one keys tensor, one values tensor, one num_new and one prefix_of per sequence");
  TORCH_CHECK(static_cast<int64_t>(prefix_values.size()) == num_prefixes,
              "one values tensor per prefix");
  const int64_t num_kv_heads = keys[0].size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(head_dim % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  const int64_t group = num_heads / num_kv_heads;
  const at::Tensor q = queries.contiguous();
  const int64_t num_tokens = q.size(0);
  std::vector<int64_t> token_index(num_tokens);
  std::iota(token_index.begin(), token_index.end(), 0);
  std::vector<Lead> leads;
  for (int64_t p = 0; p < num_prefixes; ++p) {
    leads.push_back(prefix_lead(prefix_keys[p], prefix_values[p], num_kv_heads, head_dim));
  }
  std::vector<std::vector<int64_t>> prefix_tokens(num_prefixes);
  std::vector<WorkItem> items;
  int64_t offset = 0;  // the sequence's first query token
  for (int64_t b = 0; b < batch; ++b) {
    check_layer(keys[b], num_kv_heads, head_dim, "keys");
    check_layer(values[b], num_kv_heads, head_dim, "values");
    const int64_t num_slots = keys[b].size(0), count = num_new[b];
    TORCH_CHECK(values[b].size(0) == num_slots, "keys and values need the same number of slots");
    TORCH_CHECK(values[b].scalar_type() == keys[b].scalar_type(), "keys and values need one dtype");
    TORCH_CHECK(count >= 1 && count <= num_slots, "num_new[", b, "] must lie in [1, ", num_slots, "]");
    TORCH_CHECK(offset + count <= num_tokens, "num_new adds up to more tokens than queries holds");
    TORCH_CHECK(prefix_of[b] >= -1 && prefix_of[b] < num_prefixes, "prefix_of[", b, "] is no prefix");
    Lead lead;
    if (prefix_of[b] >= 0) {
      lead = leads[prefix_of[b]];
      TORCH_CHECK(lead.keys->scalar_type() == keys[b].scalar_type(),
                  "a sequence and its prefix need one dtype");
      auto& tokens = prefix_tokens[prefix_of[b]];
      for (int64_t m = 0; m < count; ++m) tokens.push_back(offset + m);
    }
    add_items(items, keys[b], values[b], lead, token_index.data() + offset, count, kTokenBlock,
              lead.num_slots + num_slots - count, true);
    offset += count;
  }
  TORCH_CHECK(offset == num_tokens, "num_new must add up to the number of query tokens");
  std::vector<WorkItem> prefix_items;  // the prefixes' whole chunks, once for all their tokens
  for (int64_t p = 0; p < num_prefixes; ++p) {
    const auto& tokens = prefix_tokens[p];
    if (leads[p].first == 0 || tokens.empty()) continue;
    add_items(prefix_items, prefix_keys[p].narrow(0, 0, leads[p].first),
              prefix_values[p].narrow(0, 0, leads[p].first), Lead{}, tokens.data(),
              static_cast<int64_t>(tokens.size()), kPrefixBlock, leads[p].first, false);
  }
  const int64_t num_rows = num_tokens * num_heads;
  at::Tensor out = at::zeros_like(q);
  at::Tensor max = at::full({num_rows}, -std::numeric_limits<float>::infinity(), q.options());
  at::Tensor sum = at::zeros({num_rows}, q.options());
  const RowState state{q.data_ptr<float>(), max.data_ptr<float>(), sum.data_ptr<float>(),
                       out.data_ptr<float>(), num_heads};
  const float s = static_cast<float>(scale);
  switch (head_dim / Vec::size()) {
    case 1: attend_passes<1>(prefix_items, items, group, s, state); break;
    case 2: attend_passes<2>(prefix_items, items, group, s, state); break;
    case 4: attend_passes<4>(prefix_items, items, group, s, state); break;
    case 8: attend_passes<8>(prefix_items, items, group, s, state); break;
    case 16: attend_passes<16>(prefix_items, items, group, s, state); break;
    // 128 floats in 4-float vectors (NEON on ARM, where torch reports no x86 capability).
    case 32: attend_passes<32>(prefix_items, items, group, s, state); break;
    default: TORCH_CHECK(false, "head_dim ", head_dim, " is not 1, 2, 4, 8, 16 or 32 vectors");
  }
  normalize(state, num_rows, head_dim);
  return out;
}

}  // namespace

TORCH_LIBRARY(vericache_cpu, m) {
  m.def("attention(Tensor queries, Tensor[] keys, Tensor[] values, int[] num_new, "
        "Tensor[] prefix_keys, Tensor[] prefix_values, int[] prefix_of, float scale) -> Tensor",
        &attention);
}
