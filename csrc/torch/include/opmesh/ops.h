// opmesh's operators for C++ programs on libtorch (no Python needed).
//
// Linking libopmesh_ops (CMake: find_package(opmesh), target opmesh::ops) registers the
// operators opmesh::flash_attn, opmesh::flash_attn_backward, opmesh::flash_attn_metadata,
// opmesh::kv_cache_write_, opmesh::merge_attn_states, opmesh::dense_lightning_indexer_softmax_lse
// and opmesh::dense_lightning_indexer_grad_kl_loss with the PyTorch dispatcher, so TorchScript,
// AOTInductor packages and c10::Dispatcher calls find them. The functions below are typed
// shortcuts for the two a decoder step needs; their semantics are the Python functions'
// (docs/ops/flash_attn.md). Errors are c10::ValueError / c10::Error naming the argument.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace opmesh {

// The library's version (the Python package's). Calling it also keeps a linker that drops
// unreferenced libraries (--as-needed) from dropping libopmesh_ops.
const char* library_version();

// flash_attn's keyword arguments, in the schema's order (csrc/common/op_defs.h): library.cpp
// copies them into the call field by field from that declaration, so a keyword the operator
// declares and this struct lacks (or a field the operator does not declare) fails to compile.
struct FlashAttnOptions {
  std::optional<at::Tensor> block_table;
  std::optional<at::Tensor> cu_seqlens_q;
  std::optional<at::Tensor> cu_seqlens_kv;
  std::optional<at::Tensor> seqused_q;
  std::optional<at::Tensor> seqused_kv;
  std::optional<at::Tensor> sinks;
  // Logit soft-capping (softcap * tanh(score / softcap)); 0 leaves the scores as they are.
  double softcap = 0.0;
  // ALiBi slopes, [Nq] or [B, Nq] float32.
  std::optional<at::Tensor> alibi_slopes;
  // A quantized cache's float32 row scales (k and v int8 or float8_e4m3fn), shaped as k and v
  // without their head dim.
  std::optional<at::Tensor> k_scale;
  std::optional<at::Tensor> v_scale;
  std::optional<at::Tensor> metadata;
  std::optional<double> softmax_scale;
  int64_t mask_mode = 0;
  int64_t win_left = -1;
  int64_t win_right = -1;
  std::optional<int64_t> max_seqlen_q;
  std::optional<int64_t> max_seqlen_kv;
  std::string layout_q = "BSND";
  // Empty: "PA_BBND" with a block_table, else layout_q (as in Python).
  std::string layout_kv;
  // Empty: layout_q.
  std::string layout_out;
  bool return_softmax_lse = false;
};

// (attn_out, softmax_lse) of opmesh::flash_attn, through the dispatcher (autograd included).
std::tuple<at::Tensor, at::Tensor> flash_attn(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v,
                                              const FlashAttnOptions& options = {});

// opmesh::kv_cache_write_: token t goes to slot slot_mapping[t] of both paged caches; a quantized
// (int8 / float8_e4m3fn) cache takes its row scales, written too. value and value_cache both
// nullopt: one cache of rows read as key and value (MLA's), written from key.
void kv_cache_write_(const at::Tensor& key, const std::optional<at::Tensor>& value,
                     const at::Tensor& key_cache, const std::optional<at::Tensor>& value_cache,
                     const at::Tensor& slot_mapping,
                     const std::optional<at::Tensor>& key_scale = std::nullopt,
                     const std::optional<at::Tensor>& value_scale = std::nullopt);

}  // namespace opmesh
