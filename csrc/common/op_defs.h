// Every operator's arguments, declared once. Each binding (csrc/torch, csrc/mindspore) turns these
// lists into its own call struct by naming its types for the kinds below, and reads that struct:
// the torch binding builds the schema string, the boxed CPU/Meta/Autograd kernels and the C++
// callers from it (csrc/torch/op_call.h); the MindSpore binding fills it from keyword arguments
// (csrc/mindspore/ms_call.h).
//
// An operator is a list of items, in schema order:
//   ARG(kind, name)            an argument without a default
//   ARG_D(kind, name, value)   an argument with a default (a C++ value of the kind's type)
//   KWONLY                     the arguments after it are keyword-only (the schema's `*`)
// Kinds: Tensor, OptTensor, MutTensor and OptMutTensor (written in place), Ints and OptInts
// (integer tensors the kernels read on the host: lengths, block tables, slots, plans; a binding may
// take them as host arrays), Float, OptFloat, Int, OptInt, SymInt, OptSymInt, Str, Bool.
//
// The file includes no framework: a struct is `OpCall<Types>` with `Types` giving the binding's
// C++ type for each kind (`typename Types::Tensor`, ...).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

namespace opmesh::ops {

// Unbounded window sides of the indexer family (its public default).
inline constexpr int64_t kUnboundedTokens = std::numeric_limits<int64_t>::max();

// The C++ type of each kind for a binding whose tensors are `TensorT`, whose host-read integer
// tensors are `IntsT` and whose symbolic sizes are `SymIntT`.
template <class TensorT, class IntsT, class SymIntT>
struct BindingTypes {
  using Tensor = TensorT;
  using MutTensor = TensorT;
  using OptMutTensor = std::optional<TensorT>;
  using OptTensor = std::optional<TensorT>;
  using Ints = IntsT;
  using OptInts = std::optional<IntsT>;
  using Float = double;
  using OptFloat = std::optional<double>;
  using Int = int64_t;
  using OptInt = std::optional<int64_t>;
  using SymInt = SymIntT;
  using OptSymInt = std::optional<SymIntT>;
  using Str = std::string;
  using Bool = bool;
};

// Sets the field `field` picks of p to `value` when p has that field and the value is a number
// or a bool (an option the core takes as it is): see copy_scalars_to below.
template <class Params, class FieldOf, class Value>
void copy_if_field(Params& p, FieldOf field, const Value& value) {
  if constexpr (std::is_arithmetic_v<Value> && std::is_invocable_v<FieldOf, Params&>) {
    auto& dst = field(p);
    dst = static_cast<std::decay_t<decltype(dst)>>(value);
  }
}

// One argument as a binding sees it while visiting a call struct.
struct Field {
  const char* name;
  const char* kind;  // the kind's name: "Tensor", "OptTensor", ...
  bool has_default;
  bool kw_only;
};

}  // namespace opmesh::ops

// The arguments flash_attn and flash_attn_backward share after their tensors.
#define OPMESH_ATTN_LENGTHS(ARG, ARG_D)       \
  ARG_D(OptInts, cu_seqlens_q, std::nullopt)  \
  ARG_D(OptInts, cu_seqlens_kv, std::nullopt) \
  ARG_D(OptInts, seqused_q, std::nullopt)     \
  ARG_D(OptInts, seqused_kv, std::nullopt)

#define OPMESH_ATTN_OPTIONS(ARG, ARG_D)         \
  ARG_D(OptFloat, softmax_scale, std::nullopt)  \
  ARG_D(Int, mask_mode, 0)                      \
  ARG_D(Int, win_left, -1)                      \
  ARG_D(Int, win_right, -1)                     \
  ARG_D(OptSymInt, max_seqlen_q, std::nullopt)  \
  ARG_D(OptSymInt, max_seqlen_kv, std::nullopt) \
  ARG_D(Str, layout_q, "BSND")                  \
  ARG_D(Str, layout_kv, "BSND")                 \
  ARG_D(Str, layout_out, "BSND")

// flash-attn's score modifications: logit soft-capping and ALiBi slopes ([Nq] or [B, Nq]).
#define OPMESH_ATTN_SCORE_MODS(ARG, ARG_D) \
  ARG_D(Float, softcap, 0.0)               \
  ARG_D(OptTensor, alibi_slopes, std::nullopt)

