#include "selection.h"

#include <string>
#include <vector>

#include "errors.h"

namespace opmesh::core {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

Mask indexer_mask(MaskMode sparse_mode, int64_t pre_tokens, int64_t next_tokens) {
  if (sparse_mode != MaskMode::kNone && sparse_mode != MaskMode::kCausal) {
    throw ArgumentError("sparse_mode", "expected 0 (no mask) or 3 (causal), got " +
                                           str(static_cast<int>(sparse_mode)));
  }
  if (pre_tokens < 0) throw ArgumentError("pre_tokens", "must be >= 0, got " + str(pre_tokens));
  if (next_tokens < 0) {
    throw ArgumentError("next_tokens", "must be >= 0, got " + str(next_tokens));
  }
  const int64_t left = normalize_window(pre_tokens);
  const int64_t right = sparse_mode == MaskMode::kCausal ? 0 : normalize_window(next_tokens);
  if (left < 0 && right < 0) return {MaskMode::kNone, -1, -1};
  if (left < 0 && right == 0) return {MaskMode::kCausal, -1, -1};
  return {MaskMode::kWindow, left, right};
}

void check_indexer_lengths(const int64_t* lens, int64_t batch, int64_t total, bool cumulative,
                           const char* name) {
  if (cumulative) {
    // An empty batch has no lengths to give; then no tokens may be present either.
    if (lens == nullptr && batch > 0) throw ArgumentError(name, "is required for layout TND");
    int64_t prev = 0;
    for (int64_t b = 0; b < batch; ++b) {
      if (lens[b] < prev) {
        throw ArgumentError(name, "cumulative lengths must be non-decreasing and >= 0, but entry " +
                                      str(b) + " is " + str(lens[b]) + " after " + str(prev));
      }
      prev = lens[b];
    }
    if (prev != total) {
      throw ArgumentError(name, "last cumulative length must equal the token count " + str(total) +
                                    ", got " + str(prev));
    }
    return;
  }
  if (lens == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[b] < 0 || lens[b] > total) {
      throw ArgumentError(name, "entry " + str(b) + " is " + str(lens[b]) +
                                    ", expected a length in [0, " + str(total) + "]");
    }
  }
}

namespace {

void check_lengths(const QueryKeyLayout& l, Layout key, const char* key_layout,
                   const char* q_lens_name, const char* k_lens_name) {
  if (l.layout_query != Layout::kBSND && l.layout_query != Layout::kTND) {
    throw ArgumentError("layout_query", "expected BSND or TND");
  }
  const bool paged = key == Layout::kPagedBBND;
  if (!paged && key != l.layout_query) {
    throw ArgumentError(key_layout, std::string("expected ") + layout_name(l.layout_query) +
                                        " like layout_query, or PA_BSND");
  }
  if (l.batch < 0 || l.batch > kMaxBatch) {
    throw ArgumentError("query",
                        "batch must be in [0, " + str(kMaxBatch) + "], got " + str(l.batch));
  }
  if (l.seq_q < 0 || l.seq_q > kMaxTokens) {
    throw ArgumentError("query", "at most " + str(kMaxTokens) + " tokens, got " + str(l.seq_q));
  }
  if (!paged && (l.seq_k < 0 || l.seq_k > kMaxTokens)) {
    throw ArgumentError("key", "at most " + str(kMaxTokens) + " tokens, got " + str(l.seq_k));
  }
  const bool tnd = l.layout_query == Layout::kTND;
  if (tnd && l.batch == 0 && l.seq_q != 0) {
    throw ArgumentError(q_lens_name, "is empty but the query holds tokens");
  }
  check_indexer_lengths(l.seq_q_lens, l.batch, l.seq_q, tnd, q_lens_name);
  if (!paged) {
    if (tnd && l.batch == 0 && l.seq_k != 0) {
      throw ArgumentError(k_lens_name, "is empty but the key holds tokens");
    }
    check_indexer_lengths(l.seq_k_lens, l.batch, l.seq_k, tnd, k_lens_name);
    return;
  }
  if (l.block_count < 0 || l.max_blocks < 0) throw ArgumentError("block_table", "negative size");
  if (l.batch > 0 && l.seq_k_lens == nullptr) {
    throw ArgumentError(k_lens_name, std::string("is required for ") + key_layout + " PA_BSND");
  }
  for (int64_t b = 0; b < l.batch; ++b) {
    const int64_t len = l.seq_k_lens[b];
    if (len < 0 || len > kMaxTokens) {
      throw ArgumentError(k_lens_name,
                          "entry " + str(b) + " is " + str(len) + ", expected a length >= 0");
    }
    if (len > 0 && l.block_size < 1) {
      throw ArgumentError("key", "block_size must be >= 1, got " + str(l.block_size));
    }
    const int64_t blocks = len > 0 ? (len + l.block_size - 1) / l.block_size : 0;
    if (blocks > l.max_blocks) {
      throw ArgumentError("block_table", "sequence " + str(b) + " has " + str(len) +
                                             " keys, more than its " + str(l.max_blocks) +
                                             " blocks of " + str(l.block_size) + " hold");
    }
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t block = l.block_table[b * l.max_blocks + i];
      if (block < 0 || block >= l.block_count) {
        throw ArgumentError("block_table", "entry [" + str(b) + ", " + str(i) + "] is " +
                                               str(block) + ", expected a block in [0, " +
                                               str(l.block_count) + ")");
      }
    }
  }
}

}  // namespace

