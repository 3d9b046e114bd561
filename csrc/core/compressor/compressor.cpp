#include "compressor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../aligned_buffer.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"

namespace opmesh::core {
namespace {

using kernels::KernelSet;
using kernels::round_up;

constexpr int64_t kRowBlock = 192;       // token rows per projection task
constexpr int64_t kDepthChunk = 512;     // depth per product call: B's panel stays in cache
constexpr int64_t kWeightRows = 192;     // weight rows per weight-gradient task
constexpr int64_t kGroupColumns = 1024;  // B's columns per weight-gradient task

std::string str(int64_t v) { return std::to_string(v); }

// A B operand [depth words][ld columns] (ld a multiple of 16) stored in column panels of the
// set's gemm_cols (the columns its GEMM takes at a time): each panel's [depth][its width] is
// contiguous, so a product reads it in order, where a full-width B's rows lie ld words apart.
struct Panels {
  int64_t depth = 0;
  int64_t ld = 0;
  int64_t panel = 64;
  int64_t count() const { return (ld + panel - 1) / panel; }
  int64_t width(int64_t j) const { return std::min(panel, ld - j * panel); }
  int64_t start(int64_t j) const { return j * panel * depth; }
  int64_t at(int64_t d, int64_t n) const {
    const int64_t j = n / panel;
    return start(j) + d * width(j) + n % panel;
  }
};

// The products' operands in a kernel set's words: float32 sets hold one float per element,
// bf16-pair sets one word per two consecutive elements along the depth (element 2w in the low
// half), each rounded to bf16 (exact for bf16 inputs). Depths are padded with zeros to the set's
// alignment, and A's rows to its row alignment.
class Words {
 public:
  explicit Words(const KernelSet& k) : k_(k), pairs_(k.word == kernels::Word::kBf16Pair) {}
  int64_t depth(int64_t elements) const {
    return round_up(pairs_ ? (elements + 1) / 2 : elements, k_.depth_align);
  }
  int64_t rows(int64_t m) const { return round_up(std::max<int64_t>(m, 1), k_.row_align); }
  // Depth elements per word.
  int64_t per_word() const { return pairs_ ? 2 : 1; }
  // The word of depth elements (2i, 2i + 1) holding lo and hi on a pair set; lo's float bits on
  // a float32 set (hi unused).
  uint32_t word(float lo, float hi) const {
    if (!pairs_) {
      uint32_t bits;
      std::memcpy(&bits, &lo, sizeof(bits));
      return bits;
    }
    return float_to_bf16_bits(lo) | static_cast<uint32_t>(float_to_bf16_bits(hi)) << 16;
  }
  // Word row `at` of B's columns [0, n): depth elements lo (and, on a pair set, hi: null past
  // the depth, zeros), n floats each.
  void set_b_words(uint32_t* b, const Panels& panels, int64_t at, const float* lo, const float* hi,
                   int64_t n) const {
    for (int64_t j = 0; j * panels.panel < n; ++j) {
      const int64_t c0 = j * panels.panel;
      const int64_t cols = std::min(panels.panel, n - c0);
      uint32_t* dst = b + panels.at(at, c0);
      const float* l = lo + c0;
      if (!pairs_) {
        std::memcpy(dst, l, static_cast<size_t>(cols) * sizeof(float));
        continue;
      }
      if (hi == nullptr) {
        for (int64_t c = 0; c < cols; ++c) dst[c] = float_to_bf16_bits(l[c]);
        continue;
      }
      const float* h = hi + c0;
      for (int64_t c = 0; c < cols; ++c) dst[c] = word(l[c], h[c]);
    }
  }
  // Word row `at` of B's columns [0, n) from the rows of a view at lo and hi (hi < 0: past the
  // depth; a float32 set reads lo alone): bf16 rows of unit stride on a pair set as their bits,
  // others through floats (tmp: 2 n floats of scratch).
  void load_b_words(uint32_t* b, const Panels& panels, int64_t at, const View& v, DType dtype,
                    int64_t lo, int64_t hi, int64_t n, float* tmp) const {
    if (!pairs_) hi = -1;
    if (pairs_ && dtype == DType::kBFloat16 && v.sd == 1) {
      const uint16_t* src = static_cast<const uint16_t*>(v.data);
      for (int64_t c0 = 0; c0 < n; c0 += panels.panel) {
        k_.rows.interleave_bf16(src + lo + c0, hi < 0 ? nullptr : src + hi + c0,
                                std::min(panels.panel, n - c0), b + panels.at(at, c0));
      }
      return;
    }
    core::load_row(v.data, dtype, lo, v.sd, n, tmp);
    if (hi >= 0) core::load_row(v.data, dtype, hi, v.sd, n, tmp + n);
    set_b_words(b, panels, at, tmp, hi >= 0 ? tmp + n : nullptr, n);
  }
  // Words [0, 64) of word row `at` of a transposed operand from two rows of 64 floats (hi null:
  // past the depth, zeros; a float32 set reads lo alone).
  void pair_64(const float* lo, const float* hi, uint32_t* out) const {
    if (!pairs_) {
      std::memcpy(out, lo, 64 * sizeof(float));
    } else if (hi != nullptr) {
      k_.rows.pair_rows(lo, hi, out);
    } else {
      for (int64_t c = 0; c < 64; ++c) out[c] = float_to_bf16_bits(lo[c]);
    }
  }
  // A row of A from n floats: its words (the depth's padding is left as it is).
  void set_row(uint32_t* row, const float* src, int64_t n) const {
    if (!pairs_) {
      std::memcpy(row, src, static_cast<size_t>(n) * sizeof(float));
      return;
    }
    // Consecutive bf16 elements are a row's pairs.
    k_.rows.store_bf16(src, 1.0f, n, reinterpret_cast<uint16_t*>(row));
  }
  // A row of A from n elements of a view at `offset` (tmp: n floats of scratch).
  void load_row(const View& v, DType dtype, int64_t offset, int64_t n, float* tmp,
                uint32_t* row) const {
    if (pairs_ && dtype == DType::kBFloat16) {  // already the set's rounding: the bits as they are
      load_row_bf16_pairs(v.data, offset, v.sd, n, row);
      return;
    }
    core::load_row(v.data, dtype, offset, v.sd, n, tmp);
    set_row(row, tmp, n);
  }