// flash_attn(q, k, v, *, ...) -> (attn_out, softmax_lse); k_scale and v_scale: the row scales of
// a quantized (int8 / float8_e4m3fn) k and v.
#define OPMESH_OP_FLASH_ATTN(ARG, ARG_D, KWONLY) \
  ARG(Tensor, q)                                 \
  ARG(Tensor, k)                                 \
  ARG(Tensor, v)                                 \
  KWONLY                                         \
  ARG_D(OptInts, block_table, std::nullopt)      \
  OPMESH_ATTN_LENGTHS(ARG, ARG_D)                \
  ARG_D(OptTensor, sinks, std::nullopt)          \
  OPMESH_ATTN_SCORE_MODS(ARG, ARG_D)             \
  ARG_D(OptTensor, k_scale, std::nullopt)        \
  ARG_D(OptTensor, v_scale, std::nullopt)        \
  ARG_D(OptInts, metadata, std::nullopt)         \
  OPMESH_ATTN_OPTIONS(ARG, ARG_D)                \
  ARG_D(Bool, return_softmax_lse, false)
#define OPMESH_OP_FLASH_ATTN_RETURNS "(Tensor attn_out, Tensor softmax_lse)"

// flash_attn_backward(dout, q, k, v, out, lse, *, ...) -> (dq, dk, dv, dsinks): flash_attn's
// gradients, an operator of its own so compiled graphs hold it as an ordinary node.
#define OPMESH_OP_FLASH_ATTN_BACKWARD(ARG, ARG_D, KWONLY) \
  ARG(Tensor, dout)                                       \
  ARG(Tensor, q)                                          \
  ARG(Tensor, k)                                          \
  ARG(Tensor, v)                                          \
  ARG(Tensor, out)                                        \
  ARG(Tensor, lse)                                        \
  KWONLY                                                  \
  ARG_D(OptTensor, dlse, std::nullopt)                    \
  OPMESH_ATTN_LENGTHS(ARG, ARG_D)                         \
  ARG_D(OptTensor, sinks, std::nullopt)                   \
  OPMESH_ATTN_SCORE_MODS(ARG, ARG_D)                      \
  OPMESH_ATTN_OPTIONS(ARG, ARG_D)                         \
  ARG_D(OptInts, metadata, std::nullopt)
#define OPMESH_OP_FLASH_ATTN_BACKWARD_RETURNS "(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)"

// flash_attn_metadata(num_heads_q, num_heads_kv, head_dim, *, ...) -> plan words
#define OPMESH_OP_FLASH_ATTN_METADATA(ARG, ARG_D, KWONLY) \
  ARG(Int, num_heads_q)                                   \
  ARG(Int, num_heads_kv)                                  \
  ARG(Int, head_dim)                                      \
  KWONLY                                                  \
  ARG_D(OptInt, head_dim_v, std::nullopt)                 \
  OPMESH_ATTN_LENGTHS(ARG, ARG_D)                         \
  ARG(SymInt, batch_size)                                 \
  ARG(SymInt, max_seqlen_q)                               \
  ARG(SymInt, max_seqlen_kv)                              \
  ARG_D(Int, mask_mode, 0)                                \
  ARG_D(Int, win_left, -1)                                \
  ARG_D(Int, win_right, -1)                               \
  ARG_D(Str, layout_q, "BSND")                            \
  ARG_D(Str, layout_kv, "BSND")                           \
  ARG_D(Str, layout_out, "BSND")                          \
  ARG_D(OptInt, num_workers, std::nullopt)                \
  ARG_D(Bool, deterministic, false)                       \
  ARG_D(Bool, backward, false)
#define OPMESH_OP_FLASH_ATTN_METADATA_RETURNS "Tensor"

// The indexer family's compressed keys (DeepSeek-V4): each key entry stands for cmp_ratio
// original tokens, cmp_residual_key the original tokens past each sequence's last whole entry.
#define OPMESH_COMPRESSED_KEYS(ARG, ARG_D) \
  ARG_D(Int, cmp_ratio, 1)                 \
  ARG_D(OptInts, cmp_residual_key, std::nullopt)

