#include "vocabulary.h"

namespace opmesh::core {

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kBSND:
      return "BSND";
    case Layout::kBNSD:
      return "BNSD";
    case Layout::kTND:
      return "TND";
    case Layout::kPagedBBND:
      return "PA_BBND";
  }
  return "?";
}

}  // namespace opmesh::core