 private:
  const KernelSet& k_;
  bool pairs_;
};

// `count` zero words, faulted in by the threads that first write them.
AlignedBuffer<uint32_t> words(int64_t count) {
  return AlignedBuffer<uint32_t>::lazily_zeroed(static_cast<size_t>(count));
}

// C[m][columns of panels j0 .. j1 - 1] = A[m][depth] . B[depth][those columns] in the set's
// words (B in panels, depth in words, padded; c points at panel j0's first column). The depth
// goes in chunks, accumulated through the product's row scale (`ones`: m entries of 1): each
// chunk of A stays in cache while the panels' chunks pass.
void product(const KernelSet& k, const uint32_t* a, int64_t lda, const uint32_t* b,
             const Panels& panels, float* c, int64_t ldc, int64_t m, const float* ones, int64_t j0,
             int64_t j1) {
  if (panels.depth == 0) {
    const int64_t cols = std::min(panels.ld, j1 * panels.panel) - j0 * panels.panel;
    for (int64_t r = 0; r < m; ++r) std::fill(c + r * ldc, c + r * ldc + cols, 0.0f);
    return;
  }
  for (int64_t d0 = 0; d0 < panels.depth; d0 += kDepthChunk) {
    const int64_t dn = std::min(kDepthChunk, panels.depth - d0);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t w = panels.width(j);
      k.gemm({a + d0, lda, b + panels.start(j) + d0 * w, w, c + (j - j0) * panels.panel, ldc, m, w,
              dn, d0 == 0 ? nullptr : ones, 1.0f});
    }
  }
}

// Writes zeros to `rows` rows of n elements of a view (row r at r * row_stride).
void zero_rows(const MutableView& v, DType dtype, int64_t offset, int64_t row_stride, int64_t rows,
               int64_t n) {
  const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    store_row(v.data, dtype, offset + r * row_stride, v.sd, n, zeros.data(), 1.0f);
  }
}

// The channels of one projected row: [kv (coff D) | score (coff D)].
int64_t row_width(const CompressorParams& p) { return 2 * p.coff * p.dim; }

// Lengths: each sequence's tokens, start and output rows.
std::vector<CompressorSequence> sequences_of(const CompressorParams& p) {
  if (p.packed && p.cu_seqlens == nullptr) {
    throw ArgumentError("cu_seqlens", "required when x is [T, H]");
  }
  if (!p.packed && p.cu_seqlens != nullptr) {
    throw ArgumentError("cu_seqlens", "only for x [T, H]; x [B, S, H] has S tokens per sequence");
  }
  const int64_t r = p.cmp_ratio;
  std::vector<CompressorSequence> seqs(static_cast<size_t>(p.batch));
  int64_t out = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    CompressorSequence& s = seqs[static_cast<size_t>(b)];
    s.batch = b;
    int64_t len = p.seq_len;
    if (p.packed) {
      const int64_t lo = p.cu_seqlens[b];
      const int64_t hi = p.cu_seqlens[b + 1];
      if ((b == 0 && lo != 0) || hi < lo || hi > p.tokens) {
        throw ArgumentError("cu_seqlens",
                            "expected offsets from 0 rising to at most T = " + str(p.tokens) +
                                ", got [" + str(b) + "] = " + str(lo) + ", [" + str(b + 1) +
                                "] = " + str(hi));
      }
      s.x_begin = lo;
      len = hi - lo;
    }
    s.tokens = len;
    if (p.seqused != nullptr) {
      s.tokens = p.seqused[b];
      if (s.tokens < 0 || s.tokens > len) {
        throw ArgumentError("seqused", "entry " + str(b) + " is " + str(s.tokens) +
                                           ", expected 0 to the sequence's " + str(len) +
                                           " tokens");
      }
    }
    if (p.start_pos != nullptr) {
      s.start = p.start_pos[b];
      if (s.start < 0 || s.start > kMaxTokens - len) {
        throw ArgumentError("start_pos", "entry " + str(b) + " is " + str(s.start) +
                                             ", expected 0 <= start_pos < " +
                                             str(kMaxTokens - len));
      }
      if (s.start > 0 && !p.has_state) {
        throw ArgumentError("start_pos",
                            "entry " + str(b) + " is " + str(s.start) +
                                ": earlier tokens of the sequence live in a state_cache, and "
                                "none was given");
      }
    }
    s.first_entry = s.start / r;
    s.entries = (s.start + s.tokens) / r - s.first_entry;
    s.out_begin = p.packed ? out : 0;
    out = p.packed ? out + s.entries : std::max(out, s.entries);
  }
  if (out > p.out_rows) {
    throw ArgumentError("cmp_kv",
                        "the call emits " + str(out) + " entries, cmp_kv holds " + str(p.out_rows));
  }
  return seqs;
}

