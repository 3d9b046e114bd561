#include "mla_plan.h"

#include <algorithm>
#include <string>
#include <utility>

#include "../errors.h"

namespace opmesh::core::mla_plan {
namespace {

using plan_words::bits_float;
using plan_words::float_bits;

std::string str(int64_t v) { return std::to_string(v); }

// The header's words after the four every plan starts with (plan_words.h).
enum Field : int {
  kFieldHeadsQ = plan_words::kHeaderStart,
  kFieldHeadsKv,
  kFieldHeadDim,
  kFieldBatch,
  kFieldMaxQ,
  kFieldMaxOri,
  kFieldMaxCmp,
  kFieldOriTopk,
  kFieldCmpTopk,
  kFieldCmpRatio,
  kFieldOriMask,
  kFieldCmpMask,
  kFieldWinLeft,
  kFieldWinRight,
  kFieldLayoutQ,
  kFieldLayoutKv,
  kFieldHasOri,
  kFieldHasCmp,
  kFieldRows,
  kFieldPrints,  // kArrays x (present, hash low, hash high)
  kFieldMakespan = kFieldPrints + 3 * kArrays,
  kFieldLowerBound,
  kFieldTotalCost,
  kHeaderWords
};
constexpr int64_t kWorkerWords = 5;

// A unit's fixed work in keys' worth: its G query rows packed and its G output rows written
// (about one key's G x D products each), and its selection read.
constexpr int64_t kRowOverheadKeys = 4;

// The fields a call must match, by argument name, in header order.
struct Named {
  const char* name;
  Field field;
  int64_t Config::* member;
};
constexpr Named kNamed[] = {
    {"num_heads_q", kFieldHeadsQ, &Config::num_heads_q},
    {"num_heads_kv", kFieldHeadsKv, &Config::num_heads_kv},
    {"head_dim", kFieldHeadDim, &Config::head_dim},
    {"batch_size", kFieldBatch, &Config::batch_size},
    {"max_seqlen_q", kFieldMaxQ, &Config::max_seqlen_q},
    {"max_seqlen_ori_kv", kFieldMaxOri, &Config::max_seqlen_ori_kv},
    {"max_seqlen_cmp_kv", kFieldMaxCmp, &Config::max_seqlen_cmp_kv},
    {"ori_topk", kFieldOriTopk, &Config::ori_topk},
    {"cmp_topk", kFieldCmpTopk, &Config::cmp_topk},
    {"cmp_ratio", kFieldCmpRatio, &Config::cmp_ratio},
    {"ori_mask_mode", kFieldOriMask, &Config::ori_mask_mode},
    {"cmp_mask_mode", kFieldCmpMask, &Config::cmp_mask_mode},
    {"ori_win_left", kFieldWinLeft, &Config::ori_win_left},
    {"ori_win_right", kFieldWinRight, &Config::ori_win_right},
};

// The sizes a configuration and the params both hold: (the configuration's, the params').
using Params = SparseFlashMlaParams;
constexpr std::pair<int64_t Config::*, int64_t Params::*> kSameSizes[] = {
    {&Config::num_heads_q, &Params::heads_q}, {&Config::num_heads_kv, &Params::heads_kv},
    {&Config::head_dim, &Params::head_dim},   {&Config::batch_size, &Params::batch},
    {&Config::cmp_ratio, &Params::cmp_ratio},
};

// The params a configuration describes (sizes, masks, lengths; no tensors).
SparseFlashMlaParams params_of(const Config& c, const Arrays& a) {
  SparseFlashMlaParams p;
  for (const auto& [config, params] : kSameSizes) p.*params = c.*config;
  p.layout_q = c.layout_q;
  p.layout_kv = c.layout_kv;
  p.cu_seqlens_q = a.data[kCuQ];
  p.seqused_q = a.data[kUsedQ];
  const auto total = [&](Array cu) { return a.data[cu] != nullptr ? a.data[cu][c.batch_size] : 0; };
  p.seq_q = c.layout_q == Layout::kTND ? total(kCuQ) : c.max_seqlen_q;
  const auto side = [&](MlaKeys& k, bool present, int64_t max, Array cu, Array used, int64_t topk) {
    k.present = present;
    k.seq = c.layout_kv == Layout::kTND ? total(cu) : max;
    k.cu_seqlens = a.data[cu];
    k.seqused = a.data[used];
    k.block_size = 1;
    k.topk = topk;
  };
  side(p.ori, c.has_ori_kv, c.max_seqlen_ori_kv, kCuOri, kUsedOri, c.ori_topk);
  side(p.cmp, c.has_cmp_kv, c.max_seqlen_cmp_kv, kCuCmp, kUsedCmp, c.cmp_topk);
  p.ori.mask_mode = static_cast<MaskMode>(c.ori_mask_mode);
  p.ori.win_left = c.ori_win_left;
  p.ori.win_right = c.ori_win_right;
  p.cmp.mask_mode = static_cast<MaskMode>(c.cmp_mask_mode);
  p.cmp_residuals = a.data[kResiduals];
  return p;
}

int64_t longest_key(const std::vector<Sequence>& seqs) {
  int64_t m = 0;
  for (const Sequence& s : seqs) m = std::max(m, s.k_len);
  return m;
}

int64_t longest_query(const std::vector<Sequence>& seqs) {
  int64_t m = 0;
  for (const Sequence& s : seqs) m = std::max(m, s.q_len);
  return m;
}

// Unit (s, i, g)'s keys: the visible ones of both key tensors, or at most each selection's
// count.
int64_t unit_keys(const SparseFlashMlaParams& p, const Arrays& a, const MlaSequences& seqs,
                  const Sequence& s, int64_t i, int64_t g) {
  const Mask masks[2] = {ori_mask(p), cmp_mask(p)};
  const MlaKeys* sides[2] = {&p.ori, &p.cmp};
  const Array lengths[2] = {kOriTopkLength, kCmpTopkLength};
  const int64_t row = p.layout_q == Layout::kTND ? s.q_begin + i : s.batch * p.seq_q + i;
  int64_t keys = 0;
  for (int k = 0; k < 2; ++k) {
    if (!sides[k]->present) continue;
    const KeyRange vis = visible_keys(masks[k], (k == 0 ? seqs.ori : seqs.cmp)[s.batch], i);
    int64_t n = vis.end - vis.begin;
    if (sides[k]->topk > 0) {
      const int64_t* len = a.data[lengths[k]];
      n = std::min(n, len != nullptr ? len[row * p.heads_kv + g] : sides[k]->topk);
    }
    keys += std::max<int64_t>(n, 0);
  }
  return keys;
}

void check_counts(const Config& c, const Arrays& a, int64_t q_rows) {
  const int64_t batch = c.batch_size;
  const int64_t want[kArrays] = {batch + 1,
                                 batch + 1,
                                 batch + 1,
                                 batch,
                                 batch,
                                 batch,
                                 batch,
                                 q_rows * c.num_heads_kv,
                                 q_rows * c.num_heads_kv};
  for (int k = 0; k < kArrays; ++k) {
    if (a.data[k] != nullptr && a.count[k] != want[k]) {
      throw ArgumentError(kArrayNames[k],
                          "expected " + str(want[k]) + " entries, got " + str(a.count[k]));
    }
  }
  for (const auto& [given, topk, name] :
       {std::tuple{a.data[kOriTopkLength], c.ori_topk, kArrayNames[kOriTopkLength]},
        {a.data[kCmpTopkLength], c.cmp_topk, kArrayNames[kCmpTopkLength]}}) {
    for (int64_t e = 0; given != nullptr && e < q_rows * c.num_heads_kv; ++e) {
      if (given[e] < 0 || given[e] > topk) {
        throw ArgumentError(name, "entry " + str(e) + " is " + str(given[e]) + ", expected [0, " +
                                      str(topk) + "] (the top-k)");
      }
    }
  }
}

void check_longest(const char* name, int64_t given, int64_t longest) {
  if (given != longest) {
    throw ArgumentError(name, "is " + str(given) + ", but the longest sequence has " +
                                  str(longest) + " (TND and paged plans take the exact maximum)");
  }
}

}  // namespace

int64_t size_words(int64_t num_workers) { return kHeaderWords + kWorkerWords * num_workers; }

Plan make_plan(const Config& c, const Arrays& a) {
  if (c.num_workers < 1 || c.num_workers > (1 << 16)) {
    throw ArgumentError("num_workers", "must be in [1, 65536], got " + str(c.num_workers));
  }
  if (c.ori_topk < 0) throw ArgumentError("ori_topk", "must be >= 0, got " + str(c.ori_topk));
  if (c.cmp_topk < 0) throw ArgumentError("cmp_topk", "must be >= 0, got " + str(c.cmp_topk));
  if (c.batch_size < 0) throw ArgumentError("batch_size", "must be >= 0");
  const SparseFlashMlaParams p = params_of(c, a);
  validate(p);
  const MlaSequences seqs = sparse_flash_mla_sequences(p);
  if (c.layout_q == Layout::kTND)
    check_longest("max_seqlen_q", c.max_seqlen_q, longest_query(seqs.ori));
  if (c.layout_kv != Layout::kBSND) {
    if (c.has_ori_kv)
      check_longest("max_seqlen_ori_kv", c.max_seqlen_ori_kv, longest_key(seqs.ori));
    if (c.has_cmp_kv)
      check_longest("max_seqlen_cmp_kv", c.max_seqlen_cmp_kv, longest_key(seqs.cmp));
  }
  const int64_t q_rows = c.layout_q == Layout::kTND ? p.seq_q : c.batch_size * p.seq_q;
  check_counts(c, a, q_rows);
  Plan plan;
  plan.config = c;
  std::vector<int64_t> keys;  // each unit's keys
  for (const Sequence& s : seqs.ori) {
    for (int64_t i = 0; i < s.q_len; ++i) {
      for (int64_t g = 0; g < c.num_heads_kv; ++g) keys.push_back(unit_keys(p, a, seqs, s, i, g));
    }
  }
  plan.rows = static_cast<int64_t>(keys.size()) / c.num_heads_kv;
  const int64_t units = static_cast<int64_t>(keys.size());
  const int64_t workers = c.num_workers;
  int64_t total = 0;  // in keys' worth: every unit's overhead and keys
  for (int64_t n : keys) total += kRowOverheadKeys + n;
  // Worker by worker, as much of the order as fits a budget: whole units, then the keys of a
  // unit that fit after its overhead (its later pieces pay the overhead again). The smallest
  // budget that covers the order (a binary search) is the makespan.
  const auto fill = [&](int64_t budget, std::vector<Stretch>* out) {
    Position at{0, 0};
    for (int64_t w = 0; w < workers; ++w) {
      Stretch st;
      st.begin = at;
      int64_t cost = 0;
      while (at.unit < units) {
        const int64_t piece = kRowOverheadKeys + keys[at.unit] - at.key;
        if (cost + piece <= budget) {
          cost += piece;
          at = {at.unit + 1, 0};
          continue;
        }
        const int64_t fit = budget - cost - kRowOverheadKeys;
        if (fit >= 1) {
          cost += kRowOverheadKeys + fit;
          at.key += fit;
        }
        break;
      }
      st.end = at;
      st.cost = static_cast<float>(cost);
      if (out != nullptr) out->push_back(st);
    }
    return at.unit >= units;
  };
  int64_t lo = std::max<int64_t>(kRowOverheadKeys + 1, (total + workers - 1) / workers);
  int64_t hi = std::max(lo, total);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fill(mid, nullptr)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  fill(lo, &plan.workers);
  const double per_key = static_cast<double>(c.num_heads_q / c.num_heads_kv * c.head_dim);
  for (Stretch& st : plan.workers) {
    st.cost = static_cast<float>(st.cost * per_key);
    plan.makespan = std::max(plan.makespan, static_cast<double>(st.cost));
  }
  plan.total_cost = static_cast<double>(total) * per_key;
  plan.lower_bound = plan.total_cost / static_cast<double>(workers);
  for (int k = 0; k < kArrays; ++k) plan.prints[k] = plan_words::print_of(a.data[k], a.count[k]);
  return plan;
}

void write(const Plan& plan, int32_t* out) {
  const Config& c = plan.config;
  const int64_t workers = static_cast<int64_t>(plan.workers.size());
  std::fill(out, out + size_words(workers), 0);
  plan_words::put_header(out, kMagic, kVersion, size_words(workers), workers);
  for (const Named& n : kNamed) out[n.field] = static_cast<int32_t>(c.*n.member);
  out[kFieldLayoutQ] = static_cast<int32_t>(c.layout_q);
  out[kFieldLayoutKv] = static_cast<int32_t>(c.layout_kv);
  out[kFieldHasOri] = c.has_ori_kv;
  out[kFieldHasCmp] = c.has_cmp_kv;
  out[kFieldRows] = static_cast<int32_t>(plan.rows);
  for (int k = 0; k < kArrays; ++k) {
    out[kFieldPrints + 3 * k] = plan.prints[k].present;
    out[kFieldPrints + 3 * k + 1] = plan.prints[k].low;
    out[kFieldPrints + 3 * k + 2] = plan.prints[k].high;
  }
  out[kFieldMakespan] = float_bits(static_cast<float>(plan.makespan));
  out[kFieldLowerBound] = float_bits(static_cast<float>(plan.lower_bound));
  out[kFieldTotalCost] = float_bits(static_cast<float>(plan.total_cost));
  int32_t* w = out + kHeaderWords;
  for (const Stretch& st : plan.workers) {
    w[0] = static_cast<int32_t>(st.begin.unit);
    w[1] = static_cast<int32_t>(st.begin.key);
    w[2] = static_cast<int32_t>(st.end.unit);
    w[3] = static_cast<int32_t>(st.end.key);
    w[4] = float_bits(st.cost);
    w += kWorkerWords;
  }
}

Plan read(const int32_t* words, int64_t size) {
  const auto corrupt = [](const std::string& what) {
    throw ArgumentError("metadata", "is not a sparse_flash_mla_metadata plan: " + what);
  };
  const int64_t workers =
      plan_words::header_workers(words, size, kHeaderWords, kMagic, kVersion, size_words, corrupt);
  Plan plan;
  Config& c = plan.config;
  for (const Named& n : kNamed) c.*n.member = words[n.field];
  c.layout_q = static_cast<Layout>(words[kFieldLayoutQ]);
  c.layout_kv = static_cast<Layout>(words[kFieldLayoutKv]);
  c.has_ori_kv = words[kFieldHasOri] != 0;
  c.has_cmp_kv = words[kFieldHasCmp] != 0;
  c.num_workers = workers;
  plan.rows = words[kFieldRows];
  for (int k = 0; k < kArrays; ++k) {
    plan.prints[k] = {words[kFieldPrints + 3 * k], words[kFieldPrints + 3 * k + 1],
                      words[kFieldPrints + 3 * k + 2]};
  }
  plan.makespan = bits_float(words[kFieldMakespan]);
  plan.lower_bound = bits_float(words[kFieldLowerBound]);
  plan.total_cost = bits_float(words[kFieldTotalCost]);
  const int32_t* w = words + kHeaderWords;
  for (int64_t k = 0; k < workers; ++k, w += kWorkerWords) {
    plan.workers.push_back({{w[0], w[1]}, {w[2], w[3]}, bits_float(w[4])});
  }
  return plan;
}

Config config_of(const SparseFlashMlaParams& p, const MlaSequences& seqs) {
  Config c;
  for (const auto& [config, params] : kSameSizes) c.*config = p.*params;
  c.max_seqlen_q = p.layout_q == Layout::kTND ? longest_query(seqs.ori) : p.seq_q;
  const auto max_of = [&](const MlaKeys& k, const std::vector<Sequence>& s) -> int64_t {
    if (!k.present) return 0;
    return p.layout_kv == Layout::kBSND ? k.seq : longest_key(s);
  };
  c.max_seqlen_ori_kv = max_of(p.ori, seqs.ori);
  c.max_seqlen_cmp_kv = max_of(p.cmp, seqs.cmp);
  c.ori_topk = p.ori.indices.data != nullptr ? p.ori.topk : 0;
  c.cmp_topk = p.cmp.indices.data != nullptr ? p.cmp.topk : 0;
  c.ori_mask_mode = static_cast<int64_t>(p.ori.mask_mode);
  c.cmp_mask_mode = static_cast<int64_t>(p.cmp.mask_mode);
  c.ori_win_left = p.ori.win_left;
  c.ori_win_right = p.ori.win_right;
  c.layout_q = p.layout_q;
  c.layout_kv = p.layout_kv;
  c.has_ori_kv = p.ori.present;
  c.has_cmp_kv = p.cmp.present;
  return c;
}

Arrays arrays_of(const SparseFlashMlaParams& p) {
  Arrays a;
  const int64_t batch = p.batch;
  a.data[kCuQ] = p.cu_seqlens_q;
  a.count[kCuQ] = batch + 1;
  a.data[kCuOri] = p.ori.cu_seqlens;
  a.count[kCuOri] = batch + 1;
  a.data[kCuCmp] = p.cmp.cu_seqlens;
  a.count[kCuCmp] = batch + 1;
  a.data[kUsedQ] = p.seqused_q;
  a.data[kUsedOri] = p.ori.seqused;
  a.data[kUsedCmp] = p.cmp.seqused;
  a.data[kResiduals] = p.cmp_residuals;
  a.count[kUsedQ] = a.count[kUsedOri] = a.count[kUsedCmp] = a.count[kResiduals] = batch;
  return a;  // the topk lengths are tensors of the call: the binding adds their host copies
}

void verify(const Plan& planned, const Config& call, const Arrays& arrays, int64_t rows) {
  const Config& p = planned.config;
  const auto same = [](const char* name, int64_t was, int64_t is) {
    if (was != is) {
      throw ArgumentError("metadata", std::string("was planned for ") + name + "=" + str(was) +
                                          ", but this call has " + name + "=" + str(is));
    }
  };
  for (const Named& n : kNamed) same(n.name, p.*n.member, call.*n.member);
  same("layout_q", static_cast<int64_t>(p.layout_q), static_cast<int64_t>(call.layout_q));
  same("layout_kv", static_cast<int64_t>(p.layout_kv), static_cast<int64_t>(call.layout_kv));
  same("has_ori_kv", p.has_ori_kv, call.has_ori_kv);
  same("has_cmp_kv", p.has_cmp_kv, call.has_cmp_kv);
  for (int k = 0; k < kArrays; ++k) {
    const plan_words::ArrayPrint given = plan_words::print_of(arrays.data[k], arrays.count[k]);
    const plan_words::ArrayPrint& was = planned.prints[k];
    if (was.present != given.present) {
      throw ArgumentError("metadata", std::string("was planned ") +
                                          (was.present ? "with " : "without ") + kArrayNames[k] +
                                          ", but this call passes " +
                                          (given.present ? "it" : "none"));
    }
    if (was.low != given.low || was.high != given.high) {
      throw ArgumentError("metadata", std::string("was planned for other ") + kArrayNames[k] +
                                          " values than this call's");
    }
  }
  const int64_t units = rows * call.num_heads_kv;
  Position at{0, 0};
  for (const Stretch& st : planned.workers) {
    const bool backwards =
        st.end.unit < st.begin.unit || (st.end.unit == st.begin.unit && st.end.key < st.begin.key);
    if (st.begin.unit != at.unit || st.begin.key != at.key || backwards || st.end.key < 0 ||
        st.end.unit > units || (st.end.unit == units && st.end.key != 0)) {
      throw ArgumentError("metadata", "its workers' stretches do not follow each other");
    }
    at = st.end;
  }
  if (at.unit != units || planned.rows != rows) {
    throw ArgumentError("metadata",
                        "covers " + str(planned.rows) + " rows, but this call has " + str(rows));
  }
}

sparse::TokenSchedule schedule(const Plan& plan, const std::vector<Sequence>& seqs) {
  const int64_t heads = plan.config.num_heads_kv;
  // Each row's sequence and index within it, in the canonical order.
  std::vector<std::pair<int32_t, int64_t>> rows;
  for (const Sequence& s : seqs) {
    for (int64_t i = 0; i < s.q_len; ++i) rows.push_back({static_cast<int32_t>(s.batch), i});
  }
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  sparse::TokenSchedule out;
  // A piece of a split unit takes the next slot of the unit's combine (pieces come in order).
  const auto slot_for = [&](int32_t b, int64_t i, int32_t g) {
    if (out.combines.empty() || out.combines.back().b != b || out.combines.back().i != i ||
        out.combines.back().g != g) {
      out.combines.push_back({b, i, g, static_cast<int32_t>(out.slots), 0});
    }
    ++out.combines.back().num_slots;
    return static_cast<int32_t>(out.slots++);
  };
  for (const Stretch& st : plan.workers) {
    int64_t u = st.begin.unit;
    int64_t k = st.begin.key;
    // Units [begin, end), and the end unit's first keys when the stretch ends inside it.
    while (u < st.end.unit || (u == st.end.unit && st.end.key > k)) {
      const int64_t r = u / heads;
      const auto [b, i] = rows[r];
      if (u % heads == 0 && k == 0) {
        // Whole rows of one sequence while the stretch covers them entirely.
        int64_t r1 = r;
        while (r1 < n_rows && rows[r1].first == b && (r1 + 1) * heads <= st.end.unit) ++r1;
        if (r1 > r) {
          out.items.push_back({b, i, i + (r1 - r), -1, 0, -1, -1});
          u = r1 * heads;
          continue;
        }
      }
      const int32_t g = static_cast<int32_t>(u % heads);
      const int64_t k1 = u == st.end.unit ? st.end.key : -1;
      const int32_t slot = k > 0 || k1 >= 0 ? slot_for(b, i, g) : -1;
      out.items.push_back({b, i, i + 1, g, k, k1, slot});
      ++u;
      k = 0;
    }
    out.group_ends.push_back(static_cast<int64_t>(out.items.size()));
  }
  return out;
}

}  // namespace opmesh::core::mla_plan
