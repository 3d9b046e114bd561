// The CPU backend: each operator's driver with the instruction set the CPU offers
// (active_isa(), or the one OPMESH_SIMD names).
#include <string>

#include "../errors.h"
#include "backend.h"

namespace opmesh::core {

const char* device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

const Backend& cpu_backend() {
  static const Backend backend{
      "cpu",
      [](const IndexerParams& p, const Executor& e) {
        dense_lightning_indexer_softmax_lse(p, e, active_isa());
      },
      [](const IndexerKlLossParams& p, const Executor& e) {
        dense_lightning_indexer_grad_kl_loss(p, e, active_isa());
      },
      [](const SparseKlLossParams& p, const Executor& e) {
        sparse_lightning_indexer_grad_kl_loss(p, e, active_isa());
      },
      [](const LightningIndexerParams& p, const Executor& e) {
        lightning_indexer(p, e, active_isa());
      },
      [](const SparseAttentionParams& p, const Executor& e) {
        sparse_flash_attention(p, e, active_isa());
      },
      [](const SparseAttentionParams& p, const SparseAttentionGrads& g, const Executor& e) {
        sparse_flash_attention_backward(p, g, e, active_isa());
      },
      [](const SparseFlashMlaParams& p, const Executor& e, const sparse::TokenSchedule* s) {
        sparse_flash_mla(p, e, active_isa(), s);
      },
      [](const SparseFlashMlaParams& p, const SparseFlashMlaGrads& g, const Executor& e) {
        sparse_flash_mla_backward(p, g, e, active_isa());
      },
      [](const attention::FlashAttnParams& p, const std::vector<Sequence>& seqs,
         const attention::Plan& plan, const Executor& e, float* workspace, int64_t* worker_ns) {
        attention::flash_attn(p, seqs, plan, e, active_isa(), workspace, worker_ns);
      },
      [](const attention::FlashAttnBackwardParams& p, const std::vector<Sequence>& seqs,
         const Executor& e, const attention::BackwardPlan* plan) {
        attention::flash_attn_backward(p, seqs, e, active_isa(), plan);
      },
      [](const KvCacheWriteParams& p, const Executor& e) { kv_cache_write(p, e); },
      [](const CompressorParams& p, const Executor& e) { compressor(p, e, active_isa()); },
      [](const CompressorParams& p, const CompressorGrads& g, const Executor& e) {
        compressor_backward(p, g, e, active_isa());
      },
  };
  return backend;
}

const Backend& backend_for(Device device) {
  if (device == Device::kCpu) return cpu_backend();
  throw ArgumentError(
      "device", std::string("this build has no kernels for ") + device_name(device) + " tensors");
}

}  // namespace opmesh::core