// The state cache's block of position `pos` of a sequence, or -1 where the table has none.
int64_t block_of(const CompressorParams& p, const CompressorSequence& s, int64_t pos) {
  if (p.cache_mode == 2) return p.block_table[s.batch * p.table_width];
  const int64_t col = pos / p.block_size;
  return col < p.table_width ? p.block_table[s.batch * p.table_width + col] : -1;
}

float* state_row(const CompressorParams& p, const CompressorSequence& s, int64_t pos) {
  const int64_t block = block_of(p, s, pos);
  return static_cast<float*>(p.state.data) + block * p.state.sb + (pos % p.block_size) * p.state.ss;
}

void validate_state(const CompressorParams& p, const std::vector<CompressorSequence>& seqs) {
  if (p.state.sd != 1) {
    throw ArgumentError("state_cache", "its last dimension must be contiguous");
  }
  if (p.block_size < 1) {
    throw ArgumentError("state_cache",
                        "expected blocks of at least one slot, got " + str(p.block_size));
  }
  if (p.block_table == nullptr && p.batch > 0) {  // no sequences: no row to read
    throw ArgumentError("state_block_table", "required with a state_cache");
  }
  if (p.cache_mode == 2 && p.block_size < p.coff * p.cmp_ratio) {
    throw ArgumentError("state_cache",
                        "a ring buffer (cache_mode=2) keeps the last coff * cmp_ratio = " +
                            str(p.coff * p.cmp_ratio) + " positions: block_size " +
                            str(p.block_size) + " is too small");
  }
  for (int64_t i = 0; i < p.batch * p.table_width; ++i) {
    if (p.block_table[i] < 0 || p.block_table[i] >= p.num_blocks) {
      throw ArgumentError("state_block_table", "entry " + str(i) + " is " + str(p.block_table[i]) +
                                                   ", expected a block in [0, " +
                                                   str(p.num_blocks) + ")");
    }
  }
  for (const CompressorSequence& s : seqs) {
    const int64_t lo = first_state_position(p, s);
    const int64_t end = s.start + s.tokens;
    if (end > lo && block_of(p, s, end - 1) < 0) {
      throw ArgumentError("state_block_table", "sequence " + str(s.batch) + " reaches position " +
                                                   str(end - 1) + ", past its " +
                                                   str(p.table_width) + " blocks of " +
                                                   str(p.block_size));
    }
    for (int64_t pos = lo; pos < s.start; ++pos) {
      if (block_of(p, s, pos) == 0) {
        throw ArgumentError("state_block_table",
                            "sequence " + str(s.batch) + " reads position " + str(pos) +
                                " from the state cache, but its block is 0 (none)");
      }
    }
  }
}

// The call's tokens projected, one row [kv | score + ape] of row_width floats per token, and
// the place of each sequence's rows: computed here (rows, row r at r * ld) or the forward's
// (given, row r at given[r]).
struct Projected {
  AlignedBuffer<float> rows;
  int64_t ld = 0;
  std::vector<int64_t> first_row;  // per sequence
  int64_t count = 0;
  std::vector<const float*> given;
  const float* row(int64_t r) const {
    return given.empty() ? rows.data() + r * ld : given[static_cast<size_t>(r)];
  }
};

// ape widened, [r][coff D].
std::vector<float> widened_ape(const CompressorParams& p) {
  const int64_t n = p.coff * p.dim;
  std::vector<float> ape(static_cast<size_t>(p.cmp_ratio * n));
  for (int64_t k = 0; k < p.cmp_ratio; ++k) {
    load_row(p.ape.data, p.ape_dtype, k * p.ape.ss, p.ape.sd, n, ape.data() + k * n);
  }
  return ape;
}

