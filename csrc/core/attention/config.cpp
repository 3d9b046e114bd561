#include "config.h"

#include <algorithm>
#include <string>

#include "../errors.h"

namespace opmesh::core::attention {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void require_positive(int64_t value, const char* name, int64_t limit) {
  if (value <= 0 || value > limit) {
    throw ArgumentError(name, "must be in [1, " + str(limit) + "], got " + str(value));
  }
}

// Lengths from a cumulative array: starts at 0, non-decreasing.
void lengths_from_cumulative(const int32_t* cu, int64_t batch, const char* name, bool is_q,
                             std::vector<Sequence>& out) {
  if (cu[0] != 0) throw ArgumentError(name, "must start at 0, got " + str(cu[0]));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (len < 0) {
      throw ArgumentError(name, "must be non-decreasing, but entry " + str(b + 1) + " is " +
                                    str(cu[b + 1]) + " after " + str(cu[b]));
    }
    (is_q ? out[b].q_begin : out[b].k_begin) = cu[b];
    (is_q ? out[b].q_len : out[b].k_len) = len;
  }
}

// seqused entries: >= 0, and <= the padded length where the layout has one (limit >= 0).
void apply_used(const int32_t* used, int64_t batch, int64_t limit, const char* name,
                const char* limit_name, bool is_q, std::vector<Sequence>& out) {
  for (int64_t b = 0; b < batch; ++b) {
    if (used[b] < 0 || (limit >= 0 && used[b] > limit)) {
      throw ArgumentError(
          name, "entry " + str(b) + " is " + str(used[b]) + ", expected [0, " +
                    (limit >= 0 ? std::string(limit_name) + "=" + str(limit) : std::string("inf")) +
                    "]");
    }
    int64_t& len = is_q ? out[b].q_len : out[b].k_len;
    len = std::min<int64_t>(len, used[b]);
  }
}

