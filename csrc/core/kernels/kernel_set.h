// The kernel layer both operator families run on. A kernel set is everything one instruction set
// provides: the flash-attention micro-kernels (GEMM, online-softmax step, bf16 rounding, key
// packing), the indexer's score tile, the geometry its packed operands need, and per-worker
// setup and teardown. Each set lives in its own namespace and translation unit under isa/,
// compiled with that set's flags; the registry (registry.cpp) picks one at run time.
#pragma once

#include <cstdint>

#include "../cpu_features.h"
#include "../dtype.h"
#include "rows_ahead.h"

namespace opmesh::core::kernels {

// Keys per packed tile: one micro-kernel column block, and the unit of the planner's key work.
inline constexpr int64_t kKeyTile = 64;

// The 4-byte word packed operands hold: a float per element, or a pair of bf16 elements that are
// consecutive along the depth (the layout VDPBF16PS and AMX TDPBF16PS consume).
enum class Word : int { kFloat32 = 0, kBf16Pair = 1 };

// C[m][n] = alpha * A.B, or C = row_scale[r] * C + alpha * A.B when row_scale is given.
// A is row-major [m][lda] words; B is packed [depth][ldb] words with n a multiple of 16 and
// ldb >= n; C is float [m][ldc]. A must stay readable up to row round_up(m, row_align) and
// depth is a multiple of depth_align (the kernel set's geometry). `ahead`: rows the caller reads
// next, asked for from memory between the blocks of the product (rows_ahead.h; the AVX-512 and
// AMX sets; the others take no hint); empty for none.
struct GemmArgs {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
  int64_t m;
  int64_t n;
  int64_t depth;
  const float* row_scale;
  float alpha;
  RowsAhead ahead = {};
};

// Scores of a few query rows against kKeyTile key rows read where they lie (decode):
//   s[r][n] = alpha * sum_w query[r][w] . key_n[w]   for r < rows, n < kKeyTile,
// key n at keys + n * ldk words, `depth` words per row (no padding needed: words past depth are
// not read). The key rows are bf16 pairs; so is the query on a bf16-pair set, while a float32
// set takes float32 query rows of 2 * depth elements (ldq floats apart) and widens the keys in
// registers. `ahead`: rows the caller reads next, asked for from memory between the products
// (rows_ahead.h); empty for none.
struct KeyScoresArgs {
  const uint32_t* query;  // [rows][ldq] words
  int64_t ldq;
  const uint32_t* keys;
  int64_t ldk;
  float* s;  // [rows][lds]
  int64_t lds;
  int64_t rows;
  int64_t depth;
  float alpha;
  RowsAhead ahead = {};
};

// Decode's P.V from bf16 value rows read where they lie, with no packing:
//   o[r][e] = row_scale[r] o[r][e] + sum_i p[r][i] . (v[2i][e], v[2i + 1][e])
// for r < rows (at most 8), e < dv (a multiple of 32): p is [rows][ldp] words, P as bf16 pairs
// along the block's keys (softmax_bf16's probabilities); values[n] is the block's value row n
// (dv bf16 elements), null for a row past the keys (read as zeros); count (even) rows. Each
// output sums the same pair products in the same order as the pair GEMM on the values packed as
// key pairs (interleave_bf16), so the bits are the same. row_scale null: o = the sums.
// On a float32 set p is float32 probabilities ([rows][ldp] floats, any number of rows), each
// value row is widened in registers, and the sums are those of the float32 GEMM on the values
// packed. `ahead`: rows the caller reads next, asked for from memory between the products.
struct ValueRowsArgs {
  const uint32_t* p;
  int64_t ldp;
  const uint16_t* const* values;
  int64_t count;
  int64_t dv;
  float* o;
  int64_t ldo;
  const float* row_scale;
  int64_t rows;
  RowsAhead ahead = {};
};

// The indexer's tile: one packed key tile against the packed query rows of a task.
//   scores[r][j] += sum_h weights[r][h] * relu(dot(q[h][r], k[:, j]))
// for rows [row_begin, row_end); other rows of `scores` are left alone.
struct ScoreTileArgs {
  const void* query;     // [groups][row_capacity][depth] words; row r of head h at
                         //   query + (h * row_capacity + r) * depth
  int64_t row_capacity;  // rows allocated per head, a multiple of row_align
  const void* key;       // [depth][kKeyTile] words, keys past the sequence end zero-filled
  const float* weights;  // [rows][groups]
  float* scores;         // [row_capacity][kKeyTile]
  int row_begin;
  int row_end;
  int groups;     // query heads per key head
  int64_t depth;  // words per row, a multiple of depth_align; padding words are zero
};

// The element-wise row operations of flash attention and of the KL losses, on float32
// rows of kKeyTile entries unless a count is given (isa/row_ops.h writes them once; each set
// compiles them with its own flags).
struct RowOps {
  // Backward: s[r] <- s[r] - lse[r] where row r sees `key` (lo[r] <= key < hi[r]), else -inf.
  void (*shift_and_mask)(float* s, const float* lse, const int64_t* lo, const int64_t* hi,
                         int64_t key);
  // Backward: dp[r] <- p[r] (dp[r] - delta[r]).
  void (*probability_gradient)(const float* p, float* dp, const float* delta);
  // dst[i] += src[i], n entries.
  void (*add_into)(float* dst, const float* src, int64_t n);
  // dst += w relu(s).
  void (*relu_axpy)(float w, const float* s, float* dst);
  // c1 = [s > 0] q w, c2 = [s > 0] p w; a1 += sum q relu(s), a2 += sum p relu(s).
  void (*split_coefficients)(const float* s, const float* q, const float* p, float w, float* c1,
                             float* c2, float* a1, float* a2);
  // d <- keep (d - p inv).
  void (*target_gradient)(float* d, const float* p, float inv, float keep);
  // out = [s > 0] d w.
  void (*masked_scale)(const float* s, const float* d, float w, float* out);
  // out[c] = d[c] (bit `shift` of bytes[c] set ? w : 0): masked_scale's coefficients, the same
  // bits, from signs kept as bits (the sparse KL loss's second pass).
  void (*sign_scale)(const uint8_t* bytes, int shift, const float* d, float w, float* out);
  // Per row of a [rows][kKeyTile] tile: z += sum p, plogp += sum p log p over p > 0.
  void (*entropy_terms)(const float* p, int64_t rows, double* z, double* plogp);
  // out[r] += sum_c a[r][c] b[r][c] over a [rows][kKeyTile] pair of tiles.
  void (*row_dots)(const float* a, const float* b, int64_t rows, double* out);
  // out[c] = bf16(a[c]) | bf16(b[c]) << 16 (round to nearest even): rows a and b as one row of
  // bf16 pairs, the depth-paired operand of a product along their index.
  void (*pair_rows)(const float* a, const float* b, uint32_t* out);
  // Flash attention's score modifications on one row of scaled scores: with cap > 0,
  // s <- cap tanh(s / cap) and, when deriv is given, deriv <- 1 - tanh^2 (the softcap's
  // derivative); then, with slope != 0, s <- s - slope |dist0 + dir c| for entry c (ALiBi).
  void (*score_mods)(float* s, float cap, float slope, int64_t dist0, int64_t dir, float* deriv);
  // d[c] <- d[c] f[c].
  void (*multiply_into)(float* d, const float* f);
  // out[e] = a[e] | b[e] << 16 for n entries (b null: zeros): rows a and b of bf16 values as
  // one row of pairs, the operand of a product along the rows' index (values by key pairs).
  void (*interleave_bf16)(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* out);
  // lo[c] = x[c] - bf16(x[c]) (round to nearest even): what a row of float32 operands loses to
  // bf16, so that bf16(x) + bf16(lo) carries x to about 2^-17 relative in two pair products.
  void (*bf16_residual)(const float* x, float* lo);
  // One key's coefficients over n (1..64) heads as the pair operand of a product along the heads,
  // split as bf16_residual splits: with x[h] = d (bit h % 8 of bits[h / 8] set ? w[h] : 0) for
  // h < n and x[n] = 0, and p = (n + 1) / 2 pairs,
  //   out[l] = bf16(x[2l]) | bf16(x[2l + 1]) << 16,  out[p + l] the same of x - bf16(x),
  // for l < p: the bits sign_scale, pair_rows and bf16_residual give, with no [heads][keys] tile
  // between them.
  void (*sign_pairs)(const uint8_t* bits, int64_t n, const float* w, float d, uint32_t* out);
  // One key's row of the key pass's product when the group's weights are bf16 values: out[l] =
  // (bit 2l ? w[2l] : 0) | (bit 2l + 1 ? w[2l + 1] : 0) << 16 for l < (n + 1) / 2, with bit h
  // as sign_pairs reads it, w the weights' bf16 bits and w[n] read as 0 (n <= 64): the signs
  // select the weights, exactly, so one product (not two halves) carries them.
  void (*sign_weights)(const uint8_t* bits, int64_t n, const uint16_t* w, uint32_t* out);
  // dst[i] += a src[i] for n entries.
  void (*add_scaled)(float* dst, const float* src, float a, int64_t n);
  // The first pass's coefficients of one head as a product's pair operand over 64 keys: with
  // x[c] = [s[c] > 0] d[c] w (split_coefficients' c1), out[c] = bf16(x[c]) and out[64 + c] =
  // bf16(x[c] - bf16(x[c])) (round to nearest even), and *a += sum d relu(s) (its a1).
  void (*coefficient_halves)(const float* s, const float* d, float w, uint16_t* out, float* a);
  // out[c] = sum over h < heads (at most 64) of [s[h * ld + c] > 0] << h, for c < n: the signs
  // of a [heads][n] tile of scores as a word per column, bit h for row h (a NaN score: 0).
  void (*sign_words)(const float* s, int64_t ld, int64_t heads, int64_t n, uint64_t* out);
  // dst[i] = bf16(src[i] scale) (round to nearest even, NaN quietened) for n entries: a row of
  // float32 results stored as bf16, the same bits as the portable conversion (dtype.h).
  void (*store_bf16)(const float* src, float scale, int64_t n, uint16_t* dst);
  // The first c < n for which s[c] <= limit fails (s[c] NaN, or any c when limit is NaN), else n:
  // where a running top-K selection's cut-off test lets a score through.
  int64_t (*first_above)(const float* s, int64_t n, float limit);
  // dst[i] = quantized_to_float(src[i], format) for n entries, as float32 or as bf16: exact
  // (int8 and float8 e4m3 values have at most 8 significant bits), the rows of a quantized cache
  // as a decode computes on them, their scales applied to the scores and probabilities instead.
  void (*widen_quantized_f32)(const uint8_t* src, CacheFormat format, int64_t n, float* dst);
  void (*widen_quantized_bf16)(const uint8_t* src, CacheFormat format, int64_t n, uint16_t* dst);
  // p[c] <- bf16(p[c] f[c]) (round to nearest even) for n entries: a row of bf16 probabilities
  // times the value rows' scales.
  void (*scale_bf16)(uint16_t* p, const float* f, int64_t n);
  // dst[i] = quantized_to_float(src[i], format) * scale for n entries, as float32 or rounded to
  // bf16 (nearest even): a gathered row of a quantized cache, dequantized.
  void (*dequantize_f32)(const uint8_t* src, CacheFormat format, float scale, int64_t n,
                         float* dst);
  void (*dequantize_bf16)(const uint8_t* src, CacheFormat format, float scale, int64_t n,
                          uint16_t* dst);
};

struct KernelSet {
  const char* name;  // e.g. "avx512_bf16/pairs"
  Isa isa;
  Word word;
  // Geometry of the packed operands: depth (in words) is padded with zeros to a multiple of
  // depth_align, and row buffers are allocated to a multiple of row_align rows.
  int64_t depth_align;
  int64_t row_align;
  // Rows the GEMM and score tile compute at once (register block or tile height): the cost
  // model counts work in whole blocks.
  int64_t row_block;
  // Key tiles flash attention takes per online-softmax step (a divisor of the deterministic
  // split, 16) for a sequence of several query tiles or of one key head: more amortise each
  // step's fixed costs over more keys (the rows' maximum, sum and correction, the output's
  // rescaling, a product's epilogue, which AMX tiles take through memory). 4 on every set: a
  // 128-row step's scores and probabilities stay within an L2 of 1 MiB beside its key and value
  // tiles. (Decode with several key heads: decode_block_tiles.)
  int64_t block_tiles;
  // Called by each worker thread before its first kernel call of an operator run and after its
  // last (e.g. to load and release a tile configuration); either may be null.
  void (*begin_worker)();
  void (*end_worker)();