// x's token rows the call uses, in sequence order: batch row, token row and position.
struct TokenRows {
  std::vector<int64_t> batch;
  std::vector<int64_t> token;
  std::vector<int64_t> position;
  int64_t offset(const MutableView& v, int64_t r) const {
    return batch[r] * v.sb + token[r] * v.ss;
  }
  int64_t offset(const View& v, int64_t r) const { return batch[r] * v.sb + token[r] * v.ss; }
};

TokenRows token_rows(const std::vector<CompressorSequence>& seqs, Projected& proj) {
  TokenRows t;
  for (const CompressorSequence& s : seqs) {
    proj.first_row.push_back(proj.count);
    for (int64_t i = 0; i < s.tokens; ++i) {
      t.batch.push_back(s.batch);
      t.token.push_back(s.x_begin + i);
      t.position.push_back(s.start + i);
    }
    proj.count += s.tokens;
  }
  return t;
}

// Row `row` of [wkv; wgate]: its tensor and the element it starts at.
std::pair<const View&, int64_t> weight_at(const CompressorParams& p, int64_t row) {
  const int64_t n = p.coff * p.dim;
  const View& w = row < n ? p.wkv : p.wgate;
  return {w, (row % n) * w.ss};
}

// Row `row` of [wkv; wgate] as floats.
void weight_row(const CompressorParams& p, int64_t row, float* out) {
  const auto [w, offset] = weight_at(p, row);
  load_row(w.data, p.dtype, offset, w.sd, p.hidden, out);
}

// The weights as the projection's operand B: [H along the depth][ld] in panels, column n' = row
// n' of [wkv; wgate].
AlignedBuffer<uint32_t> packed_weights(const CompressorParams& p, const Words& w,
                                       const Panels& panels, const Executor& ex) {
  AlignedBuffer<uint32_t> b = words(panels.depth * panels.ld);
  // 16 weight rows per task, each as A's words: column n' of B is row n' as A would hold it, so
  // each word along the depth goes to one cache line of B.
  constexpr int64_t kRows = 16;
  const int64_t width = row_width(p);
  run_dynamic(ex, (width + kRows - 1) / kRows, [&](int64_t task, int) {
    const int64_t r0 = task * kRows;
    const int64_t rows = std::min(kRows, width - r0);
    std::vector<uint32_t> tmp(static_cast<size_t>(rows * panels.depth), 0u);
    std::vector<float> scratch(static_cast<size_t>(p.hidden));
    for (int64_t r = 0; r < rows; ++r) {
      const auto [src, offset] = weight_at(p, r0 + r);
      w.load_row(src, p.dtype, offset, p.hidden, scratch.data(), tmp.data() + r * panels.depth);
    }
    for (int64_t d = 0; d < panels.depth; ++d) {
      uint32_t* dst = b.data() + panels.at(d, r0);
      for (int64_t r = 0; r < rows; ++r) dst[r] = tmp[static_cast<size_t>(r * panels.depth + d)];
    }
  });
  return b;
}

Projected project(const CompressorParams& p, const std::vector<CompressorSequence>& seqs,
                  const KernelSet& k, const Executor& ex) {
  Projected proj;
  const TokenRows t = token_rows(seqs, proj);
  proj.ld = round_up(row_width(p), 16);
  // The products write every element.
  proj.rows.grow_uninitialized(static_cast<size_t>(proj.count * proj.ld));
  if (proj.count == 0) return proj;
  const Words w(k);
  const int64_t hw = w.depth(p.hidden);
  const Panels panels{hw, proj.ld, k.gemm_cols};
  const AlignedBuffer<uint32_t> b = packed_weights(p, w, panels, ex);
  const std::vector<float> ape = widened_ape(p);
  const std::vector<float> ones(static_cast<size_t>(kRowBlock), 1.0f);
  const int64_t n = p.coff * p.dim;
  run_dynamic(ex, (proj.count + kRowBlock - 1) / kRowBlock, [&](int64_t task, int) {
    const kernels::WorkerScope scope(k);
    const int64_t r0 = task * kRowBlock;
    const int64_t m = std::min(kRowBlock, proj.count - r0);
    AlignedBuffer<uint32_t> a = words(w.rows(m) * hw);
    std::vector<float> tmp(static_cast<size_t>(p.hidden));
    for (int64_t r = 0; r < m; ++r) {
      w.load_row(p.x, p.dtype, t.offset(p.x, r0 + r), p.hidden, tmp.data(), a.data() + r * hw);
    }
    float* c = proj.rows.data() + r0 * proj.ld;
    product(k, a.data(), hw, b.data(), panels, c, proj.ld, m, ones.data(), 0, panels.count());
    for (int64_t r = 0; r < m; ++r) {
      const float* bias = ape.data() + (t.position[r0 + r] % p.cmp_ratio) * n;
      float* score = c + r * proj.ld + n;
      for (int64_t ch = 0; ch < n; ++ch) score[ch] += bias[ch];
      if (p.has_projections) {
        std::copy(c + r * proj.ld, c + r * proj.ld + 2 * n,
                  static_cast<float*>(p.projections.data) + t.offset(p.projections, r0 + r));
      }
    }
  });
  return proj;
}