// The indexer family's mask and lengths (the Ascend convention: cumulative ends without a
// leading 0, sparse_mode, pre_tokens/next_tokens) and compressed keys.
#define OPMESH_INDEXER_OPTIONS(ARG, ARG_D)                 \
  ARG_D(OptInts, actual_seq_qlen, std::nullopt)            \
  ARG_D(OptInts, actual_seq_klen, std::nullopt)            \
  ARG_D(Str, layout, "BSND")                               \
  ARG_D(Int, sparse_mode, 3)                               \
  ARG_D(Int, pre_tokens, ::opmesh::ops::kUnboundedTokens)  \
  ARG_D(Int, next_tokens, ::opmesh::ops::kUnboundedTokens) \
  OPMESH_COMPRESSED_KEYS(ARG, ARG_D)

// dense_lightning_indexer_softmax_lse(query_index, key_index, weights, *, ...)
#define OPMESH_OP_INDEXER(ARG, ARG_D, KWONLY) \
  ARG(Tensor, query_index)                    \
  ARG(Tensor, key_index)                      \
  ARG(Tensor, weights)                        \
  KWONLY                                      \
  OPMESH_INDEXER_OPTIONS(ARG, ARG_D)
#define OPMESH_OP_INDEXER_RETURNS "(Tensor softmax_max, Tensor softmax_sum)"

// dense_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights, softmax_max,
// softmax_sum, softmax_max_index, softmax_sum_index, scale_value=1.0, *, ...)
#define OPMESH_OP_KL_LOSS(ARG, ARG_D, KWONLY) \
  ARG(Tensor, query)                          \
  ARG(Tensor, key)                            \
  ARG(Tensor, query_index)                    \
  ARG(Tensor, key_index)                      \
  ARG(Tensor, weights)                        \
  ARG(Tensor, softmax_max)                    \
  ARG(Tensor, softmax_sum)                    \
  ARG(Tensor, softmax_max_index)              \
  ARG(Tensor, softmax_sum_index)              \
  ARG_D(Float, scale_value, 1.0)              \
  KWONLY                                      \
  ARG_D(OptTensor, query_rope, std::nullopt)  \
  ARG_D(OptTensor, key_rope, std::nullopt)    \
  OPMESH_INDEXER_OPTIONS(ARG, ARG_D)
#define OPMESH_OP_KL_LOSS_RETURNS \
  "(Tensor d_query_index, Tensor d_key_index, Tensor d_weights, Tensor loss)"

// sparse_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights,
// sparse_indices, softmax_max, softmax_sum, scale_value, *, ...): the KL loss over each row's
// selected keys.
#define OPMESH_OP_SPARSE_KL_LOSS(ARG, ARG_D, KWONLY) \
  ARG(Tensor, query)                                 \
  ARG(Tensor, key)                                   \
  ARG(Tensor, query_index)                           \
  ARG(Tensor, key_index)                             \
  ARG(Tensor, weights)                               \
  ARG(Tensor, sparse_indices)                        \
  ARG(Tensor, softmax_max)                           \
  ARG(Tensor, softmax_sum)                           \
  ARG(Float, scale_value)                            \
  KWONLY                                             \
  ARG_D(OptTensor, query_rope, std::nullopt)         \
  ARG_D(OptTensor, key_rope, std::nullopt)           \
  OPMESH_INDEXER_OPTIONS(ARG, ARG_D)
#define OPMESH_OP_SPARSE_KL_LOSS_RETURNS OPMESH_OP_KL_LOSS_RETURNS

// lightning_indexer(query, key, weights, *, ...) -> (sparse_indices, sparse_values): the top-k
// keys of the indexer score per token and key head (Ascend's call form).
#define OPMESH_OP_LIGHTNING_INDEXER(ARG, ARG_D, KWONLY)    \
  ARG(Tensor, query)                                       \
  ARG(Tensor, key)                                         \
  ARG(Tensor, weights)                                     \
  KWONLY                                                   \
  ARG_D(OptInts, actual_seq_lengths_query, std::nullopt)   \
  ARG_D(OptInts, actual_seq_lengths_key, std::nullopt)     \
  ARG_D(OptInts, block_table, std::nullopt)                \
  ARG_D(Str, layout_query, "BSND")                         \
  ARG_D(Str, layout_key, "BSND")                           \
  ARG_D(Int, sparse_count, 2048)                           \
  ARG_D(Int, sparse_mode, 3)                               \
  ARG_D(Int, pre_tokens, ::opmesh::ops::kUnboundedTokens)  \
  ARG_D(Int, next_tokens, ::opmesh::ops::kUnboundedTokens) \
  ARG_D(Bool, return_value, false)                         \
  ARG_D(Float, scale_value, 1.0)                           \
  OPMESH_COMPRESSED_KEYS(ARG, ARG_D)
