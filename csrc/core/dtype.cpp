#include "dtype.h"

#include "names.h"

namespace opmesh::core {

const char* dtype_name(DType dtype) {
  static constexpr const char* kNames[] = {"float32", "bfloat16", "float16", "float64"};
  return enum_name(dtype, kNames, "unknown");
}

const char* cache_format_name(CacheFormat format) {
  static constexpr const char* kNames[] = {"plain", "int8", "float8_e4m3fn"};
  return enum_name(format, kNames, "unknown");
}

}  // namespace opmesh::core