  // Flash attention.
  void (*gemm)(const GemmArgs& args);
  // One online-softmax step over `rows` rows of `cols` scores s (row-major, cols a multiple of
  // kKeyTile; masked entries are -inf):
  //   m_new = max(m, max_j s_j);  s_j <- exp(s_j - m_new);  correction = exp(m - m_new);
  //   l <- l * correction + sum_j s_j;  m <- m_new.
  // A row whose m_new is -inf (nothing visible yet) gets s = 0 and correction = 1. A NaN score
  // makes the row's m, l and s NaN.
  void (*softmax)(float* s, int64_t rows, int64_t cols, float* m, float* l, float* correction);
  // s[r][c] <- exp(s[r][c] - shift[r]) for `rows` rows of `cols` (a multiple of 16) scores, the
  // probabilities of flash attention's backward (shift: the log-sum-exp, s <= shift up to
  // rounding; -inf scores and a +inf shift give 0).
  void (*exp_rows)(float* s, int64_t rows, int64_t cols, const float* shift);
  // float -> bf16 with round-to-nearest-even; set for bf16-pair sets only.
  void (*to_bf16)(const float* src, uint16_t* dst, int64_t n);
  // Key-tile packing, a transpose of 4-byte words: kp[d][n] = word d of rows[n] for the first
  // `valid` of kKeyTile rows, 0 for the others; `words` words per row.
  void (*pack_keys)(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp);