#define OPMESH_OP_LIGHTNING_INDEXER_RETURNS "(Tensor sparse_indices, Tensor sparse_values)"

// The arguments sparse_flash_attention and its backward share after their tensors.
#define OPMESH_SPARSE_ATTN_OPTIONS(ARG, ARG_D)             \
  ARG_D(OptInts, block_table, std::nullopt)                \
  ARG_D(OptInts, actual_seq_lengths_query, std::nullopt)   \
  ARG_D(OptInts, actual_seq_lengths_kv, std::nullopt)      \
  ARG_D(OptTensor, query_rope, std::nullopt)               \
  ARG_D(OptTensor, key_rope, std::nullopt)                 \
  ARG_D(Int, sparse_block_size, 1)                         \
  ARG_D(Str, layout_query, "BSND")                         \
  ARG_D(Str, layout_kv, "BSND")                            \
  ARG_D(Int, sparse_mode, 3)                               \
  ARG_D(Int, pre_tokens, ::opmesh::ops::kUnboundedTokens)  \
  ARG_D(Int, next_tokens, ::opmesh::ops::kUnboundedTokens) \
  ARG_D(Int, attention_mode, 0)                            \
  ARG_D(Float, softcap, 0.0)

// sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, ...)
//   -> (attention_out, softmax_max, softmax_sum); key_scale and value_scale: the row scales of a
//   quantized (int8 / float8_e4m3fn) key and value.
#define OPMESH_OP_SPARSE_FLASH_ATTENTION(ARG, ARG_D, KWONLY) \
  ARG(Tensor, query)                                         \
  ARG(Tensor, key)                                           \
  ARG(Tensor, value)                                         \
  ARG(Tensor, sparse_indices)                                \
  ARG(Float, scale_value)                                    \
  KWONLY                                                     \
  OPMESH_SPARSE_ATTN_OPTIONS(ARG, ARG_D)                     \
  ARG_D(Bool, return_softmax_lse, false)                     \
  ARG_D(OptTensor, sinks, std::nullopt)                      \
  ARG_D(OptTensor, key_scale, std::nullopt)                  \
  ARG_D(OptTensor, value_scale, std::nullopt)
#define OPMESH_OP_SPARSE_FLASH_ATTENTION_RETURNS \
  "(Tensor attention_out, Tensor softmax_max, Tensor softmax_sum)"

// sparse_flash_attention_backward(dout, query, key, value, sparse_indices, attention_out,
// softmax_max, softmax_sum, scale_value, *, ...) -> the gradients, an operator of its own.
#define OPMESH_OP_SPARSE_FLASH_ATTENTION_BACKWARD(ARG, ARG_D, KWONLY) \
  ARG(Tensor, dout)                                                   \
  ARG(Tensor, query)                                                  \
  ARG(Tensor, key)                                                    \
  ARG(Tensor, value)                                                  \
  ARG(Tensor, sparse_indices)                                         \
  ARG(Tensor, attention_out)                                          \
  ARG(Tensor, softmax_max)                                            \
  ARG(Tensor, softmax_sum)                                            \
  ARG(Float, scale_value)                                             \
  KWONLY                                                              \
  OPMESH_SPARSE_ATTN_OPTIONS(ARG, ARG_D)                              \
  ARG_D(OptTensor, sinks, std::nullopt)
#define OPMESH_OP_SPARSE_FLASH_ATTENTION_BACKWARD_RETURNS                                   \
  "(Tensor d_query, Tensor d_key, Tensor d_value, Tensor d_query_rope, Tensor d_key_rope, " \
  "Tensor d_sinks)"

// sparse_flash_mla's length arrays (its metadata's too).
#define OPMESH_MLA_LENGTHS(ARG, ARG_D)            \
  ARG_D(OptInts, cu_seqlens_q, std::nullopt)      \
  ARG_D(OptInts, cu_seqlens_ori_kv, std::nullopt) \
  ARG_D(OptInts, cu_seqlens_cmp_kv, std::nullopt) \
  ARG_D(OptInts, seqused_q, std::nullopt)         \
  ARG_D(OptInts, seqused_ori_kv, std::nullopt)    \
  ARG_D(OptInts, seqused_cmp_kv, std::nullopt)    \
  ARG_D(OptInts, cmp_residual_kv, std::nullopt)

