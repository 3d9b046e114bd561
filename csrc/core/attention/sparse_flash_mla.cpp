#include "sparse_flash_mla.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "../errors.h"
#include "../selection.h"
#include "sparse_attention_detail.h"

namespace opmesh::core {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// The argument names of one side: the query's or one of the two key tensors'.
struct Names {
  const char* tensor;
  const char* cu;
  const char* used;
  const char* table;
  const char* indices;
  const char* topk_length;
  const char* mask_mode;
  const char* win_left;
  const char* win_right;
  const char* scale;
};

constexpr Names kQueryNames{"q", "cu_seqlens_q", "seqused_q", "", "", "", "", "", "", ""};
constexpr Names kOriNames{"ori_kv",          "cu_seqlens_ori_kv",  "seqused_ori_kv",
                          "ori_block_table", "ori_sparse_indices", "ori_topk_length",
                          "ori_mask_mode",   "ori_win_left",       "ori_win_right",
                          "ori_kv_scale"};
constexpr Names kCmpNames{"cmp_kv",
                          "cu_seqlens_cmp_kv",
                          "seqused_cmp_kv",
                          "cmp_block_table",
                          "cmp_sparse_indices",
                          "cmp_topk_length",
                          "cmp_mask_mode",
                          "",
                          "",
                          "cmp_kv_scale"};

// One side's token ranges per sequence, from its layout, token count and length arrays.
struct Span {
  int64_t begin = 0;
  int64_t len = 0;
};

std::vector<Span> resolve(const Names& n, Layout layout, int64_t seq, const int64_t* cu,
                          const int64_t* used, int64_t batch) {
  std::vector<Span> out(batch);
  if (layout == Layout::kTND) {
    if (cu == nullptr) throw ArgumentError(n.cu, "is required with the TND layout");
    if (cu[0] != 0) throw ArgumentError(n.cu, "must start at 0, got " + str(cu[0]));
    for (int64_t b = 0; b < batch; ++b) {
      if (cu[b + 1] < cu[b]) {
        throw ArgumentError(n.cu, "must be non-decreasing, but entry " + str(b + 1) + " is " +
                                      str(cu[b + 1]) + " after " + str(cu[b]));
      }
      out[b] = {cu[b], cu[b + 1] - cu[b]};
    }
    if (cu[batch] != seq) {
      throw ArgumentError(n.cu, "last entry " + str(cu[batch]) + " must equal " + n.tensor +
                                    "'s token count " + str(seq));
    }
  } else {
    if (cu != nullptr) throw ArgumentError(n.cu, "is only accepted with the TND layout");
    if (layout == Layout::kPagedBBND && used == nullptr && batch > 0) {
      throw ArgumentError(n.used, "is required with the paged layout PA_BBND");
    }
    for (Span& s : out) s.len = layout == Layout::kPagedBBND ? kMaxTokens : seq;
  }
  if (used == nullptr) return out;
  for (int64_t b = 0; b < batch; ++b) {
    if (used[b] < 0 || used[b] > out[b].len) {
      throw ArgumentError(n.used, "entry " + str(b) + " is " + str(used[b]) + ", expected [0, " +
                                      str(out[b].len) + "]");
    }
    out[b].len = used[b];
  }
  return out;
}

void check_paged(const Names& n, const MlaKeys& k, const std::vector<Span>& spans) {
  if (k.block_table == nullptr) return;  // a plan's sequences: no table to check
  if (k.block_size < 1) throw ArgumentError(n.tensor, "block size must be >= 1");
  for (size_t b = 0; b < spans.size(); ++b) {
    const int64_t blocks = (spans[b].len + k.block_size - 1) / k.block_size;
    if (blocks > k.max_blocks) {
      throw ArgumentError(n.used, "entry " + str(b) + " is " + str(spans[b].len) + ", more than " +
                                      n.table + " holds (" + str(k.max_blocks) + " blocks of " +
                                      str(k.block_size) + ")");
    }
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t block = k.block_table[b * k.max_blocks + i];
      if (block < 0 || block >= k.block_count) {
        throw ArgumentError(n.table, "entry [" + str(b) + ", " + str(i) + "] is " + str(block) +
                                         ", expected a block in [0, " + str(k.block_count) + ")");
      }
    }
  }
}

