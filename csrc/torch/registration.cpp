// The schemas of every opmesh operator, made from their one declaration in op_defs.h. Kernels
// register per backend in their own files.
#include <torch/library.h>

#include "op_call.h"

namespace {

namespace b = opmesh::binding;

}  // namespace

TORCH_LIBRARY(opmesh, m) {
#define OPMESH_SCHEMA(Struct, op_name, LIST) b::schema_of<b::Struct>(),
  const std::string schemas[] = {OPMESH_ALL_OPS(OPMESH_SCHEMA)};
#undef OPMESH_SCHEMA
  for (const std::string& s : schemas) m.def(s.c_str());
}
