// Flash attention backward on the CPU: the gradients of flash_attn's output with respect to q, k,
// v and the sinks, recomputing the probabilities from the saved log-sum-exp (never an S x S
// matrix: every worker holds O(tile) scratch).
//
// With P_ij = exp(scale * q_i.k_j - lse_i) on visible keys (0 elsewhere), dO the output's gradient
// and D_i = dO_i . O_i:
//   dV_j = sum_i P_ij dO_i        dP_ij = dO_i . v_j        dS_ij = P_ij (dP_ij - D_i)
//   dK_j = scale sum_i dS_ij q_i  dQ_i = scale sum_j dS_ij k_j
//   dsink_h = -sum_i exp(sink_h - lse_i) D_i   (over every query row of head h)
// When the log-sum-exp itself has a gradient dL_i (it is an output of the forward too), D_i
// becomes D_i - dL_i, since d lse_i / d s_ij = P_ij and d lse_i / d sink_h = exp(sink_h - lse_i).
// summed over the query heads of a key head (GQA). A first step computes every D_i (one float per
// query row and head, the size of the lse); then two passes, each over units a single task owns:
// blocks of four key tiles (dK, dV; each packed query tile serves the whole block) and query
// tiles (dQ, the sinks' partial sums), so no two tasks write the same element and the result is
// bitwise independent of the thread count.
//
// bf16 inputs run on the level's bf16-pair kernels where select_set picks them (the forward's
// choice): every product takes bf16 operands (the inputs as they are; P and dS rounded to bf16,
// as flash attention does on accelerators) and accumulates in float32; the softmax and dS
// element-wise steps stay in float32. Other inputs run on the level's float32 kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../executor.h"
#include "config.h"
#include "flash_attn.h"

namespace opmesh::core::attention {

struct FlashAttnBackwardParams {
  PlanConfig config;              // the forward's (num_workers and deterministic are not used)
  DType dtype = DType::kFloat32;  // of q, k, v, out, dout and the three gradients
  View q, k, v;                   // the forward's inputs; layout_kv may not be PA_BBND
  View out, dout;                 // the forward's output and its gradient, layout_out
  const float* lse = nullptr;     // the forward's log-sum-exp, strides for (b, head, position)
  int64_t lse_sb = 0, lse_sn = 0, lse_ss = 0;
  const float* dlse = nullptr;  // the log-sum-exp's gradient (lse's strides below), or nullptr
  int64_t dlse_sb = 0, dlse_sn = 0, dlse_ss = 0;
  const float* sinks = nullptr;  // [num_heads_q] or nullptr
  float softmax_scale = 1.0f;
  // Score modifications, flash-attn's: the scaled score x of query row i and key j becomes
  // softcap tanh(x / softcap) when softcap > 0, then minus slope |i + diag - j| (diag: the
  // sequence's diagonal, k_len - q_len by default) with slope = alibi_slopes[b * alibi_sb + head]
  // when alibi_slopes is given (alibi_sb 0: one slope per query head).
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;
  int64_t alibi_sb = 0;
  int bf16_pairs = -1;  // as FlashAttnParams::bf16_pairs (bf16 inputs: pairs 1, float32 0)
  // Gradients in the layouts of q, k and v. Rows outside the sequences' used lengths are not
  // written: the caller zero-fills them.
  MutableView dq, dk, dv;
  float* dsinks = nullptr;  // [num_heads_q], required with sinks
};

// A backward plan: the passes' units in their canonical order (key blocks: sequence, key
// head, block of four key tiles; query tiles: sequence, query head, tile; sequences without
// work are left out), each cut into num_workers contiguous ranges of about equal predicted cost.
// Worker w runs key units [key_begin[w], key_end[w]) and query units [query_begin[w],
// query_end[w]) once the D_i pre-pass has run. Which worker runs a unit never changes a bit of
// the result: every unit owns the rows it writes (a fused chunk its own dQ part, the parts summed
// in chunk order after the pass).
struct BackwardPlan {
  // Fused: one pass over (sequence, key head) units, or over chunks of their keys when there are
  // few (the key ranges index those), computing dq, dk and dv together; chosen from the problem
  // alone.
  bool fused = false;
  std::vector<int32_t> key_begin, key_end, query_begin, query_end;
  std::vector<float> cost;  // predicted ns per worker
  int64_t num_key_units = 0, num_query_units = 0;
  double makespan = 0, lower_bound = 0, total_cost = 0;
};

// Plans the backward of a validated configuration over config.num_workers workers.
BackwardPlan plan_backward(const PlanConfig& config, const std::vector<Sequence>& seqs);

// Throws ArgumentError naming the first offending argument.
void validate_backward(const FlashAttnBackwardParams& params, const std::vector<Sequence>& seqs,
                       Isa isa);

// Validates, then computes dq, dk, dv (and dsinks) on the kernels of `isa`, following
// `plan` (from plan_backward for this call's configuration and sequences), or a plan made here
// for 4 logical workers per thread when it is null.
void flash_attn_backward(const FlashAttnBackwardParams& params, const std::vector<Sequence>& seqs,
                         const Executor& executor, Isa isa, const BackwardPlan* plan = nullptr);

}  // namespace opmesh::core::attention
