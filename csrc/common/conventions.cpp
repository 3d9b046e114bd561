#include "conventions.h"

#include <string>

#include "attention/config.h"
#include "errors.h"
#include "indexer/indexer.h"

namespace opmesh::conventions {

namespace {

std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

}  // namespace

core::Layout attention_layout(std::string_view value, const char* argument) {
  if (value == "BSND") return core::Layout::kBSND;
  if (value == "BNSD") return core::Layout::kBNSD;
  if (value == "TND") return core::Layout::kTND;
  if (value == "PA_BBND") return core::Layout::kPagedBBND;
  throw core::ArgumentError(argument,
                            "expected 'BSND', 'BNSD', 'TND' or 'PA_BBND', got " + quoted(value));
}

core::MaskMode mask_mode(int64_t value) {
  if (value != 0 && value != 3 && value != 4) {
    throw core::ArgumentError(
        "mask_mode", "must be 0 (none), 3 (causal) or 4 (window), got " + std::to_string(value));
  }
  return static_cast<core::MaskMode>(value);
}

int64_t window(int64_t value, const char* argument) {
  if (value < -1) {
    throw core::ArgumentError(argument,
                              "must be >= -1 (-1: unbounded), got " + std::to_string(value));
  }
  return core::attention::normalize_window(value);
}

core::Mask attention_mask(int64_t mode, int64_t win_left, int64_t win_right) {
  return {mask_mode(mode), window(win_left, "win_left"), window(win_right, "win_right")};
}

core::Layout indexer_layout(std::string_view value, const char* argument) {
  if (value == "BSND") return core::Layout::kBSND;
  if (value == "TND") return core::Layout::kTND;
  throw core::ArgumentError(argument, "expected 'BSND' or 'TND', got " + quoted(value));
}

core::Layout indexer_key_layout(std::string_view value, const char* argument) {
  if (value == "BSND") return core::Layout::kBSND;
  if (value == "TND") return core::Layout::kTND;
  if (value == "PA_BSND") return core::Layout::kPagedBBND;
  throw core::ArgumentError(argument, "expected 'BSND', 'TND' or 'PA_BSND', got " + quoted(value));
}

core::MaskMode sparse_mode(int64_t value) {
  if (value != 0 && value != 3) {
    throw core::ArgumentError(
        "sparse_mode",
        "expected 0 (no mask) or 3 (causal, bottom-right), got " + std::to_string(value));
  }
  return static_cast<core::MaskMode>(value);
}

core::Mask indexer_mask(int64_t mode, int64_t pre_tokens, int64_t next_tokens) {
  return core::indexer_mask(sparse_mode(mode), pre_tokens, next_tokens);
}

}  // namespace opmesh::conventions
