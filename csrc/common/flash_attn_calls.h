// What a framework binding does between its argument checks and the core's flash_attn kernels,
// written once for every binding: the checks that read length arrays, block tables and plans,
// the resolution of the longest sequences, and the plan (made here or read from metadata).
// Failures are core::ArgumentError whose message starts with the argument's name, so each
// binding re-raises them as its framework's ValueError with the same text.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "attention/config.h"
#include "attention/metadata.h"
#include "attention/planner.h"

namespace opmesh::calls {

namespace attn = core::attention;

// The shapes a forward or backward call's preparation needs, read off the checked tensors.
struct FlashAttnShapes {
  bool q_tnd = false;
  bool kv_tnd = false;
  bool paged = false;
  int64_t q_tokens = 0;   // TND: q's token count
  int64_t kv_tokens = 0;  // TND: k's token count
  int64_t q_seq = 0;      // BSND/BNSD: q's sequence length
  int64_t kv_seq = 0;     // BSND/BNSD: k's sequence length
  // Paged: k is [num_blocks, block_size, ...] and the table [batch, blocks_per_seq].
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t blocks_per_seq = 0;
  const int32_t* table = nullptr;
  int64_t table_stride_b = 0;
  int64_t table_stride_j = 0;
};

// Optional plan words (flash_attn_metadata's output) given to the call.
struct PlanWords {
  const int32_t* words = nullptr;
  int64_t size = 0;
  bool given() const { return words != nullptr; }
};

struct PreparedForward {
  attn::PlanConfig config;
  std::vector<attn::Sequence> sequences;
  std::optional<attn::metadata::Decoded> decoded;
  attn::Plan own_plan;
  // Whether some output row is padding (past a sequence's used length): those rows must start as
  // output 0 and lse +inf, since the kernel writes only the rows a sequence uses.
  bool padding = false;
  const attn::Plan& plan() const { return decoded ? decoded->plan : own_plan; }
};

// `config` comes from the binding's checks with batch_size set; `max_seqlen_*` are the caller's
// values (already checked against shapes and limits); `workers` is the default worker count.
PreparedForward prepare_forward(attn::PlanConfig config, const FlashAttnShapes& shapes,
                                const attn::LengthArrays& lengths,
                                std::optional<int64_t> max_seqlen_q,
                                std::optional<int64_t> max_seqlen_kv, PlanWords metadata,
                                int64_t workers);

struct PreparedBackward {
  attn::PlanConfig config;
  std::vector<attn::Sequence> sequences;
  std::optional<attn::metadata::Decoded> decoded;  // the backward plan, when one was given
};

PreparedBackward prepare_backward(attn::PlanConfig config, const FlashAttnShapes& shapes,
                                  const attn::LengthArrays& lengths,
                                  std::optional<int64_t> max_seqlen_q,
                                  std::optional<int64_t> max_seqlen_kv, PlanWords metadata);

// flash_attn_metadata: the plan words for `config` (validated here) and these lengths.
std::vector<int32_t> plan_words(const attn::PlanConfig& config, const attn::LengthArrays& lengths);

}  // namespace opmesh::calls