// sparse_flash_mla's key/value tensors, selections, lengths and sinks, which its backward
// shares (Ascend's order).
#define OPMESH_MLA_KEYS(ARG, ARG_D)                  \
  ARG_D(OptTensor, ori_kv, std::nullopt)             \
  ARG_D(OptTensor, cmp_kv, std::nullopt)             \
  ARG_D(OptTensor, ori_sparse_indices, std::nullopt) \
  ARG_D(OptTensor, cmp_sparse_indices, std::nullopt) \
  ARG_D(OptInts, ori_block_table, std::nullopt)      \
  ARG_D(OptInts, cmp_block_table, std::nullopt)      \
  OPMESH_MLA_LENGTHS(ARG, ARG_D)                     \
  ARG_D(OptTensor, ori_topk_length, std::nullopt)    \
  ARG_D(OptTensor, cmp_topk_length, std::nullopt)    \
  ARG_D(OptTensor, sinks, std::nullopt)

// The compression, masks and layouts, with the mask modes' defaults (the metadata's are Ascend's
// 0 and 0, the call's 4 and 3).
#define OPMESH_MLA_MASKS(ARG, ARG_D, ORI_MODE, CMP_MODE) \
  ARG_D(Int, cmp_ratio, 1)                               \
  ARG_D(Int, ori_mask_mode, ORI_MODE)                    \
  ARG_D(Int, cmp_mask_mode, CMP_MODE)                    \
  ARG_D(Int, ori_win_left, -1)                           \
  ARG_D(Int, ori_win_right, -1)                          \
  ARG_D(Str, layout_q, "BSND")                           \
  ARG_D(Str, layout_kv, "BSND")

// sparse_flash_mla's options after its metadata.
#define OPMESH_MLA_OPTIONS(ARG, ARG_D) \
  ARG_D(Float, softmax_scale, 1.0)     \
  OPMESH_MLA_MASKS(ARG, ARG_D, 4, 3)   \
  ARG_D(Int, topk_value_mode, 1)

// sparse_flash_mla(q, *, ori_kv, cmp_kv, ...) -> (attention_out, softmax_lse): DeepSeek-V4's
// shared key/value attention over a window of original keys and compressed keys; ori_kv_scale
// and cmp_kv_scale: the row scales of a quantized (int8 / float8_e4m3fn) ori_kv and cmp_kv.
#define OPMESH_OP_SPARSE_FLASH_MLA(ARG, ARG_D, KWONLY) \
  ARG(Tensor, q)                                       \
  KWONLY                                               \
  OPMESH_MLA_KEYS(ARG, ARG_D)                          \
  ARG_D(OptInts, metadata, std::nullopt)               \
  OPMESH_MLA_OPTIONS(ARG, ARG_D)                       \
  ARG_D(Bool, return_softmax_lse, false)               \
  ARG_D(OptTensor, ori_kv_scale, std::nullopt)         \
  ARG_D(OptTensor, cmp_kv_scale, std::nullopt)
#define OPMESH_OP_SPARSE_FLASH_MLA_RETURNS "(Tensor attention_out, Tensor softmax_lse)"

// sparse_flash_mla_backward(dout, q, attention_out, softmax_lse, *, ...) -> the gradients, an
// operator of its own (softmax_lse: the forward's, sink included; dlse: its gradient, if any).
#define OPMESH_OP_SPARSE_FLASH_MLA_BACKWARD(ARG, ARG_D, KWONLY) \
  ARG(Tensor, dout)                                             \
  ARG(Tensor, q)                                                \
  ARG(Tensor, attention_out)                                    \
  ARG(Tensor, softmax_lse)                                      \
  KWONLY                                                        \
  ARG_D(OptTensor, dlse, std::nullopt)                          \
  OPMESH_MLA_KEYS(ARG, ARG_D)                                   \
  OPMESH_MLA_OPTIONS(ARG, ARG_D)
#define OPMESH_OP_SPARSE_FLASH_MLA_BACKWARD_RETURNS \
  "(Tensor d_q, Tensor d_ori_kv, Tensor d_cmp_kv, Tensor d_sinks)"