// The forward's projections (p.has_projections) in the place of the computed ones.
Projected given_projections(const CompressorParams& p,
                            const std::vector<CompressorSequence>& seqs) {
  Projected proj;
  const TokenRows t = token_rows(seqs, proj);
  proj.ld = round_up(row_width(p), 16);
  proj.given.resize(static_cast<size_t>(proj.count));
  const float* base = static_cast<const float*>(p.projections.data);
  for (int64_t r = 0; r < proj.count; ++r) {
    proj.given[static_cast<size_t>(r)] = base + t.offset(p.projections, r);
  }
  return proj;
}

// One slot of an entry: a projected row (or the state's) and the channel its D values start at.
struct Slot {
  const float* row;
  int64_t channel;
  int64_t proj_row;  // the row in the projection, -1 for a state row
};

// The slots of entry w of sequence s.
void entry_slots(const CompressorParams& p, const CompressorSequence& s, int64_t seq_row,
                 const Projected& proj, int64_t w, std::vector<Slot>& slots) {
  slots.clear();
  const int64_t r = p.cmp_ratio;
  const auto add = [&](int64_t pos, int64_t channel) {
    if (pos >= s.start) {
      const int64_t row = seq_row + pos - s.start;
      slots.push_back({proj.row(row), channel, row});
    } else {
      slots.push_back({state_row(p, s, pos), channel, -1});
    }
  };
  if (p.coff == 2 && w >= 1) {
    for (int64_t j = 0; j < r; ++j) add((w - 1) * r + j, 0);
  }
  const int64_t channel = p.coff == 2 ? p.dim : 0;
  for (int64_t j = 0; j < r; ++j) add(w * r + j, channel);
}

// The softmax over an entry's slots per channel: max m, normaliser l and the entry out; `exps`
// (when not null) receives each slot's exp(score - m), D floats a slot.
void combine(const CompressorParams& p, const std::vector<Slot>& slots, float* m, float* l,
             float* out, float* exps) {
  const int64_t d = p.dim;
  const int64_t n = p.coff * p.dim;
  std::fill(m, m + d, -std::numeric_limits<float>::infinity());
  std::fill(l, l + d, 0.0f);
  std::fill(out, out + d, 0.0f);
  for (const Slot& s : slots) {
    const float* score = s.row + n + s.channel;
    for (int64_t c = 0; c < d; ++c) m[c] = std::max(m[c], score[c]);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const float* kv = slots[i].row + slots[i].channel;
    const float* score = slots[i].row + n + slots[i].channel;
    float* kept = exps != nullptr ? exps + static_cast<int64_t>(i) * d : nullptr;
    for (int64_t c = 0; c < d; ++c) {
      const float e = std::exp(score[c] - m[c]);
      l[c] += e;
      out[c] += e * kv[c];
      if (kept != nullptr) kept[c] = e;
    }
  }
  for (int64_t c = 0; c < d; ++c) out[c] /= l[c];
}

// Every entry of the call: (sequence, entry index).
struct EntryRef {
  int64_t seq;
  int64_t w;
};

std::vector<EntryRef> entries_of(const std::vector<CompressorSequence>& seqs) {
  std::vector<EntryRef> out;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int64_t e = 0; e < seqs[i].entries; ++e) {
      out.push_back({static_cast<int64_t>(i), seqs[i].first_entry + e});
    }
  }
  return out;
}

// One entry as each_entry hands it over: its sequence, its row of cmp_kv, its slots and their
// softmax per channel (max m, normaliser l, the entry's value out; D floats each; with `exps`,
// each slot's exp(score - m), D floats a slot, else null).
struct EntryWork {
  const CompressorSequence& seq;
  int64_t row;
  const std::vector<Slot>& slots;
  const float* m;
  const float* l;
  const float* out;
  const float* exps;
};

// Runs fn(EntryWork) for every entry of the call, in parallel.
template <class Fn>
void each_entry(const CompressorParams& p, const std::vector<CompressorSequence>& seqs,
                const Projected& proj, const Executor& ex, bool exps, Fn&& fn) {
  const std::vector<EntryRef> entries = entries_of(seqs);
  run_dynamic(ex, static_cast<int64_t>(entries.size()), [&](int64_t i, int) {
    const EntryRef& e = entries[static_cast<size_t>(i)];
    const CompressorSequence& s = seqs[static_cast<size_t>(e.seq)];
    std::vector<Slot> slots;
    entry_slots(p, s, proj.first_row[static_cast<size_t>(e.seq)], proj, e.w, slots);
    const int64_t kept = exps ? static_cast<int64_t>(slots.size()) * p.dim : 0;
    std::vector<float> buf(static_cast<size_t>(3 * p.dim + kept));
    float* e_kept = exps ? buf.data() + 3 * p.dim : nullptr;
    combine(p, slots, buf.data(), buf.data() + p.dim, buf.data() + 2 * p.dim, e_kept);
    fn(EntryWork{s, s.out_begin + e.w - s.first_entry, slots, buf.data(), buf.data() + p.dim,
                 buf.data() + 2 * p.dim, e_kept});
  });
}