void check_mask(const Names& n, const MlaKeys& k, bool windows) {
  const int64_t mode = static_cast<int64_t>(k.mask_mode);
  if (k.mask_mode != MaskMode::kNone && k.mask_mode != MaskMode::kCausal &&
      !(windows && k.mask_mode == MaskMode::kWindow)) {
    throw ArgumentError(n.mask_mode, std::string("must be 0 (none) or 3 (causal)") +
                                         (windows ? " or 4 (window)" : "") + ", got " + str(mode));
  }
  if (!windows) return;
  for (const auto& [value, name] :
       {std::pair{k.win_left, n.win_left}, {k.win_right, n.win_right}}) {
    if (value < -1 || value >= kMaxTokens) {
      throw ArgumentError(name, "must be -1 (unbounded) or a count >= 0, got " + str(value));
    }
    if (value != -1 && k.mask_mode != MaskMode::kWindow) {
      throw ArgumentError(name, "must be -1 unless " + std::string(n.mask_mode) + "=4, got " +
                                    str(value) + " with " + n.mask_mode + "=" + str(mode));
    }
  }
}

Mask mask_of(const MlaKeys& k, int64_t ratio) {
  return Mask{k.mask_mode, k.mask_mode == MaskMode::kWindow ? k.win_left : -1,
              k.mask_mode == MaskMode::kWindow ? k.win_right : -1, ratio};
}

Selection selection_of(const Names& n, const MlaKeys& k, const SparseFlashMlaParams& p) {
  Selection sel;
  sel.indices = k.indices;
  sel.heads = p.heads_kv;
  sel.count = k.topk;
  sel.tnd = p.layout_q == Layout::kTND;
  sel.name = n.indices;
  sel.lengths = k.topk_length;
  sel.lengths_name = n.topk_length;
  return sel;
}

void check_options(const SparseFlashMlaParams& p) {
  if (p.layout_q != Layout::kBSND && p.layout_q != Layout::kTND) {
    throw ArgumentError("layout_q",
                        std::string("must be BSND or TND, got ") + layout_name(p.layout_q));
  }
  if (p.layout_kv != p.layout_q && p.layout_kv != Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", std::string("must equal layout_q (") +
                                         layout_name(p.layout_q) + ") or be PA_BBND, got " +
                                         layout_name(p.layout_kv));
  }
  if (!p.ori.present && !p.cmp.present) {
    throw ArgumentError("ori_kv", "and cmp_kv are both absent: a call needs at least one");
  }
  const char* kv = p.ori.present ? "ori_kv" : "cmp_kv";
  if (p.heads_q < 1 || p.heads_q > kMaxHeads) {
    throw ArgumentError("q",
                        "head count must be in [1, " + str(kMaxHeads) + "], got " + str(p.heads_q));
  }
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0) {
    throw ArgumentError(
        kv, "head count must divide q's " + str(p.heads_q) + ", got " + str(p.heads_kv));
  }
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    throw ArgumentError(
        "q", "head dim must be in [1, " + str(kMaxHeadDim) + "], got " + str(p.head_dim));
  }
  if (p.batch < 0 || p.batch > kMaxBatch) throw ArgumentError("q", "batch out of range");
  check_mask(kOriNames, p.ori, true);
  check_mask(kCmpNames, p.cmp, false);
  if (p.cmp_ratio < 1 || p.cmp_ratio > kMaxTokens) {
    throw ArgumentError("cmp_ratio", "must be >= 1, got " + str(p.cmp_ratio));
  }
  if (p.cmp_residuals != nullptr) {
    if (!p.cmp.present || p.cmp.mask_mode != MaskMode::kCausal || p.cmp_ratio == 1) {
      throw ArgumentError("cmp_residual_kv",
                          "is only accepted with cmp_kv, cmp_mask_mode=3 and cmp_ratio > 1");
    }
    for (int64_t b = 0; b < p.batch; ++b) {
      if (p.cmp_residuals[b] < 0 || p.cmp_residuals[b] >= p.cmp_ratio) {
        throw ArgumentError("cmp_residual_kv", "entry " + str(b) + " is " +
                                                   str(p.cmp_residuals[b]) + ", expected [0, " +
                                                   str(p.cmp_ratio) + ")");
      }
    }
  }
  for (const auto& [k, n] : {std::pair{&p.ori, &kOriNames}, {&p.cmp, &kCmpNames}}) {
    if (k->indices.data != nullptr && !k->present) {
      throw ArgumentError(n->indices, std::string("is given without ") + n->tensor);
    }
    if (k->topk_length.data != nullptr && k->indices.data == nullptr) {
      throw ArgumentError(n->topk_length, std::string("is given without ") + n->indices);
    }
    if (k->topk < 0) throw ArgumentError(n->indices, "negative K");
    if (k->format == CacheFormat::kPlain) continue;
    if (k->format != CacheFormat::kInt8 && k->format != CacheFormat::kFp8E4M3) {
      throw ArgumentError(n->tensor, "is not in a cache format");
    }
    // An empty kv's scales may have no storage: no row of it is ever read.
    const bool rows =
        p.batch > 0 && (p.layout_kv == Layout::kPagedBBND ? k->block_count > 0 : k->seq > 0);
    if (k->scale.data == nullptr && rows) {
      throw ArgumentError(n->scale, "is null (a quantized kv)");
    }
    if (k->kv.sd != 1) throw ArgumentError(n->tensor, "a quantized kv needs unit stride along D");
  }
}

