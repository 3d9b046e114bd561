// The planner's cost model: predicted nanoseconds of the CPU kernel for the pieces of work it is
// made of. The constants are fitted to measured kernel times by
// benchmarks/calibrate_cost_model.py (bf16, the common training and serving type; other types
// scale every term alike, which leaves the balance unchanged).
#pragma once

#include <cstdint>

#include "../kernels/kernel_set.h"

namespace opmesh::core::attention {

struct CostModel {
  double task_ns;         // fixed cost of one task: scheduling, state set-up
  double row_ns;          // per query row of a task, per element of (head_dim + head_dim_v):
                          //   packing the queries and writing the output
  double tile_ns;         // fixed cost of one (query tile x key tile) block
  double mac_ns;          // per multiply-add of a block: rows x 64 keys x (head_dim + head_dim_v)
  double masked_row_ns;   // extra per row of a block that needs per-row masking
  double combine_row_ns;  // per row, per element of head_dim_v, per merged partial result
  int64_t row_block = 6;  // rows the micro-kernel computes at once (its register block or tile)
};

// The fitted model, for the AVX-512 kernel sets' 6-row register blocks. flash_attn_metadata plans
// with it: a plan is made before the inputs' dtype, and so the kernel set, is known.
const CostModel& default_cost_model();

// The fitted model with the row block of the kernel set that will run the plan.
CostModel cost_model_for(const kernels::KernelSet& set);

// Rows the micro-kernel computes for `rows` real rows.
inline int64_t padded_rows(const CostModel& m, int64_t rows) {
  return (rows + m.row_block - 1) / m.row_block * m.row_block;
}

// Cost of one block of `rows` query rows against one 64-key tile, masked or not. A partial key
// tile costs a full one: the kernel computes all 64 columns and masks the rest.
inline double block_cost(const CostModel& m, int64_t rows, int64_t dim_sum, bool masked) {
  return m.tile_ns + m.mac_ns * static_cast<double>(padded_rows(m, rows) * 64 * dim_sum) +
         (masked ? m.masked_row_ns * static_cast<double>(rows) : 0.0);
}

// Fixed part of a task of `rows` query rows, before any key tile.
inline double task_cost(const CostModel& m, int64_t rows, int64_t dim_sum) {
  return m.task_ns + m.row_ns * static_cast<double>(rows * dim_sum);
}

// Merging one more partial result of `rows` rows into a split row's output.
inline double combine_cost(const CostModel& m, int64_t rows, int64_t head_dim_v) {
  return m.combine_row_ns * static_cast<double>(rows * head_dim_v);
}

}  // namespace opmesh::core::attention