// The products of the backward after dP (the gradients of each token's kv and score
// channels): x's and the weights' gradients.
struct Gradients {
  const CompressorParams& p;
  const KernelSet& k;
  Words w;
  const TokenRows& t;
  const AlignedBuffer<float>& dp;
  int64_t ld;     // dP's row stride
  int64_t count;  // tokens
  int64_t hp;     // H padded to 16

  // dx = dP [kv | score] . [wkv; wgate]: B is the weights, [2 coff D along the depth][hp].
  void inputs(const CompressorGrads& g, const Executor& ex) const {
    const int64_t width = row_width(p);
    const int64_t ww = w.depth(width);
    const Panels panels{ww, hp, k.gemm_cols};
    AlignedBuffer<uint32_t> b = words(ww * hp);
    run_dynamic(ex, ww, [&](int64_t word, int) {  // one task per word row: no word shared
      const int64_t row = word * w.per_word();
      if (row >= width) return;  // the depth's padding: zeros
      std::vector<float> tmp(static_cast<size_t>(2 * p.hidden));
      const auto [src, lo] = weight_at(p, row);
      const bool two_rows = w.per_word() == 2 && row + 1 < width;
      if (two_rows && &weight_at(p, row + 1).first != &src) {
        // Rows of wkv and wgate in one pair word (coff D odd): through floats.
        weight_row(p, row, tmp.data());
        weight_row(p, row + 1, tmp.data() + p.hidden);
        w.set_b_words(b.data(), panels, word, tmp.data(), tmp.data() + p.hidden, p.hidden);
        return;
      }
      const int64_t hi = two_rows ? weight_at(p, row + 1).second : -1;
      w.load_b_words(b.data(), panels, word, src, p.dtype, lo, hi, p.hidden, tmp.data());
    });
    const std::vector<float> ones(static_cast<size_t>(kRowBlock), 1.0f);
    run_dynamic(ex, (count + kRowBlock - 1) / kRowBlock, [&](int64_t task, int) {
      const kernels::WorkerScope scope(k);
      const int64_t r0 = task * kRowBlock;
      const int64_t m = std::min(kRowBlock, count - r0);
      AlignedBuffer<uint32_t> a = words(w.rows(m) * ww);
      for (int64_t r = 0; r < m; ++r)
        w.set_row(a.data() + r * ww, dp.data() + (r0 + r) * ld, width);
      AlignedBuffer<float> c;  // the product writes every element
      c.grow_uninitialized(static_cast<size_t>(m * hp));
      product(k, a.data(), ww, b.data(), panels, c.data(), hp, m, ones.data(), 0, panels.count());
      for (int64_t r = 0; r < m; ++r) {
        store_row(g.dx.data, p.dtype, t.offset(g.dx, r0 + r), g.dx.sd, p.hidden, c.data() + r * hp,
                  1.0f);
      }
    });
  }