// Sequences of one key side: the query's spans with that side's keys.
std::vector<Sequence> side_sequences(const SparseFlashMlaParams& p, const std::vector<Span>& q,
                                     const Names& n, const MlaKeys& k, bool residuals) {
  std::vector<Sequence> out(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    out[b].batch = b;
    out[b].q_begin = q[b].begin;
    out[b].q_len = q[b].len;
  }
  if (!k.present) return out;
  const std::vector<Span> spans = resolve(n, p.layout_kv, k.seq, k.cu_seqlens, k.seqused, p.batch);
  if (p.layout_kv == Layout::kPagedBBND) check_paged(n, k, spans);
  for (int64_t b = 0; b < p.batch; ++b) {
    out[b].k_begin = p.layout_kv == Layout::kPagedBBND ? 0 : spans[b].begin;
    out[b].k_len = spans[b].len;
    if (residuals && p.cmp_residuals != nullptr) out[b].residual = p.cmp_residuals[b];
  }
  return out;
}

}  // namespace

MlaSequences sparse_flash_mla_sequences(const SparseFlashMlaParams& p) {
  const std::vector<Span> q =
      resolve(kQueryNames, p.layout_q, p.seq_q, p.cu_seqlens_q, p.seqused_q, p.batch);
  return {side_sequences(p, q, kOriNames, p.ori, false),
          side_sequences(p, q, kCmpNames, p.cmp, true)};
}

void validate(const SparseFlashMlaParams& p) {
  check_options(p);
  const MlaSequences seqs = sparse_flash_mla_sequences(p);
  if (p.ori.indices.data != nullptr) validate(selection_of(kOriNames, p.ori, p), seqs.ori);
  if (p.cmp.indices.data != nullptr) validate(selection_of(kCmpNames, p.cmp, p), seqs.cmp);
}

namespace {

// A row's keys: ori_kv's (source 0) then cmp_kv's (source 1), each within its mask, all of them
// or its selection's.
class MlaKeySelector final : public sparse::KeySelector {
 public:
  MlaKeySelector(const SparseFlashMlaParams& p, const MlaSequences& seqs,
                 const SparseFlashMlaGrads* grads = nullptr)
      : p_(p),
        seqs_(seqs),
        grads_(grads),
        sides_{&p.ori, &p.cmp},
        masks_{mask_of(p.ori, 1), mask_of(p.cmp, p.cmp_ratio)},
        sources_{source_of(p.ori), source_of(p.cmp)},
        selections_{selection_of(kOriNames, p.ori, p), selection_of(kCmpNames, p.cmp, p)} {}

  int num_sources() const override { return 2; }
  const sparse::KeySource& source(int k) const override { return sources_[k]; }
  const std::vector<Sequence>& key_sequences(int k) const override {
    return k == 0 ? seqs_.ori : seqs_.cmp;
  }

  void select(const Sequence& s, int64_t i, int64_t g, const sparse::KeyWindow* window,
              std::vector<sparse::KeyRef>& out) const override {
    out.clear();
    for (int k = 0; k < 2; ++k) {
      const MlaKeys& side = *sides_[k];
      if (!side.present) continue;
      const Sequence& ks = key_sequences(k)[s.batch];
      KeyRange vis = visible_keys(masks_[k], ks, i);
      if (window != nullptr) vis = window->cut(k, vis);
      if (vis.end <= vis.begin) continue;
      auto add = [&](int64_t j) {
        const int64_t at = sparse::key_row_offset(side.kv, p_.layout_kv, ks, j, g, side.block_table,
                                                  side.max_blocks, side.block_size);
        out.push_back({k, static_cast<int32_t>(j), at, 0, at});
        if (side.format != CacheFormat::kPlain) {
          const float scale = static_cast<const float*>(side.scale.data)[sparse::key_row_offset(
              side.scale, p_.layout_kv, ks, j, g, side.block_table, side.max_blocks,
              side.block_size)];
          out.back().key_scale = out.back().value_scale = scale;
        }
      };
      if (side.indices.data == nullptr) {
        for (int64_t j = vis.begin; j < vis.end; ++j) add(j);
        continue;
      }
      const View& st = side.indices;
      const int64_t base =
          (p_.layout_q == Layout::kTND ? 0 : s.batch * st.sb) + (s.q_begin + i) * st.ss + g * st.sn;
      sparse::each_selected(static_cast<const int32_t*>(st.data), base, st.sd,
                            selections_[k].row_count(s, i, g), 1, vis, add);
    }
  }

