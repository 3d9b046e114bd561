// The schemas of every opmesh operator, made from their one declaration in op_defs.h. Kernels
// register per backend in their own files.
#include <torch/library.h>

#include "op_call.h"

namespace {

namespace b = opmesh::binding;

}  // namespace

TORCH_LIBRARY(opmesh, m) {
  const std::string schemas[] = {
      b::schema_of<b::IndexerCall>(),
      b::schema_of<b::KlLossCall>(),
      b::schema_of<b::FlashAttnMetadataCall>(),
      b::schema_of<b::FlashAttnCall>(),
      b::schema_of<b::FlashAttnBackwardCall>(),
      b::schema_of<b::KvCacheWriteCall>(),
      b::schema_of<b::MergeAttnStatesCall>(),
      b::schema_of<b::LightningIndexerCall>(),
      b::schema_of<b::SparseFlashAttentionCall>(),
      b::schema_of<b::SparseFlashAttentionBackwardCall>(),
      b::schema_of<b::SparseKlLossCall>(),
  };
  for (const std::string& s : schemas) m.def(s.c_str());
}