  // The lightning indexer.
  void (*score_tile)(const ScoreTileArgs& args);

  // Packing: n contiguous elements of `dtype` to float32, exactly (fp16 and bf16 widen without
  // rounding; float64 rounds to nearest). Used for rows with unit stride.
  void (*widen)(const void* src, DType dtype, int64_t n, float* dst);

  // Flash attention's backward and the KL losses.
  RowOps rows;

  // softmax over the scores scale * s (scale > 0; s as the product left it, unscaled), with the
  // probabilities rounded to bf16 into p16 ([rows][cols], the P.V product's operand) instead of
  // written back to s; m, l and correction are those of the scaled scores. Set for bf16-pair
  // sets only.
  void (*softmax_bf16)(float* s, int64_t rows, int64_t cols, float scale, float* m, float* l,
                       float* correction, uint16_t* p16);

  // Decode's scores from bf16 key rows in place, one dot product per (row, key) along the depth;
  // null where the set has none (flash attention then runs its GEMM on the keys as rows and
  // transposes, on a pair set, or packs the keys). `key_scores_rows` is the most rows it beats
  // that GEMM for (measured); a float32 set, which has no such GEMM, takes every decode's 16. A
  // row's scores never depend on the other rows' values. A float32 set sums them in one order for
  // any row count; avx512_bf16/pairs sums one or two rows in 16-lane trees and three to eight in
  // lane groups, another order (and faster: 8/1 heads' decode ran about 30% slower in the trees).
  void (*key_scores)(const KeyScoresArgs& args);
  int64_t key_scores_rows;

