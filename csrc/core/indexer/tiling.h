// Masking arithmetic of the indexer kernel, kept apart so it can be tested alone. (Its work is
// planned by flash attention's planner: indexer.cpp.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../kernels/kernel_set.h"
#include "../vocabulary.h"
#include "indexer.h"

namespace opmesh::core::indexer {

using kernels::kKeyTile;

// Exclusive end of the keys visible to query row i (0-based within its sequence); 0 = none. The
// indexer's masks (none, causal) always start at key 0.
inline int64_t visible_key_end(MaskMode mode, const Sequence& seq, int64_t i) {
  return visible_keys(Mask{mode, -1, -1}, seq, i).end;
}

}  // namespace opmesh::core::indexer