  // [dwkv; dwgate] = dP^T . X: A is dP transposed [width][tokens along the depth], B the tokens
  // [tokens along the depth][hp].
  void weights(const CompressorGrads& g, const Executor& ex) const {
    const int64_t width = row_width(p);
    const int64_t n = p.coff * p.dim;
    const int64_t tw = w.depth(count);
    const Panels panels{tw, hp, k.gemm_cols};
    AlignedBuffer<uint32_t> xs = words(tw * hp);
    run_dynamic(ex, tw, [&](int64_t word, int) {  // one task per word row: no word shared
      const int64_t r = word * w.per_word();
      if (r >= count) return;  // the depth's padding: zeros
      std::vector<float> tmp(static_cast<size_t>(2 * p.hidden));
      const int64_t hi = r + 1 < count ? t.offset(p.x, r + 1) : -1;
      w.load_b_words(xs.data(), panels, word, p.x, p.dtype, t.offset(p.x, r), hi, p.hidden,
                     tmp.data());
    });
    AlignedBuffer<uint32_t> dpt = words(w.rows(width) * tw);
    // Tasks of 64 channels x kWords words of tokens: each reads its rows of dP in order, makes
    // 16 words of its channels at a time and writes them as one cache line a channel (a task's
    // words are its own).
    constexpr int64_t kChannels = 64;
    constexpr int64_t kWords = 128;
    const int64_t word_count = (count + w.per_word() - 1) / w.per_word();
    const int64_t word_blocks = (word_count + kWords - 1) / kWords;
    run_dynamic(ex, (width + kChannels - 1) / kChannels * word_blocks, [&](int64_t task, int) {
      const int64_t c0 = task / word_blocks * kChannels;
      const int64_t cn = std::min(kChannels, width - c0);
      const int64_t w1 = std::min(word_count, (task % word_blocks + 1) * kWords);
      alignas(64) uint32_t block[16][kChannels];
      float lo[kChannels], hi[kChannels];
      for (int64_t w0 = task % word_blocks * kWords; w0 < w1; w0 += 16) {
        const int64_t wn = std::min<int64_t>(16, w1 - w0);
        for (int64_t i = 0; i < wn; ++i) {
          const int64_t r = (w0 + i) * w.per_word();
          const float* a = dp.data() + r * ld + c0;
          const float* b = r + 1 < count ? a + ld : nullptr;
          if (cn < kChannels) {  // the last channels: a whole row of 64 from copies
            std::fill(lo, lo + kChannels, 0.0f);
            std::fill(hi, hi + kChannels, 0.0f);
            std::copy(a, a + cn, lo);
            if (b != nullptr) std::copy(b, b + cn, hi);
            a = lo;
            b = b != nullptr ? hi : nullptr;
          }
          w.pair_64(a, b, block[i]);
        }
        for (int64_t c = 0; c < cn; ++c) {
          uint32_t* dst = dpt.data() + (c0 + c) * tw + w0;
          for (int64_t i = 0; i < wn; ++i) dst[i] = block[i][c];
        }
      }
    });
    // Tasks of kWeightRows rows x kGroupColumns columns: a few row blocks alone would leave a
    // thread idle for much of the last one.
    const std::vector<float> ones(static_cast<size_t>(kWeightRows), 1.0f);
    const int64_t group = kGroupColumns / panels.panel;  // panels a task
    const int64_t groups = (panels.count() + group - 1) / group;
    run_dynamic(ex, (width + kWeightRows - 1) / kWeightRows * groups, [&](int64_t task, int) {
      const kernels::WorkerScope scope(k);
      const int64_t r0 = task / groups * kWeightRows;
      const int64_t m = std::min(kWeightRows, width - r0);
      const int64_t j0 = task % groups * group;
      const int64_t j1 = std::min(panels.count(), j0 + group);
      const int64_t col0 = j0 * panels.panel;
      const int64_t ldc = std::min(hp, j1 * panels.panel) - col0;
      AlignedBuffer<float> c;  // the product writes every element
      c.grow_uninitialized(static_cast<size_t>(m * ldc));
      product(k, dpt.data() + r0 * tw, tw, xs.data(), panels, c.data(), ldc, m, ones.data(), j0,
              j1);
      const int64_t cols = std::min(p.hidden, col0 + ldc) - col0;
      for (int64_t r = 0; r < m; ++r) {
        const int64_t row = r0 + r;
        const MutableView& dst = row < n ? g.dwkv : g.dwgate;
        store_row(dst.data, p.dtype, (row % n) * dst.ss + col0 * dst.sd, dst.sd, cols,
                  c.data() + r * ldc, 1.0f);
      }
    });
  }
};

void check_sizes(const CompressorParams& p) {
  if (p.coff != 1 && p.coff != 2) {
    throw ArgumentError("coff", "expected 1 or 2 (two overlapping series), got " + str(p.coff));
  }
  if (p.cmp_ratio < 1 || p.cmp_ratio > kMaxTokens) {
    throw ArgumentError("cmp_ratio", "expected a positive ratio, got " + str(p.cmp_ratio));
  }
  if (p.cache_mode != 1 && p.cache_mode != 2) {
    throw ArgumentError("cache_mode",
                        "expected 1 (continuous) or 2 (ring buffer), got " + str(p.cache_mode));
  }
  if (p.batch < 0 || p.batch > kMaxBatch || p.hidden < 0 || p.dim < 0 || p.dim > kMaxHeadDim) {
    throw ArgumentError("x", "unsupported sizes: batch " + str(p.batch) + ", hidden " +
                                 str(p.hidden) + ", D " + str(p.dim));
  }
}

}  // namespace

int64_t first_state_position(const CompressorParams& p, const CompressorSequence& s) {
  if (s.entries == 0) return s.start;
  const int64_t lo = std::max<int64_t>(0, (s.first_entry - (p.coff - 1)) * p.cmp_ratio);
  return std::min(lo, s.start);
}

std::vector<CompressorSequence> validate(const CompressorParams& p) {
  check_sizes(p);
  std::vector<CompressorSequence> seqs = sequences_of(p);
  if (p.has_state) validate_state(p, seqs);
  return seqs;
}

void compressor(const CompressorParams& p, const Executor& ex, Isa isa) {
  const std::vector<CompressorSequence> seqs = validate(p);
  const KernelSet& k = kernels::select_set(isa, p.dtype, -1, true);
  // Padding rows first: every row of cmp_kv, then the entries over them.
  if (p.packed) {
    zero_rows(p.cmp_kv, p.dtype, 0, p.cmp_kv.ss, p.out_rows, p.dim);
  } else {
    for (int64_t b = 0; b < p.batch; ++b) {
      zero_rows(p.cmp_kv, p.dtype, b * p.cmp_kv.sb, p.cmp_kv.ss, p.out_rows, p.dim);
    }
  }
  const Projected proj = project(p, seqs, k, ex);
  each_entry(p, seqs, proj, ex, false, [&](const EntryWork& e) {
    store_row(p.cmp_kv.data, p.dtype, e.seq.batch * p.cmp_kv.sb + e.row * p.cmp_kv.ss, p.cmp_kv.sd,
              p.dim, e.out, 1.0f);
  });
  if (!p.has_state) return;
  // The call's tokens into the state cache, in position order (a ring keeps the latest).
  const int64_t width = row_width(p);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const CompressorSequence& s = seqs[i];
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int64_t pos = s.start + t;
      if (block_of(p, s, pos) == 0) continue;  // block 0: not kept
      const float* src = proj.row(proj.first_row[i] + t);
      std::copy(src, src + width, state_row(p, s, pos));
    }
  }
}

