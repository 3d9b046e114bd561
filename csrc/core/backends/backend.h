// The seat of a device's kernels. Everything before a kernel is device-neutral and shared: each
// operator's params and their validate() (csrc/core/attention, csrc/core/indexer), the plans
// (the planner, flash_attn_metadata), the bindings' checks and the params they fill from a call
// (csrc/common). A Backend supplies only what runs on the device: one entry per operator, each
// taking the validated params and the binding's executor. The CPU backend (cpu.cpp) runs this
// library's kernel sets, choosing the instruction set the CPU offers; a second device's build
// adds its own Backend and returns it from backend_for (docs/architecture.md).
#pragma once

#include <cstdint>
#include <vector>

#include "../attention/flash_attn.h"
#include "../attention/flash_attn_backward.h"
#include "../attention/sparse_attention.h"
#include "../attention/sparse_flash_mla.h"
#include "../compressor/compressor.h"
#include "../executor.h"
#include "../indexer/indexer.h"
#include "../indexer/indexer_kl_loss.h"
#include "../indexer/lightning_indexer.h"
#include "../indexer/sparse_kl_loss.h"
#include "../kv_cache.h"

namespace opmesh::core {

enum class Device : int { kCpu = 0, kCuda = 1 };

const char* device_name(Device device);

struct Backend {
  const char* name;
  void (*dense_lightning_indexer_softmax_lse)(const IndexerParams&, const Executor&);
  void (*dense_lightning_indexer_grad_kl_loss)(const IndexerKlLossParams&, const Executor&);
  void (*sparse_lightning_indexer_grad_kl_loss)(const SparseKlLossParams&, const Executor&);
  void (*lightning_indexer)(const LightningIndexerParams&, const Executor&);
  void (*sparse_flash_attention)(const SparseAttentionParams&, const Executor&);
  void (*sparse_flash_attention_backward)(const SparseAttentionParams&, const SparseAttentionGrads&,
                                          const Executor&);
  void (*sparse_flash_mla)(const SparseFlashMlaParams&, const Executor&,
                           const sparse::TokenSchedule*);
  void (*sparse_flash_mla_backward)(const SparseFlashMlaParams&, const SparseFlashMlaGrads&,
                                    const Executor&);
  void (*flash_attn)(const attention::FlashAttnParams&, const std::vector<Sequence>&,
                     const attention::Plan&, const Executor&, float* workspace, int64_t* worker_ns);
  void (*flash_attn_backward)(const attention::FlashAttnBackwardParams&,
                              const std::vector<Sequence>&, const Executor&,
                              const attention::BackwardPlan* plan);
  void (*kv_cache_write)(const KvCacheWriteParams&, const Executor&);
  void (*compressor)(const CompressorParams&, const Executor&);
  void (*compressor_backward)(const CompressorParams&, const CompressorGrads&, const Executor&);
};

// The kernels of this library's CPU kernel sets.
const Backend& cpu_backend();

// The backend of `device`; ArgumentError("device") for a device this build has none for.
const Backend& backend_for(Device device);

}  // namespace opmesh::core