void check_max(const std::vector<Sequence>& seqs, int64_t max_len, bool is_q) {
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int64_t len = is_q ? seqs[b].q_len : seqs[b].k_len;
    if (len > max_len) {
      throw ArgumentError(is_q ? "max_seqlen_q" : "max_seqlen_kv",
                          "is " + str(max_len) + ", but sequence " + str(b) + " has " + str(len) +
                              (is_q ? " queries" : " keys"));
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void validate_config(const PlanConfig& c) {
  require_positive(c.num_heads_q, "num_heads_q", kMaxHeads);
  require_positive(c.num_heads_kv, "num_heads_kv", kMaxHeads);
  if (c.num_heads_q % c.num_heads_kv != 0) {
    throw ArgumentError("num_heads_kv", "must divide num_heads_q=" + str(c.num_heads_q) + ", got " +
                                            str(c.num_heads_kv));
  }
  require_positive(c.head_dim, "head_dim", kMaxHeadDim);
  require_positive(c.head_dim_v, "head_dim_v", kMaxHeadDim);
  if (c.batch_size < 0 || c.batch_size > kMaxBatch) {
    throw ArgumentError("batch_size",
                        "must be in [0, " + str(kMaxBatch) + "], got " + str(c.batch_size));
  }
  if (c.max_seqlen_q < 0 || c.max_seqlen_q > kMaxTokens) {
    throw ArgumentError("max_seqlen_q",
                        "must be in [0, " + str(kMaxTokens) + "], got " + str(c.max_seqlen_q));
  }
  if (c.max_seqlen_kv < 0 || c.max_seqlen_kv > kMaxTokens) {
    throw ArgumentError("max_seqlen_kv",
                        "must be in [0, " + str(kMaxTokens) + "], got " + str(c.max_seqlen_kv));
  }
  const int32_t mode = static_cast<int32_t>(c.mask_mode);
  if (c.mask_mode != MaskMode::kNone && c.mask_mode != MaskMode::kCausal &&
      c.mask_mode != MaskMode::kWindow) {
    throw ArgumentError("mask_mode",
                        "must be 0 (none), 3 (causal) or 4 (window), got " + str(mode));
  }
  if (c.mask_mode == MaskMode::kWindow) {
    // Windows reach here normalised (normalize_window): kMaxTokens or more is already -1.
    if (c.win_left < -1 || c.win_left >= kMaxTokens) {
      throw ArgumentError("win_left", "must be >= -1, got " + str(c.win_left));
    }
    if (c.win_right < -1 || c.win_right >= kMaxTokens) {
      throw ArgumentError("win_right", "must be >= -1, got " + str(c.win_right));
    }
  } else {
    if (c.win_left != -1) {
      throw ArgumentError("win_left", "must be -1 unless mask_mode=4, got " + str(c.win_left) +
                                          " with mask_mode=" + str(mode));
    }
    if (c.win_right != -1) {
      throw ArgumentError("win_right", "must be -1 unless mask_mode=4, got " + str(c.win_right) +
                                           " with mask_mode=" + str(mode));
    }
  }
  if (c.layout_q == Layout::kPagedBBND) {
    throw ArgumentError("layout_q", "must be BSND, BNSD or TND, got PA_BBND");
  }
  if (c.layout_kv != c.layout_q && c.layout_kv != Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", std::string("must equal layout_q (") +
                                         layout_name(c.layout_q) + ") or be PA_BBND, got " +
                                         layout_name(c.layout_kv));
  }
  const bool q_tnd = c.layout_q == Layout::kTND;
  if (q_tnd ? c.layout_out != Layout::kTND
            : (c.layout_out != Layout::kBSND && c.layout_out != Layout::kBNSD)) {
    throw ArgumentError("layout_out", std::string(q_tnd ? "must be TND when layout_q is TND"
                                                        : "must be BSND or BNSD") +
                                          ", got " + layout_name(c.layout_out));
  }
  require_positive(c.num_workers, "num_workers", 1 << 16);
}

std::vector<Sequence> resolve_sequences(const PlanConfig& c, const LengthArrays& l) {
  const int64_t batch = c.batch_size;
  std::vector<Sequence> seqs(batch);
  for (int64_t b = 0; b < batch; ++b) seqs[b].batch = b;
  const bool q_tnd = c.layout_q == Layout::kTND;
  const bool kv_tnd = c.layout_kv == Layout::kTND;
  // One side's lengths: from its cumulative lengths (TND, required there, refused elsewhere) or
  // its max_seqlen.
  const auto side = [&](bool tnd, const int32_t* cu, const char* cu_name, const char* layout,
                        bool query, int64_t max) {
    if (tnd) {
      if (cu == nullptr) throw ArgumentError(cu_name, "is required for TND");
      lengths_from_cumulative(cu, batch, cu_name, query, seqs);
      return;
    }
    if (cu != nullptr) {
      throw ArgumentError(cu_name, std::string("is only accepted with ") + layout + " TND");
    }
    for (auto& s : seqs) (query ? s.q_len : s.k_len) = max;
  };
  side(q_tnd, l.cu_seqlens_q, "cu_seqlens_q", "layout_q", true, c.max_seqlen_q);
  side(kv_tnd, l.cu_seqlens_kv, "cu_seqlens_kv", "layout_kv", false, c.max_seqlen_kv);
  if (c.layout_kv == Layout::kPagedBBND && l.seqused_kv == nullptr && batch > 0) {
    throw ArgumentError("seqused_kv", "is required with the paged layout PA_BBND");
  }
  if (l.seqused_q) {
    apply_used(l.seqused_q, batch, q_tnd ? -1 : c.max_seqlen_q, "seqused_q", "max_seqlen_q", true,
               seqs);
  }
  if (l.seqused_kv) {
    apply_used(l.seqused_kv, batch, kv_tnd ? -1 : c.max_seqlen_kv, "seqused_kv", "max_seqlen_kv",
               false, seqs);
  }
  check_max(seqs, c.max_seqlen_q, true);
  check_max(seqs, c.max_seqlen_kv, false);
  return seqs;
}

Geometry geometry(const PlanConfig& c) {
  Geometry g;
  g.group = c.num_heads_q / c.num_heads_kv;
  g.positions =
      c.tile_positions > 0 ? c.tile_positions : std::max<int64_t>(1, kTargetRows / g.group);
  g.rows = g.positions * g.group;
  return g;
}

TileSpan tile_span(const PlanConfig& c, const Sequence& s, int64_t p0, int64_t p1) {
  // Both ends of the visible range are non-decreasing in the query position, and a row can only
  // see nothing by coming too early (its range ends before key 0). So the union over the tile's
  // rows is [first seeing row's begin, last row's end) and the keys every row sees are
  // [last row's begin, first row's end).
  TileSpan t;
  if (p1 <= p0 || s.k_len == 0) return t;
  int64_t first_seeing = p0;
  if (c.cmp_ratio > 1 && c.mask_mode == MaskMode::kCausal) {
    // Compressed keys: the first row whose range is not empty (the ranges grow with the row).
    int64_t hi = p1;
    while (first_seeing < hi) {
      const int64_t mid = first_seeing + (hi - first_seeing) / 2;
      if (visible_keys(c, s, mid).end > 0) {
        hi = mid;
      } else {
        first_seeing = mid + 1;
      }
    }
  } else if (c.mask_mode != MaskMode::kNone &&
             !(c.mask_mode == MaskMode::kWindow && c.win_right < 0)) {
    const int64_t reach = c.mask_mode == MaskMode::kCausal ? 0 : c.win_right;
    // Row i sees something iff i + diag + reach >= 0.
    first_seeing = std::max(p0, -s.diag() - reach);
  }
  if (first_seeing >= p1) return t;
  const KeyRange head = visible_keys(c, s, first_seeing);
  const KeyRange last = visible_keys(c, s, p1 - 1);
  t.begin = head.begin / kKeyTile;
  t.end = ceil_div(last.end, kKeyTile);
  const KeyRange first = visible_keys(c, s, p0);
  const int64_t full_lo = ceil_div(last.begin, kKeyTile);
  const int64_t full_hi = first.end / kKeyTile;
  if (first.end > first.begin && full_hi > full_lo) {
    t.full_begin = std::max(full_lo, t.begin);
    t.full_end = std::min(full_hi, t.end);
  }
  if (t.full_end <= t.full_begin) t.full_begin = t.full_end = t.begin;
  return t;
}

}  // namespace opmesh::core::attention