void validate(const QueryKeyLayout& l, Layout key, const char* key_layout, const char* q_lens_name,
              const char* k_lens_name) {
  check_lengths(l, key, key_layout, q_lens_name, k_lens_name);
  indexer_mask(l.sparse_mode, l.pre_tokens, l.next_tokens);
}

void check_grouped_heads(int64_t heads_q, int64_t heads_k) {
  if (heads_q < 1 || heads_q > kMaxHeads) {
    throw ArgumentError("query", "N1 must be in [1, " + str(kMaxHeads) + "], got " + str(heads_q));
  }
  if (heads_k < 1 || heads_q % heads_k != 0) {
    throw ArgumentError(
        "key", "key heads N2=" + str(heads_k) + " must divide the query heads N1=" + str(heads_q));
  }
}

std::vector<Sequence> query_key_sequences(const QueryKeyLayout& l, Layout key) {
  std::vector<Sequence> out(l.batch);
  for (int64_t b = 0; b < l.batch; ++b) {
    Sequence& s = out[b];
    s.batch = b;
    if (l.layout_query == Layout::kTND) {
      s.q_begin = b == 0 ? 0 : l.seq_q_lens[b - 1];
      s.q_len = l.seq_q_lens[b] - s.q_begin;
    } else {
      s.q_len = l.seq_q_lens ? l.seq_q_lens[b] : l.seq_q;
    }
    if (key == Layout::kTND) {
      s.k_begin = b == 0 ? 0 : l.seq_k_lens[b - 1];
      s.k_len = l.seq_k_lens[b] - s.k_begin;
    } else {
      s.k_len = l.seq_k_lens ? l.seq_k_lens[b] : l.seq_k;
    }
  }
  return out;
}

void validate(const Selection& sel, const std::vector<Sequence>& seqs) {
  int64_t longest = 0;
  for (const Sequence& s : seqs) longest = std::max(longest, s.k_len);
  const int64_t bs = sel.block_size;
  // A stamp per key block: the id of the last row that named it.
  std::vector<int64_t> stamp((longest + bs - 1) / bs, -1);
  int64_t row_id = 0;
  const View& st = sel.indices;
  const int32_t* indices = static_cast<const int32_t*>(st.data);
  const std::string unit = bs == 1 ? "key" : "block";
  for (const Sequence& s : seqs) {
    const int64_t blocks = (s.k_len + bs - 1) / bs;
    for (int64_t i = 0; i < s.q_len; ++i) {
      for (int64_t n = 0; n < sel.heads; ++n, ++row_id) {
        const int64_t base = (sel.tnd ? 0 : s.batch * st.sb) + (s.q_begin + i) * st.ss + n * st.sn;
        const auto row = [&] {
          std::string r = "[";
          if (!sel.tnd) r += str(s.batch) + ", ";
          return r + str(sel.tnd ? s.q_begin + i : i) + ", " + str(n) + "]";
        };
        const int64_t count = sel.row_count(s, i, n);
        if (count < 0 || count > sel.count) {
          throw ArgumentError(sel.lengths_name, "row " + row() + " is " + str(count) +
                                                    ", expected [0, " + str(sel.count) + "]");
        }
        for (int64_t e = 0; e < count; ++e) {
          const int64_t v = indices[base + e * st.sd];
          if (v == -1) continue;
          if (v < -1 || v >= blocks) {
            throw ArgumentError(sel.name, "row " + row() + " entry " + str(e) + " is " + str(v) +
                                              ", expected -1 or a " + unit + " in [0, " +
                                              str(blocks) + ")");
          }
          if (stamp[v] == row_id) {
            throw ArgumentError(sel.name,
                                "row " + row() + " selects " + unit + " " + str(v) + " twice");
          }
          stamp[v] = row_id;
        }
      }
    }
  }
}

void validate(const Compression& c, int64_t batch, int64_t pre_tokens, int64_t next_tokens) {
  if (c.cmp_ratio < 1 || c.cmp_ratio > kMaxTokens) {
    throw ArgumentError("cmp_ratio",
                        "must be in [1, " + str(kMaxTokens) + "], got " + str(c.cmp_ratio));
  }
  if (c.cmp_residuals != nullptr) {
    if (c.cmp_ratio == 1) {
      throw ArgumentError("cmp_residual_key", "is given only with cmp_ratio > 1");
    }
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t r = c.cmp_residuals[b];
      if (r < 0 || r >= c.cmp_ratio) {
        throw ArgumentError("cmp_residual_key",
                            "entry " + str(b) + " is " + str(r) +
                                ", outside [0, cmp_ratio = " + str(c.cmp_ratio) + ")");
      }
    }
  }
  if (c.cmp_ratio > 1 && (pre_tokens < kMaxTokens || next_tokens < kMaxTokens)) {
    throw ArgumentError(pre_tokens < kMaxTokens ? "pre_tokens" : "next_tokens",
                        "a band is not defined over compressed keys (cmp_ratio > 1)");
  }
}

}  // namespace opmesh::core