  bool may_select(const Sequence& s, int64_t i, int k, int64_t j0, int64_t j1) const override {
    const KeyRange vis = visible_keys(masks_[k], key_sequences(k)[s.batch], i);
    return vis.end > vis.begin && vis.end > j0 && vis.begin < j1;
  }

  // Shared key/value: the row's gradient is the sum of its key and value parts.
  void store_grads(const kernels::KernelSet& set, int k, const Sequence& ks, int64_t j, int64_t g,
                   const float* dkey, const float* dvalue) const override {
    const MlaKeys& side = *sides_[k];
    const int64_t token = p_.layout_kv == Layout::kTND ? ks.k_begin + j : ks.batch * side.seq + j;
    float sum[kMaxHeadDim];
    for (int64_t e = 0; e < p_.head_dim; ++e) sum[e] = dkey[e] + dvalue[e];
    store_row(set, k == 0 ? grads_->d_ori_kv : grads_->d_cmp_kv, p_.dtype,
              (token * p_.heads_kv + g) * p_.head_dim, 1, p_.head_dim, sum, 1.0f);
  }

 private:
  // Shared key/value: one view (and one scale) read as both.
  static sparse::KeySource source_of(const MlaKeys& k) {
    return {k.kv, {}, k.kv, k.format, k.scale, k.scale};
  }

  const SparseFlashMlaParams& p_;
  const MlaSequences& seqs_;
  const SparseFlashMlaGrads* grads_;
  const MlaKeys* sides_[2];
  Mask masks_[2];
  sparse::KeySource sources_[2];
  Selection selections_[2];
};

// The shared kernels' params: the query side, shared key/value dims, sinks and outputs.
SparseAttentionParams kernel_params(const SparseFlashMlaParams& p) {
  SparseAttentionParams k;
  k.layout_query = p.layout_q;
  k.batch = p.batch;
  k.seq_q = p.seq_q;
  k.heads_q = p.heads_q;
  k.heads_k = p.heads_kv;
  k.head_dim = p.head_dim;
  k.value_dim = p.head_dim;
  k.scale = p.scale;
  k.dtype = p.dtype;
  k.query = p.q;
  k.sinks = p.sinks;
  k.out = p.out;
  k.softmax_lse = p.softmax_lse;
  return k;
}

int64_t rows_of(Layout layout, int64_t batch, int64_t seq) {
  return layout == Layout::kTND ? seq : batch * seq;
}

}  // namespace

Mask ori_mask(const SparseFlashMlaParams& p) { return mask_of(p.ori, 1); }
Mask cmp_mask(const SparseFlashMlaParams& p) { return mask_of(p.cmp, p.cmp_ratio); }

void sparse_flash_mla(const SparseFlashMlaParams& p, const Executor& executor, Isa isa,
                      const sparse::TokenSchedule* schedule) {
  validate(p);
  const MlaSequences seqs = sparse_flash_mla_sequences(p);
  const MlaKeySelector keys(p, seqs);
  sparse::sparse_forward(kernel_params(p), keys, seqs.ori, executor, isa, schedule);
}

void sparse_flash_mla_backward(const SparseFlashMlaParams& p, const SparseFlashMlaGrads& gr,
                               const Executor& executor, Isa isa) {
  if (p.layout_kv == Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", "PA_BBND (paged keys) has no backward");
  }
  for (const auto& [k, name] : {std::pair{&p.ori, "ori_kv_scale"}, {&p.cmp, "cmp_kv_scale"}}) {
    if (k->format != CacheFormat::kPlain) {
      throw ArgumentError(name, "a quantized kv has no backward");
    }
  }
  validate(p);
  const int64_t width = p.heads_kv * p.head_dim;
  const MlaSequences seqs = sparse_flash_mla_sequences(p);
  // Rows no pass reaches (past a length) are zero; the passes write every other one.
  sparse::zero_unwritten_rows(gr.dq, p.dtype, rows_of(p.layout_q, p.batch, p.seq_q),
                              p.heads_q * p.head_dim,
                              sparse::written_rows(seqs.ori, p.layout_q, p.seq_q, false));
  for (const auto& [side, d, kseqs] :
       {std::tuple{&p.ori, gr.d_ori_kv, &seqs.ori}, std::tuple{&p.cmp, gr.d_cmp_kv, &seqs.cmp}}) {
    if (!side->present) continue;
    sparse::zero_unwritten_rows(d, p.dtype, rows_of(p.layout_kv, p.batch, side->seq), width,
                                sparse::written_rows(*kseqs, p.layout_kv, side->seq, true));
  }
  const MlaKeySelector keys(p, seqs, &gr);
  sparse::sparse_backward(kernel_params(p), gr, keys, seqs.ori, executor, isa);
}

}  // namespace opmesh::core