void compressor_backward(const CompressorParams& p, const CompressorGrads& g, const Executor& ex,
                         Isa isa) {
  const std::vector<CompressorSequence> seqs = validate(p);
  for (const CompressorSequence& s : seqs) {
    if (first_state_position(p, s) < s.start) {
      throw ArgumentError("start_pos",
                          "sequence " + str(s.batch) + " compresses tokens before its start " +
                              str(s.start) +
                              " from the state cache, whose values have no gradient; the "
                              "backward needs every entry's tokens in x");
    }
  }
  const KernelSet& k = kernels::select_set(isa, p.dtype, -1, true);
  const int64_t n = p.coff * p.dim;
  // Gradients of tokens the call does not use (padding, past seqused) are zero; the products
  // write the others.
  const int64_t x_rows = p.packed ? p.tokens : p.seq_len;
  for (int64_t b = 0; b < (p.packed ? 1 : p.batch); ++b) {
    std::vector<char> used(static_cast<size_t>(x_rows), 0);
    for (const CompressorSequence& s : seqs) {
      if (p.packed || s.batch == b) std::fill_n(used.begin() + s.x_begin, s.tokens, 1);
    }
    for (int64_t r = 0; r < x_rows;) {
      int64_t end = r;
      while (end < x_rows && used[static_cast<size_t>(end)] == 0) ++end;
      zero_rows(g.dx, p.dtype, b * g.dx.sb + r * g.dx.ss, g.dx.ss, end - r, p.hidden);
      r = end + 1;
    }
  }
  const Projected proj = p.has_projections ? given_projections(p, seqs) : project(p, seqs, k, ex);
  // dP: per token row, the gradients of its kv and score channels.
  // Zero where no entry reads a token (its gradients stay zero).
  AlignedBuffer<float> dp =
      AlignedBuffer<float>::lazily_zeroed(static_cast<size_t>(proj.count * proj.ld));
  each_entry(p, seqs, proj, ex, true, [&](const EntryWork& e) {
    std::vector<float> grad_row(static_cast<size_t>(p.dim));
    float* grad = grad_row.data();
    const float *l = e.l, *out = e.out;
    load_row(g.d_cmp_kv.data, p.dtype, e.seq.batch * g.d_cmp_kv.sb + e.row * g.d_cmp_kv.ss,
             g.d_cmp_kv.sd, p.dim, grad);
    for (size_t i = 0; i < e.slots.size(); ++i) {
      const Slot& slot = e.slots[i];
      const float* kv = slot.row + slot.channel;
      const float* exps = e.exps + static_cast<int64_t>(i) * p.dim;
      float* dkv = dp.data() + slot.proj_row * proj.ld + slot.channel;
      float* dscore = dkv + n;
      for (int64_t c = 0; c < p.dim; ++c) {
        const float a = exps[c] / l[c];
        dkv[c] = grad[c] * a;
        dscore[c] = grad[c] * a * (kv[c] - out[c]);
      }
    }
  });
  if (proj.count == 0) {
    for (const auto& [v, rows, cols, dtype] :
         {std::tuple{g.dwkv, n, p.hidden, p.dtype}, std::tuple{g.dwgate, n, p.hidden, p.dtype},
          std::tuple{g.dape, p.cmp_ratio, n, p.ape_dtype}}) {
      zero_rows(v, dtype, 0, v.ss, rows, cols);
    }
    return;
  }
  Projected unused;
  const TokenRows t = token_rows(seqs, unused);
  const Gradients grads{p,  k,       Words(k),   t,
                        dp, proj.ld, proj.count, round_up(std::max<int64_t>(p.hidden, 1), 16)};
  grads.inputs(g, ex);
  grads.weights(g, ex);
  // dape[k] = the score gradients of the tokens at positions k mod r, summed in token order.
  run_dynamic(ex, p.cmp_ratio, [&](int64_t kk, int) {
    std::vector<float> sum(static_cast<size_t>(n), 0.0f);
    for (int64_t r = 0; r < proj.count; ++r) {
      if (t.position[r] % p.cmp_ratio != kk) continue;
      const float* ds = dp.data() + r * proj.ld + n;
      for (int64_t c = 0; c < n; ++c) sum[c] += ds[c];
    }
    store_row(g.dape.data, p.ape_dtype, kk * g.dape.ss, g.dape.sd, n, sum.data(), 1.0f);
  });
}

}  // namespace opmesh::core
