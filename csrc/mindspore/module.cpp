// opmesh's MindSpore extension module: the operators over the framework-neutral core, built by
// MindSpore's CustomOpBuilder (opmesh/platform/mindspore_ops.py loads it). Each operator takes
// its schema's arguments by keyword (csrc/common/op_defs.h, read through ms_call.h).
#include "cpu_features.h"
#include "ms_call.h"

namespace opmesh::ms_binding::detail {

HostInts host_ints_from(const py::handle& value, const char* name) {
  HostInts h;
  const auto entry = [&](const py::handle& item) {
    try {
      return item.cast<int64_t>();
    } catch (const py::cast_error&) {
      throw py::type_error(std::string(name) + ": expected integers");
    }
  };
  const py::sequence items = py::reinterpret_borrow<py::sequence>(value);
  for (const py::handle item : items) {
    if (py::isinstance<py::sequence>(item)) {  // a row of a 2-D array
      const py::sequence row = py::reinterpret_borrow<py::sequence>(item);
      if (h.rows > 0 && static_cast<int64_t>(row.size()) != h.cols) {
        throw py::value_error(std::string(name) + ": rows of different lengths");
      }
      h.cols = static_cast<int64_t>(row.size());
      for (const py::handle x : row) h.values.push_back(entry(x));
      ++h.rows;
    } else {
      h.values.push_back(entry(item));
      h.cols = static_cast<int64_t>(h.values.size());
    }
  }
  return h;
}

}  // namespace opmesh::ms_binding::detail

PYBIND11_MODULE(MS_EXTENSION_NAME, m) {
  namespace b = opmesh::ms_binding;
  m.doc() = "opmesh's operators on MindSpore tensors (CPU)";
  m.def("active_isa",
        [] { return std::string(opmesh::core::isa_name(opmesh::core::active_isa())); });
  b::def_op<b::IndexerCall>(m, "indexer", &b::indexer);
  b::def_op<b::KlLossCall>(m, "indexer_grad_kl_loss", &b::indexer_grad_kl_loss);
  b::def_op<b::SparseKlLossCall>(m, "sparse_indexer_grad_kl_loss", &b::sparse_indexer_grad_kl_loss);
  b::def_op<b::KvCacheWriteCall>(m, "kv_cache_write", &b::kv_cache_write);
  b::def_op<b::LightningIndexerCall>(m, "lightning_indexer", &b::lightning_indexer);
  b::def_op<b::SparseFlashAttentionCall>(m, "sparse_flash_attention", &b::sparse_flash_attention);
  b::def_op<b::SparseFlashAttentionBackwardCall>(m, "sparse_flash_attention_backward",
                                                 &b::sparse_flash_attention_backward);
  b::def_op<b::SparseFlashMlaCall>(m, "sparse_flash_mla", &b::sparse_flash_mla);
  b::def_op<b::SparseFlashMlaBackwardCall>(m, "sparse_flash_mla_backward",
                                           &b::sparse_flash_mla_backward);
  b::def_op<b::CompressorCall>(m, "compressor", &b::compressor);
  b::def_op<b::CompressorBackwardCall>(m, "compressor_backward", &b::compressor_backward);
  b::def_op<b::FlashAttnMetadataCall>(m, "flash_attn_metadata", &b::flash_attn_metadata);
  b::def_op<b::FlashAttnCall>(m, "flash_attn", &b::flash_attn);
  b::def_op<b::FlashAttnBackwardCall>(m, "flash_attn_backward", &b::flash_attn_backward);
}
