// The core's params of compressor and compressor_backward from a checked call struct of any
// binding (tensors read through tensor_access.h), in two steps: sizes, options and host arrays,
// then each tensor's pointer and strides.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "compressor/compressor.h"
#include "errors.h"
#include "tensor_access.h"

namespace opmesh::common {

// Whether a call struct is the forward's (it has the state cache). C++17: the MindSpore binding
// compiles this header with its own standard.
template <class Call, class = void>
struct HasState : std::false_type {};
template <class Call>
struct HasState<Call, std::void_t<decltype(std::declval<const Call&>().state_cache)>>
    : std::true_type {};

// The call's integer arrays on the host, kept alive with the params.
struct CompressorHost {
  std::vector<int64_t> cu_seqlens, seqused, start_pos, table;
  int64_t table_columns = 0;
  bool has_cu = false, has_used = false, has_start = false, has_table = false;
};

template <class Call>
CompressorHost compressor_host(const Call& c) {
  CompressorHost h;
  h.cu_seqlens = host_values(c.cu_seqlens);
  h.seqused = host_values(c.seqused);
  h.start_pos = host_values(c.start_pos);
  h.has_cu = c.cu_seqlens.has_value();
  h.has_used = c.seqused.has_value();
  h.has_start = c.start_pos.has_value();
  if constexpr (HasState<Call>::value) {
    h.table = host_values(c.state_block_table);
    h.has_table = c.state_block_table.has_value();
    if (h.has_table) {
      using Ints = typename std::decay_t<decltype(c.state_block_table)>::value_type;
      h.table_columns = HostIntsAccess<Ints>::columns(*c.state_block_table);
    }
  }
  return h;
}

// [B, S, N] or [T, N] (packed) as a View along [batch][row][-][n].
template <class Tensor>
core::View rows_view(const Tensor& t, bool packed) {
  const std::vector<int64_t> st = TensorAccess<Tensor>::strides(t);
  if (packed) return core::View{data_of(t), 0, st[0], 0, st[1]};
  return core::View{data_of(t), st[0], st[1], 0, st[2]};
}

// Sizes, options and host arrays; `x`: the call's hidden states ([B, S, H] or [T, H]).
template <class Call>
core::CompressorParams compressor_params(const Call& c, const CompressorHost& h) {
  core::CompressorParams p;
  c.copy_scalars_to(p);
  const std::vector<int64_t> xs = sizes_of(c.x);
  p.packed = xs.size() == 2;
  p.tokens = p.packed ? xs[0] : xs[0] * xs[1];
  p.seq_len = p.packed ? 0 : xs[1];
  p.hidden = xs.back();
  p.batch = p.packed ? (h.has_cu ? static_cast<int64_t>(h.cu_seqlens.size()) - 1 : 0) : xs[0];
  p.dim = p.coff > 0 ? sizes_of(c.wkv)[0] / p.coff : 0;
  p.dtype = dtype_of(c.x, "x");
  p.ape_dtype = dtype_of(c.ape, "ape");
  p.cu_seqlens = h.has_cu ? h.cu_seqlens.data() : nullptr;
  p.seqused = h.has_used ? h.seqused.data() : nullptr;
  p.start_pos = h.has_start ? h.start_pos.data() : nullptr;
  if constexpr (HasState<Call>::value) {
    // A state cache of no blocks is none.
    const std::vector<int64_t> ss = sizes_of(c.state_cache);
    p.has_state = ss[0] > 0;
    p.num_blocks = ss[0];
    p.block_size = ss[1];
    if (!p.has_state && h.has_table) {
      throw core::ArgumentError("state_block_table",
                                "given without a state_cache (it has no "
                                "blocks)");
    }
    if (p.has_state && !h.has_table) {
      throw core::ArgumentError("state_block_table", "required with a state_cache");
    }
    p.block_table = h.has_table ? h.table.data() : nullptr;
    p.table_width = h.has_table ? (p.cache_mode == 2 ? 1 : h.table_columns) : 0;
  }
  return p;
}

// The inputs' pointers and strides (cmp_kv: the forward's output, or the backward's gradient
// of it, as `out_like`, holding out_rows entries).
template <class Call, class Tensor>
void point_compressor(core::CompressorParams& p, const Call& c, const Tensor& cmp_kv) {
  p.x = rows_view(c.x, p.packed);
  p.wkv = rows_view(c.wkv, true);
  p.wgate = rows_view(c.wgate, true);
  p.ape = rows_view(c.ape, true);
  p.cmp_kv = core::writable(rows_view(cmp_kv, p.packed));
  p.out_rows = sizes_of(cmp_kv)[p.packed ? 0 : 1];
  if constexpr (HasState<Call>::value) {
    if (p.has_state) p.state = core::writable(rows_view(c.state_cache, false));
  }
  p.has_projections = c.projections.has_value();
  if (p.has_projections) p.projections = core::writable(rows_view(*c.projections, p.packed));
}

// compressor_backward's outputs, shaped like x, wkv, wgate and ape.
template <class Tensor>
core::CompressorGrads compressor_grads(const core::CompressorParams& p, const Tensor& dcmp,
                                       const Tensor& dx, const Tensor& dwkv, const Tensor& dwgate,
                                       const Tensor& dape) {
  core::CompressorGrads g;
  g.d_cmp_kv = rows_view(dcmp, p.packed);
  g.dx = core::writable(rows_view(dx, p.packed));
  g.dwkv = core::writable(rows_view(dwkv, true));
  g.dwgate = core::writable(rows_view(dwgate, true));
  g.dape = core::writable(rows_view(dape, true));
  return g;
}

}  // namespace opmesh::common
