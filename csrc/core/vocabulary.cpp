#include "vocabulary.h"

#include "names.h"

namespace opmesh::core {

const char* layout_name(Layout layout) {
  static constexpr const char* kNames[] = {"BSND", "BNSD", "TND", "PA_BBND"};
  return enum_name(layout, kNames, "?");
}

}  // namespace opmesh::core
