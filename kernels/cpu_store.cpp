// Stores the new tokens' keys, values and positions of every sequence of a forward into its own
// head-major cache buffers, in one call per layer (as vLLM's reshape_and_cache does for its paged
// cache): a few library ops per sequence and layer cost more than the copy itself when a forward
// steps a dozen caches by one token. Built into the extension of cpu_attention.cpp.
//
// Float32 rows go into float32 buffers as they are, and into bfloat16 or float16 buffers rounded to
// nearest even, as a tensor copy rounds them: a cache holds the same bits whichever way it filled.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <type_traits>

namespace {

// Rows rows .. rows + count - 1 of new_keys [N, Hkv, D] (float32, D contiguous) into slots
// start .. start + count - 1 of buffer [Hkv, capacity, D].
template <typename T>
void store_rows(const at::Tensor& rows, int64_t first_row, int64_t count, const at::Tensor& buffer,
                int64_t start) {
  const int64_t num_kv_heads = rows.size(1), head_dim = rows.size(2);
  const float* source = rows.data_ptr<float>();
  T* target = static_cast<T*>(buffer.data_ptr());
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    for (int64_t i = 0; i < count; ++i) {
      const float* row = source + (first_row + i) * rows.stride(0) + h * rows.stride(1);
      T* slot = target + h * buffer.stride(0) + (start + i) * buffer.stride(1);
      if constexpr (std::is_same_v<T, float>) {
        std::copy_n(row, head_dim, slot);
      } else {
        for (int64_t d = 0; d < head_dim; ++d) slot[d] = static_cast<T>(row[d]);
      }
    }
  }
}

void check_buffer(const at::Tensor& buffer, const at::Tensor& rows, const char* name) {
  const auto type = buffer.scalar_type();
  const bool is_served = type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
  TORCH_CHECK(buffer.device().is_cpu() && is_served, name, " must be CPU float32, bfloat16 or float16");
  TORCH_CHECK(buffer.dim() == 3 && buffer.size(0) == rows.size(1) && buffer.size(2) == rows.size(2),
              name, " must be [Hkv, capacity, D]");
  TORCH_CHECK(buffer.stride(2) == 1, name, " must have contiguous head rows");
}

void store_into(const at::Tensor& rows, int64_t first_row, int64_t count, const at::Tensor& buffer,
                int64_t start) {
  switch (buffer.scalar_type()) {
    case at::kBFloat16: store_rows<at::BFloat16>(rows, first_row, count, buffer, start); break;
    case at::kHalf: store_rows<at::Half>(rows, first_row, count, buffer, start); break;
    default: store_rows<float>(rows, first_row, count, buffer, start); break;
  }
}

void check_rows(const at::Tensor& rows, const char* name) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 3 &&
                  rows.stride(2) == 1,
              name, " must be CPU float32 [N, Hkv, D] with contiguous head rows");
}

// new_keys, new_values: [N, Hkv, D] float32; new_positions: [N] int64. For store b: rows
// first_row[b] .. first_row[b] + num_new[b] - 1 go to slots start[b] .. of key_buffers[b],
// value_buffers[b] ([Hkv, capacity, D]) and position_buffers[b] ([capacity, Hkv] int32, the
// token's position for every head).
void store_kv(const at::Tensor& new_keys, const at::Tensor& new_values,
              const at::Tensor& new_positions, at::TensorList key_buffers,
              at::TensorList value_buffers, at::TensorList position_buffers,
              at::IntArrayRef first_row, at::IntArrayRef start, at::IntArrayRef num_new) {
  check_rows(new_keys, "new_keys");
  check_rows(new_values, "new_values");
  TORCH_CHECK(new_values.sizes() == new_keys.sizes(), "new_keys and new_values differ in shape");
  TORCH_CHECK(new_positions.device().is_cpu() && new_positions.scalar_type() == at::kLong &&
                  new_positions.dim() == 1 && new_positions.size(0) == new_keys.size(0),
              "new_positions must be CPU int64 [N]");
  const size_t num_stores = key_buffers.size();
  TORCH_CHECK(value_buffers.size() == num_stores && position_buffers.size() == num_stores &&
                  first_row.size() == num_stores && start.size() == num_stores &&
                  num_new.size() == num_stores,
              "one key, value and position buffer, first row, start and num_new per store");
  const at::Tensor positions = new_positions.contiguous();
  const int64_t num_kv_heads = new_keys.size(1);
  for (size_t b = 0; b < num_stores; ++b) {
    const at::Tensor& keys = key_buffers[b];
    const at::Tensor& slots = position_buffers[b];
    check_buffer(keys, new_keys, "key_buffers");
    check_buffer(value_buffers[b], new_keys, "value_buffers");
    TORCH_CHECK(value_buffers[b].size(1) == keys.size(1), "key and value buffers differ in capacity");
    TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kInt && slots.dim() == 2 &&
                    slots.size(0) == keys.size(1) && slots.size(1) == num_kv_heads,
                "position_buffers must be CPU int32 [capacity, Hkv]");
    TORCH_CHECK(num_new[b] >= 0 && first_row[b] >= 0 && first_row[b] + num_new[b] <= new_keys.size(0),
                "store ", b, " reads rows past new_keys");
    TORCH_CHECK(start[b] >= 0 && start[b] + num_new[b] <= keys.size(1), "store ", b,
                " writes past its buffers' capacity");
    store_into(new_keys, first_row[b], num_new[b], keys, start[b]);
    store_into(new_values, first_row[b], num_new[b], value_buffers[b], start[b]);
    const int64_t* source = positions.data_ptr<int64_t>() + first_row[b];
    int32_t* target = slots.data_ptr<int32_t>();
    for (int64_t i = 0; i < num_new[b]; ++i) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        target[(start[b] + i) * slots.stride(0) + h * slots.stride(1)] =
            static_cast<int32_t>(source[i]);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vericache_cpu, m) {
  m.def("store_kv(Tensor new_keys, Tensor new_values, Tensor new_positions, Tensor(a!)[] key_buffers, "
        "Tensor(b!)[] value_buffers, Tensor(c!)[] position_buffers, int[] first_row, int[] start, "
        "int[] num_new) -> ()",
        &store_kv);
}
