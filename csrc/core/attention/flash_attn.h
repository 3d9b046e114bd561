// Flash attention forward on the CPU, following a plan (planner.h): every logical worker walks
// its stretch of (sequence, key head, query tile, key tile) work, split units leave partial
// results in a workspace, and a combine phase merges them by their log-sum-exp.
#pragma once

#include <cstdint>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../executor.h"
#include "../kernel_choice.h"
#include "config.h"
#include "planner.h"

namespace opmesh::core::attention {

struct FlashAttnParams {
  PlanConfig config;
  LengthArrays lengths;
  DType dtype = DType::kFloat32;  // of q, k, v and the output
  View q, k, v;
  const int32_t* block_table = nullptr;  // paged: [batch][max_blocks] with strides bt_sb, bt_sj
  int64_t bt_sb = 0, bt_sj = 0;
  int64_t block_size = 0;
  const float* sinks = nullptr;  // [num_heads_q] or nullptr
  float softmax_scale = 1.0f;
  // Score modifications, flash-attn's: the scaled score x of query row i and key j becomes
  // softcap tanh(x / softcap) when softcap > 0, then minus slope |i + diag - j| (diag: the
  // sequence's diagonal, k_len - q_len by default) with slope = alibi_slopes[b * alibi_sb + head]
  // when alibi_slopes is given (alibi_sb 0: one slope per query head).
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;
  int64_t alibi_sb = 0;
  // A quantized key/value cache: k and v hold one byte per element of kv_format, and a row of
  // head h reads as its elements times the float32 scale at the same (b or block, s or offset,
  // head) of k_scale / v_scale (strides sb, ss, sn; sd unused). The kernel converts each key and
  // value tile it reads to q's dtype in a small per-worker buffer (exactly: the quantized values
  // have at most 8 significant bits), reading the cache's bytes from memory once, and applies
  // the scales where they are linear: the key scales to the scores, the value scales to the
  // probabilities (rounded to bf16 again on a bf16-pair set). kPlain: k and v are of `dtype`.
  CacheFormat kv_format = CacheFormat::kPlain;
  View k_scale, v_scale;
  MutableView out;       // output, same dtype as q, [b][s][n][dv]
  float* lse = nullptr;  // nullptr: not requested; else strides for (b, head, position)
  int64_t lse_sb = 0, lse_sn = 0, lse_ss = 0;
  // bf16 inputs at the avx512_bf16 level: -1 chooses bf16 pairs or float32 FMA by measured speed
  // for the call's kind of work (kernel_choice.h), 1 forces pairs, 0 forces float32.
  int bf16_pairs = -1;
};

// The kind of work a call is: memory-bound when every sequence has at most kDecodeRows queries
// (decode), compute-bound otherwise.
inline constexpr int64_t kDecodeRows = 16;

// Floats of workspace the plan's split units need.
int64_t workspace_floats(const PlanConfig& config, const Plan& plan);

// Checks the configuration (validate_config), the sequences against it, the pointers the call
// needs, the plan's worker count, the workspace and the ISA; throws ArgumentError naming the
// first offending argument. flash_attn() calls it first.
void validate(const FlashAttnParams& params, const std::vector<Sequence>& sequences,
              const Plan& plan, Isa isa, const float* workspace);

// Throws ArgumentError("softcap", ...) for a softcap that is negative or not finite (flash_attn
// and sparse_flash_attention alike).
void check_softcap(float softcap);

// Throws ArgumentError for a softcap that is negative or not finite, or a slope that is not
// finite (alibi_slopes: one row, or batch_size rows when alibi_sb != 0, of num_heads_q).
void validate_score_mods(const PlanConfig& config, float softcap, const float* alibi_slopes,
                         int64_t alibi_sb);

// Runs the plan. Every query row of every sequence's used length is written (output and lse);
// rows beyond it (query padding) are not touched, so the caller fills them with 0 and +inf.
// `worker_ns`, when given, receives each logical worker's busy time in nanoseconds.
void flash_attn(const FlashAttnParams& params, const std::vector<Sequence>& sequences,
                const Plan& plan, const Executor& executor, Isa isa, float* workspace,
                int64_t* worker_ns);

}  // namespace opmesh::core::attention