// sparse_flash_mla_metadata(num_heads_q, num_heads_kv, head_dim, *, ...) -> metadata: the plan
// of a sparse_flash_mla call over num_workers logical workers (Ascend's arguments, whose mask
// defaults differ from sparse_flash_mla's).
#define OPMESH_OP_SPARSE_FLASH_MLA_METADATA(ARG, ARG_D, KWONLY) \
  ARG(Int, num_heads_q)                                         \
  ARG(Int, num_heads_kv)                                        \
  ARG(Int, head_dim)                                            \
  KWONLY                                                        \
  OPMESH_MLA_LENGTHS(ARG, ARG_D)                                \
  ARG_D(OptInts, ori_topk_length, std::nullopt)                 \
  ARG_D(OptInts, cmp_topk_length, std::nullopt)                 \
  ARG_D(Int, batch_size, 0)                                     \
  ARG_D(Int, max_seqlen_q, 0)                                   \
  ARG_D(Int, max_seqlen_ori_kv, 0)                              \
  ARG_D(Int, max_seqlen_cmp_kv, 0)                              \
  ARG_D(Int, ori_topk, 0)                                       \
  ARG_D(Int, cmp_topk, 0)                                       \
  OPMESH_MLA_MASKS(ARG, ARG_D, 0, 0)                            \
  ARG_D(Bool, has_ori_kv, true)                                 \
  ARG_D(Bool, has_cmp_kv, true)                                 \
  ARG_D(OptInt, num_workers, std::nullopt)
#define OPMESH_OP_SPARSE_FLASH_MLA_METADATA_RETURNS "Tensor"

// kv_cache_write_(key, value?, key_cache!, value_cache!?, slot_mapping, *, key_scale!,
// value_scale!) -> (): the scales are written with a quantized (int8 / float8_e4m3fn) cache;
// value and value_cache both None: one cache of rows read as key and value (MLA's).
#define OPMESH_OP_KV_CACHE_WRITE(ARG, ARG_D, KWONLY) \
  ARG(Tensor, key)                                   \
  ARG(OptTensor, value)                              \
  ARG(MutTensor, key_cache)                          \
  ARG(OptMutTensor, value_cache)                     \
  ARG(Ints, slot_mapping)                            \
  KWONLY                                             \
  ARG_D(OptMutTensor, key_scale, std::nullopt)       \
  ARG_D(OptMutTensor, value_scale, std::nullopt)
#define OPMESH_OP_KV_CACHE_WRITE_RETURNS "()"

// The compressor's sequences: x [T, H]'s offsets, the tokens compressed per sequence and their
// first absolute positions.
#define OPMESH_COMPRESSOR_LENGTHS(ARG, ARG_D) \
  ARG_D(OptInts, cu_seqlens, std::nullopt)    \
  ARG_D(OptInts, seqused, std::nullopt)       \
  ARG_D(OptInts, start_pos, std::nullopt)

// compressor(x, wkv, wgate, state_cache!, ape, cmp_ratio, *, ..., projections!) -> cmp_kv:
// DeepSeek-V4's compressed key/value entries, the state cache updated in place (one of no blocks:
// none); projections, when given, receives every token's projected row for the backward.
#define OPMESH_OP_COMPRESSOR(ARG, ARG_D, KWONLY)  \
  ARG(Tensor, x)                                  \
  ARG(Tensor, wkv)                                \
  ARG(Tensor, wgate)                              \
  ARG(MutTensor, state_cache)                     \
  ARG(Tensor, ape)                                \
  ARG(Int, cmp_ratio)                             \
  KWONLY                                          \
  ARG_D(OptInts, state_block_table, std::nullopt) \
  OPMESH_COMPRESSOR_LENGTHS(ARG, ARG_D)           \
  ARG_D(Int, coff, 1)                             \
  ARG_D(Int, cache_mode, 1)                       \
  ARG_D(OptMutTensor, projections, std::nullopt)
#define OPMESH_OP_COMPRESSOR_RETURNS "Tensor"

// compressor_backward(grad_cmp_kv, x, wkv, wgate, ape, cmp_ratio, *, ..., projections) -> the
// gradients of x, wkv, wgate and ape (entries that read the state cache are refused); with the
// forward's projections it does not compute them again.
#define OPMESH_OP_COMPRESSOR_BACKWARD(ARG, ARG_D, KWONLY) \
  ARG(Tensor, grad_cmp_kv)                                \
  ARG(Tensor, x)                                          \
  ARG(Tensor, wkv)                                        \
  ARG(Tensor, wgate)                                      \
  ARG(Tensor, ape)                                        \
  ARG(Int, cmp_ratio)                                     \
  KWONLY                                                  \
  OPMESH_COMPRESSOR_LENGTHS(ARG, ARG_D)                   \
  ARG_D(Int, coff, 1)                                     \
  ARG_D(OptTensor, projections, std::nullopt)
