// The two public conventions, turned into the core's vocabulary in one place for every binding:
// - attention (flash-attn's words): layouts BSND/BNSD/TND/PA_BBND, mask_mode 0/3/4 with
//   win_left/win_right (-1 unbounded), cu_seqlens starting at 0;
// - the indexer family (Ascend's words): layouts BSND/TND, sparse_mode 0/3 with
//   pre_tokens/next_tokens, actual_seq_qlen/klen as cumulative ends without a leading 0 (read by
//   the core as given).
// Failures are core::ArgumentError whose message starts with the argument's name; each binding
// re-raises them as its framework's ValueError with the same text.
#pragma once

#include <cstdint>
#include <string_view>

#include "vocabulary.h"

namespace opmesh::conventions {

// Attention: a layout argument (`argument` names it: layout_q, layout_kv, layout_out).
core::Layout attention_layout(std::string_view value, const char* argument);

// Attention: mask_mode as given (int64), refused unless 0, 3 or 4 (checked before narrowing).
core::MaskMode mask_mode(int64_t value);

// Attention: a window side (win_left, win_right): -1 or >= 0; kMaxTokens or more is unbounded.
int64_t window(int64_t value, const char* argument);

// Attention: mask_mode, win_left and win_right as the core's mask.
core::Mask attention_mask(int64_t mode, int64_t win_left, int64_t win_right);

// The indexer family: its layout argument (BSND or TND); `argument` names it.
core::Layout indexer_layout(std::string_view value, const char* argument = "layout");

// lightning_indexer's layout_key and sparse_flash_attention's layout_kv: BSND or TND (as its
// layout_query), or PA_BSND (paged keys [block_count, block_size, N2, D], the core's kPagedBBND).
core::Layout indexer_key_layout(std::string_view value, const char* argument = "layout_key");

// The indexer family: sparse_mode (0 or 3).
core::MaskMode sparse_mode(int64_t value);

// The indexer family: sparse_mode, pre_tokens and next_tokens as the core's mask.
core::Mask indexer_mask(int64_t sparse_mode, int64_t pre_tokens, int64_t next_tokens);

}  // namespace opmesh::conventions