  // Key-tile packing of rows of `n` elements of `dtype` (unit stride) as float32 words, each
  // element converted as widen does: kp[d][r] = float(rows[r][d]) for the first `valid` of
  // kKeyTile rows, 0 for the others. The conversion and the transpose in one pass, with no
  // staging copy. `ahead`: rows asked for from memory meanwhile (rows_ahead.h), empty for none.
  // Set for float32 sets only.
  void (*pack_widened_keys)(const char* const* rows, int64_t valid, DType dtype, int64_t n,
                            const RowsAhead& ahead, uint32_t* kp);

  // Decode's P.V on bf16 value rows in place (ValueRowsArgs), beside key_scores; null where the
  // set has none (flash attention then packs the value tiles for its GEMM).
  void (*value_rows)(const ValueRowsArgs& args) = nullptr;

  // gemm with A's rows gathered: row r of A at a_rows[r] (args.a and args.lda unused), the same
  // products in the same order as gemm on those rows copied into one matrix, so the same bits.
  // Null where the set has none (the sparse operators then copy the rows first).
  void (*gemm_rows)(const void* const* a_rows, const GemmArgs& args) = nullptr;

  // block_tiles for a sequence of one query tile (decode, short sequences) with more than one key
  // head, whose units may run key heads side by side over whole rows of the cache (with one key
  // head, block_tiles applies): 1 where the set's products need no longer blocks, since a longer
  // block times the heads side by side, and the next block's rows asked for meanwhile, would no
  // longer fit the L2 cache (one token, 32/8 heads, 8 x 8192 keys from memory on Zen 4: 4 tiles a
  // step ran 2x slower than 1; 64/8 heads, 4 tiles 6% slower).
  int64_t decode_block_tiles = 1;