#define OPMESH_OP_COMPRESSOR_BACKWARD_RETURNS \
  "(Tensor d_x, Tensor d_wkv, Tensor d_wgate, Tensor d_ape)"

// merge_attn_states(out_a, lse_a, out_b, lse_b, *, layout="BSND") -> (out, lse)
#define OPMESH_OP_MERGE_ATTN_STATES(ARG, ARG_D, KWONLY) \
  ARG(Tensor, out_a)                                    \
  ARG(Tensor, lse_a)                                    \
  ARG(Tensor, out_b)                                    \
  ARG(Tensor, lse_b)                                    \
  KWONLY                                                \
  ARG_D(Str, layout, "BSND")
#define OPMESH_OP_MERGE_ATTN_STATES_RETURNS "(Tensor out, Tensor lse)"

// The call struct of one operator for a binding's `Types`: its fields in schema order with their
// defaults, the operator's name and returns, visit(f), which calls f(Field, value&) for each
// field in order, and copy_scalars_to(params), which copies each numeric or bool argument into
// the core params' field of the same name where the params have one (an option declared here
// and in the core's params under one name reaches the kernel with no binding code; arguments
// the params name differently, or that need parsing, are set apart).
#define OPMESH_DETAIL_FIELD(kind, name) typename Types::kind name{};
#define OPMESH_DETAIL_FIELD_D(kind, name, value) typename Types::kind name = value;
#define OPMESH_DETAIL_VISIT(kind, name) f(::opmesh::ops::Field{#name, #kind, false, kw}, name);
#define OPMESH_DETAIL_VISIT_D(kind, name, value) \
  f(::opmesh::ops::Field{#name, #kind, true, kw}, name);
#define OPMESH_DETAIL_NOTHING
#define OPMESH_DETAIL_KWONLY kw = true;
#define OPMESH_DETAIL_COUNT(...) +1
#define OPMESH_DETAIL_COPY_SCALAR(kind, name) \
  ::opmesh::ops::copy_if_field(p, [](auto& q) -> decltype((q.name)) { return q.name; }, name);
#define OPMESH_DETAIL_COPY_SCALAR_D(kind, name, value) OPMESH_DETAIL_COPY_SCALAR(kind, name)
#define OPMESH_DEFINE_CALL(Struct, op_name, LIST)                                         \
  template <class Types>                                                                  \
  struct Struct {                                                                         \
    static constexpr const char* kName = op_name;                                         \
    static constexpr const char* kReturns = LIST##_RETURNS;                               \
    static constexpr int kNumFields =                                                     \
        0 LIST(OPMESH_DETAIL_COUNT, OPMESH_DETAIL_COUNT, OPMESH_DETAIL_NOTHING);          \
    LIST(OPMESH_DETAIL_FIELD, OPMESH_DETAIL_FIELD_D, OPMESH_DETAIL_NOTHING)               \
    template <class F>                                                                    \
    void visit(F&& f) {                                                                   \
      [[maybe_unused]] bool kw = false;                                                   \
      LIST(OPMESH_DETAIL_VISIT, OPMESH_DETAIL_VISIT_D, OPMESH_DETAIL_KWONLY)              \
    }                                                                                     \
    template <class F>                                                                    \
    void visit(F&& f) const {                                                             \
      [[maybe_unused]] bool kw = false;                                                   \
      LIST(OPMESH_DETAIL_VISIT, OPMESH_DETAIL_VISIT_D, OPMESH_DETAIL_KWONLY)              \
    }                                                                                     \
    template <class Params>                                                               \
    void copy_scalars_to(Params& p) const {                                               \
      LIST(OPMESH_DETAIL_COPY_SCALAR, OPMESH_DETAIL_COPY_SCALAR_D, OPMESH_DETAIL_NOTHING) \
    }                                                                                     \
  };

namespace opmesh::ops {

// Every operator: X(call struct, operator name, argument list).
#define OPMESH_ALL_OPS(X)                                                                         \
  X(FlashAttnCall, "flash_attn", OPMESH_OP_FLASH_ATTN)                                            \
  X(FlashAttnBackwardCall, "flash_attn_backward", OPMESH_OP_FLASH_ATTN_BACKWARD)                  \
  X(FlashAttnMetadataCall, "flash_attn_metadata", OPMESH_OP_FLASH_ATTN_METADATA)                  \
  X(IndexerCall, "dense_lightning_indexer_softmax_lse", OPMESH_OP_INDEXER)                        \
  X(KlLossCall, "dense_lightning_indexer_grad_kl_loss", OPMESH_OP_KL_LOSS)                        \
  X(SparseKlLossCall, "sparse_lightning_indexer_grad_kl_loss", OPMESH_OP_SPARSE_KL_LOSS)          \
  X(LightningIndexerCall, "lightning_indexer", OPMESH_OP_LIGHTNING_INDEXER)                       \
  X(SparseFlashAttentionCall, "sparse_flash_attention", OPMESH_OP_SPARSE_FLASH_ATTENTION)         \
  X(SparseFlashAttentionBackwardCall, "sparse_flash_attention_backward",                          \
    OPMESH_OP_SPARSE_FLASH_ATTENTION_BACKWARD)                                                    \
  X(SparseFlashMlaCall, "sparse_flash_mla", OPMESH_OP_SPARSE_FLASH_MLA)                           \
  X(SparseFlashMlaBackwardCall, "sparse_flash_mla_backward", OPMESH_OP_SPARSE_FLASH_MLA_BACKWARD) \
  X(SparseFlashMlaMetadataCall, "sparse_flash_mla_metadata", OPMESH_OP_SPARSE_FLASH_MLA_METADATA) \
  X(KvCacheWriteCall, "kv_cache_write_", OPMESH_OP_KV_CACHE_WRITE)                                \
  X(CompressorCall, "compressor", OPMESH_OP_COMPRESSOR)                                           \
  X(CompressorBackwardCall, "compressor_backward", OPMESH_OP_COMPRESSOR_BACKWARD)                 \
  X(MergeAttnStatesCall, "merge_attn_states", OPMESH_OP_MERGE_ATTN_STATES)

OPMESH_ALL_OPS(OPMESH_DEFINE_CALL)

// Copies the arguments flash_attn and flash_attn_backward share (lengths and options).
template <class To, class From>
void copy_attn_shared(const From& from, To& to) {
#define OPMESH_DETAIL_COPY(kind, name) to.name = from.name;
#define OPMESH_DETAIL_COPY_D(kind, name, value) to.name = from.name;
  OPMESH_ATTN_LENGTHS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
  OPMESH_ATTN_OPTIONS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
  OPMESH_ATTN_SCORE_MODS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
  to.sinks = from.sinks;
#undef OPMESH_DETAIL_COPY
#undef OPMESH_DETAIL_COPY_D
}

// Copies the arguments compressor and its backward share (the lengths, ratio and coff).
template <class To, class From>
void copy_compressor_shared(const From& from, To& to) {
#define OPMESH_DETAIL_COPY(kind, name) to.name = from.name;
#define OPMESH_DETAIL_COPY_D(kind, name, value) to.name = from.name;
  OPMESH_COMPRESSOR_LENGTHS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
#undef OPMESH_DETAIL_COPY
#undef OPMESH_DETAIL_COPY_D
  to.cmp_ratio = from.cmp_ratio;
  to.coff = from.coff;
}

// Copies the options and scale sparse_flash_attention and its backward share.
template <class To, class From>
void copy_sparse_attn_shared(const From& from, To& to) {
#define OPMESH_DETAIL_COPY(kind, name) to.name = from.name;
#define OPMESH_DETAIL_COPY_D(kind, name, value) to.name = from.name;
  OPMESH_SPARSE_ATTN_OPTIONS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
#undef OPMESH_DETAIL_COPY
#undef OPMESH_DETAIL_COPY_D
  to.scale_value = from.scale_value;
}

// Copies the arguments sparse_flash_mla and its backward share.
template <class To, class From>
void copy_mla_shared(const From& from, To& to) {
#define OPMESH_DETAIL_COPY(kind, name) to.name = from.name;
#define OPMESH_DETAIL_COPY_D(kind, name, value) to.name = from.name;
  OPMESH_MLA_KEYS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
  OPMESH_MLA_OPTIONS(OPMESH_DETAIL_COPY, OPMESH_DETAIL_COPY_D)
#undef OPMESH_DETAIL_COPY
#undef OPMESH_DETAIL_COPY_D
}

}  // namespace opmesh::ops
