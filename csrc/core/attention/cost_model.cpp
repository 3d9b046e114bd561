#include "cost_model.h"

namespace opmesh::core::attention {

// Fitted by benchmarks/calibrate_cost_model.py on an AMD EPYC (Zen 4) core, bf16 inputs.
const CostModel& default_cost_model() {
  static const CostModel model{
      /*task_ns=*/2000.0,
      /*row_ns=*/0.5,
      /*tile_ns=*/1500.0,
      /*mac_ns=*/0.0033,
      /*masked_row_ns=*/20.0,
      /*combine_row_ns=*/1.0,
  };
  return model;
}

}  // namespace opmesh::core::attention