  // The most rows (a decode sequence's positions times its group) for which value_rows beats
  // the GEMM on the values packed (measured): on AVX2, 8 (8/1 heads: two blocks of 4 rows that
  // each widen every value row, 16 columns a load; 5% faster than packing on an AVX2-only Zen 1,
  // where widening each 8 columns on its own had tied with packing).
  int64_t value_rows_rows = 16;

  // The columns of B the GEMM takes at a time (its register block's width): a B operand packed
  // by a caller in panels of this width is read in order. On AVX2, 16 (two ymm); a wider panel
  // puts each depth step of a 16-column pass 4 lines apart (the compressor's float32 products on
  // a Zen 4 held to AVX2, B 16 MiB: 74% of FMA's peak in panels of 64, 86% in panels of 16).
  int64_t gemm_cols = 64;

  // What the set accepts: input dtypes it computes (after packing into its word type).
  bool accepts(DType dtype) const { return word == Word::kFloat32 || dtype == DType::kBFloat16; }
};

// Every set built into this library that can run on this machine now, lowest level first.
// (The amx_bf16 set appears with the tile implementation amx_tiles() selects.)
int available_sets(const KernelSet** out, int capacity);

// The set for a level and word type, or nullptr when that combination is not built or cannot
// run here (bf16 pairs below avx512_bf16, amx_bf16 without tiles).
const KernelSet* find_set(Isa isa, Word word);

// The float32 set a level falls back to (amx_bf16 and avx512_bf16 use the avx512 one).
const KernelSet& float32_set(Isa isa);

// The set a call with inputs of `dtype` at level `isa` runs on. bf16 inputs at avx512_bf16 and
// above take the level's bf16-pair set when `bf16_pairs` is 1, float32 FMA when 0, and when -1
// whichever kernel_choice measured faster for `compute_bound` work.
const KernelSet& select_set(Isa isa, DType dtype, int bf16_pairs, bool compute_bound);

// Runs begin_worker / end_worker around a scope.
class WorkerScope {
 public:
  explicit WorkerScope(const KernelSet& set) : set_(set) {
    if (set_.begin_worker != nullptr) set_.begin_worker();
  }
  ~WorkerScope() {
    if (set_.end_worker != nullptr) set_.end_worker();
  }
  WorkerScope(const WorkerScope&) = delete;
  WorkerScope& operator=(const WorkerScope&) = delete;

 private:
  const KernelSet& set_;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace opmesh::core::kernels
