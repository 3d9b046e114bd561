#include "metadata.h"

#include <cstring>
#include <string>

#include "../errors.h"
#include "plan_words.h"

namespace opmesh::core::attention::metadata {
namespace {

using plan_words::bits_float;
using plan_words::float_bits;

void length_prints(const PlanConfig& c, const LengthArrays& l, ArrayPrint out[4]) {
  const int32_t* arrays[4] = {l.cu_seqlens_q, l.cu_seqlens_kv, l.seqused_q, l.seqused_kv};
  const int64_t counts[4] = {c.batch_size + 1, c.batch_size + 1, c.batch_size, c.batch_size};
  for (int i = 0; i < 4; ++i) out[i] = plan_words::print_of(arrays[i], counts[i]);
}

void put_position(int32_t* w, const Position& p) {
  w[0] = p.b;
  w[1] = p.h;
  w[2] = p.t;
  w[3] = p.k;
}

Position get_position(const int32_t* w) { return {w[0], w[1], w[2], w[3]}; }

// The configuration's sizes and window, each in its header field.
struct SizeField {
  Field field;
  int64_t PlanConfig::* member;
};
constexpr SizeField kSizeFields[] = {
    {kFieldNumHeadsQ, &PlanConfig::num_heads_q},     {kFieldNumHeadsKv, &PlanConfig::num_heads_kv},
    {kFieldHeadDim, &PlanConfig::head_dim},          {kFieldHeadDimV, &PlanConfig::head_dim_v},
    {kFieldBatchSize, &PlanConfig::batch_size},      {kFieldMaxSeqlenQ, &PlanConfig::max_seqlen_q},
    {kFieldMaxSeqlenKv, &PlanConfig::max_seqlen_kv}, {kFieldWinLeft, &PlanConfig::win_left},
    {kFieldWinRight, &PlanConfig::win_right},
};

[[noreturn]] void corrupt(const std::string& what) {
  throw ArgumentError("metadata",
                      "is not a flash_attn_metadata result of this version (" + what + ")");
}

}  // namespace

int64_t size_words(int64_t num_workers) {
  return kHeaderWords + num_workers * (kWorkerWords + kCombineWords);
}

void write(const PlanConfig& c, const LengthArrays& l, int32_t* out) {
  validate_config(c);
  const bool backward = c.backward;
  if (backward && c.layout_kv == Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", "PA_BBND (paged keys and values) has no backward to plan");
  }
  const std::vector<Sequence> seqs = resolve_sequences(c, l);
  const Plan plan = backward ? Plan{} : make_plan(c, seqs);
  const int64_t total = size_words(c.num_workers);
  std::memset(out, 0, static_cast<size_t>(total) * sizeof(int32_t));
  int32_t* h = out;
  plan_words::put_header(h, kMagic, kVersion, total, c.num_workers);
  h[kFieldNumCombines] = static_cast<int32_t>(plan.combines.size());
  h[kFieldNumSlots] = static_cast<int32_t>(plan.num_slots);
  const Geometry g = geometry(c);
  h[kFieldGroup] = static_cast<int32_t>(g.group);
  h[kFieldPositions] = static_cast<int32_t>(g.positions);
  h[kFieldRows] = static_cast<int32_t>(g.rows);
  h[kFieldKeyTile] = static_cast<int32_t>(kKeyTile);
  h[kFieldChunkTiles] = static_cast<int32_t>(plan.chunk_tiles);
  h[kFieldDeterministic] = c.deterministic ? 1 : 0;
  for (const SizeField& f : kSizeFields) h[f.field] = static_cast<int32_t>(c.*f.member);
  h[kFieldMaskMode] = static_cast<int32_t>(c.mask_mode);
  h[kFieldLayoutQ] = static_cast<int32_t>(c.layout_q);
  h[kFieldLayoutKv] = static_cast<int32_t>(c.layout_kv);
  h[kFieldLayoutOut] = static_cast<int32_t>(c.layout_out);
  ArrayPrint prints[4];
  length_prints(c, l, prints);
  for (int i = 0; i < 4; ++i) {
    h[kFieldLengthHashes + 3 * i] = prints[i].present;
    h[kFieldLengthHashes + 3 * i + 1] = prints[i].low;
    h[kFieldLengthHashes + 3 * i + 2] = prints[i].high;
  }
  h[kFieldDirection] = backward ? 1 : 0;
  if (backward) {
    const BackwardPlan bp = plan_backward(c, seqs);
    h[kFieldMakespan] = float_bits(static_cast<float>(bp.makespan));
    h[kFieldLowerBound] = float_bits(static_cast<float>(bp.lower_bound));
    h[kFieldTotalCost] = float_bits(static_cast<float>(bp.total_cost));
    h[kFieldNumTasks] = static_cast<int32_t>(bp.num_key_units + bp.num_query_units);
    h[kFieldKeyUnits] = static_cast<int32_t>(bp.num_key_units);
    h[kFieldQueryUnits] = static_cast<int32_t>(bp.num_query_units);
    h[kFieldFused] = bp.fused ? 1 : 0;
    int32_t* w = out + kHeaderWords;
    for (int64_t i = 0; i < c.num_workers; ++i, w += kWorkerWords) {
      w[0] = bp.key_begin[i];
      w[1] = bp.key_end[i];
      w[2] = bp.query_begin[i];
      w[3] = bp.query_end[i];
      w[10] = float_bits(bp.cost[i]);
    }
    return;
  }
  h[kFieldMakespan] = float_bits(static_cast<float>(plan.makespan));
  h[kFieldLowerBound] = float_bits(static_cast<float>(plan.lower_bound));
  h[kFieldTotalCost] = float_bits(static_cast<float>(plan.total_cost));
  h[kFieldNumTasks] = static_cast<int32_t>(plan.num_tasks);
  h[kFieldNumSplits] = static_cast<int32_t>(plan.combines.size());
  int32_t* w = out + kHeaderWords;
  for (const WorkerRange& r : plan.workers) {
    put_position(w, r.begin);
    put_position(w + 4, r.end);
    w[8] = r.begin_slot;
    w[9] = r.end_slot;
    w[10] = float_bits(r.cost);
    w += kWorkerWords;
  }
  int32_t* cw = out + kHeaderWords + c.num_workers * kWorkerWords;
  for (const CombineTask& ct : plan.combines) {
    cw[0] = ct.b;
    cw[1] = ct.h;
    cw[2] = ct.t;
    cw[3] = ct.first_slot;
    cw[4] = ct.num_slots;
    cw += kCombineWords;
  }
}

Decoded read(const int32_t* words, int64_t size) {
  const int32_t* h = words;
  Decoded d;
  PlanConfig& c = d.config;
  c.num_workers =
      plan_words::header_workers(words, size, kHeaderWords, kMagic, kVersion, size_words, corrupt);
  // The codes first, then the fields.
  if (h[kFieldDirection] != 0 && h[kFieldDirection] != 1) corrupt("unknown direction");
  if (h[kFieldLayoutQ] < 0 || h[kFieldLayoutQ] > 3 || h[kFieldLayoutKv] < 0 ||
      h[kFieldLayoutKv] > 3 || h[kFieldLayoutOut] < 0 || h[kFieldLayoutOut] > 3) {
    corrupt("unknown layout code");
  }
  c.backward = h[kFieldDirection] == 1;
  c.deterministic = h[kFieldDeterministic] != 0;
  for (const SizeField& f : kSizeFields) c.*f.member = h[f.field];
  c.mask_mode = static_cast<MaskMode>(h[kFieldMaskMode]);
  c.layout_q = static_cast<Layout>(h[kFieldLayoutQ]);
  c.layout_kv = static_cast<Layout>(h[kFieldLayoutKv]);
  c.layout_out = static_cast<Layout>(h[kFieldLayoutOut]);
  try {
    validate_config(c);
  } catch (const ArgumentError& e) {
    corrupt(std::string("planned arguments are invalid: ") + e.what());
  }
  Plan& p = d.plan;
  p.geometry = geometry(c);
  if (h[kFieldGroup] != p.geometry.group || h[kFieldPositions] != p.geometry.positions ||
      h[kFieldRows] != p.geometry.rows || h[kFieldKeyTile] != kKeyTile) {
    corrupt("tile sizes differ from this build's");
  }
  if (c.backward) {
    BackwardPlan& bp = d.backward;
    bp.num_key_units = h[kFieldKeyUnits];
    bp.num_query_units = h[kFieldQueryUnits];
    if (h[kFieldFused] != 0 && h[kFieldFused] != 1) corrupt("unknown backward mode");
    bp.fused = h[kFieldFused] == 1;
    bp.makespan = bits_float(h[kFieldMakespan]);
    bp.lower_bound = bits_float(h[kFieldLowerBound]);
    bp.total_cost = bits_float(h[kFieldTotalCost]);
    p.makespan = bp.makespan;
    p.lower_bound = bp.lower_bound;
    p.total_cost = bp.total_cost;
    p.num_tasks = h[kFieldNumTasks];
    int32_t next_key = 0, next_query = 0;
    const int32_t* w = words + kHeaderWords;
    for (int64_t i = 0; i < c.num_workers; ++i, w += kWorkerWords) {
      // Ranges tile both unit lists in order: anything else is not a plan of this format.
      if (w[0] != next_key || w[1] < w[0] || w[2] != next_query || w[3] < w[2]) {
        corrupt("backward ranges do not tile the units");
      }
      next_key = w[1];
      next_query = w[3];
      bp.key_begin.push_back(w[0]);
      bp.key_end.push_back(w[1]);
      bp.query_begin.push_back(w[2]);
      bp.query_end.push_back(w[3]);
      bp.cost.push_back(bits_float(w[10]));
    }
    if (next_key != bp.num_key_units || next_query != bp.num_query_units) {
      corrupt("backward ranges do not cover the units");
    }
    for (int i = 0; i < 4; ++i) {
      d.length_prints[i] = {h[kFieldLengthHashes + 3 * i], h[kFieldLengthHashes + 3 * i + 1],
                            h[kFieldLengthHashes + 3 * i + 2]};
    }
    return d;
  }
  p.chunk_tiles = h[kFieldChunkTiles];
  if (p.chunk_tiles != (c.deterministic ? kDeterministicChunkTiles : 0)) corrupt("chunk size");
  const int64_t combines = h[kFieldNumCombines];
  if (combines < 0 || combines > c.num_workers) corrupt("combine count");
  p.num_slots = h[kFieldNumSlots];
  if (p.num_slots < 0) corrupt("slot count");
  p.num_tasks = h[kFieldNumTasks];
  p.makespan = bits_float(h[kFieldMakespan]);
  p.lower_bound = bits_float(h[kFieldLowerBound]);
  p.total_cost = bits_float(h[kFieldTotalCost]);
  for (int i = 0; i < 4; ++i) {
    d.length_prints[i] = {h[kFieldLengthHashes + 3 * i], h[kFieldLengthHashes + 3 * i + 1],
                          h[kFieldLengthHashes + 3 * i + 2]};
  }
  const int32_t* w = words + kHeaderWords;
  for (int64_t i = 0; i < c.num_workers; ++i, w += kWorkerWords) {
    p.workers.push_back({get_position(w), get_position(w + 4), w[8], w[9], bits_float(w[10])});
  }
  const int32_t* cw = words + kHeaderWords + c.num_workers * kWorkerWords;
  for (int64_t i = 0; i < combines; ++i, cw += kCombineWords) {
    p.combines.push_back({cw[0], cw[1], cw[2], cw[3], cw[4]});
  }
  return d;
}

namespace {

void same(const char* name, int64_t planned, int64_t call) {
  if (planned != call) {
    throw ArgumentError("metadata", std::string("was planned for ") + name + "=" +
                                        std::to_string(planned) + ", but this call has " + name +
                                        "=" + std::to_string(call));
  }
}

void same_layout(const char* name, Layout planned, Layout call) {
  if (planned != call) {
    throw ArgumentError("metadata", std::string("was planned for ") + name + "=" +
                                        layout_name(planned) + ", but this call has " + name + "=" +
                                        layout_name(call));
  }
}

}  // namespace

void verify(const Decoded& d, const PlanConfig& call, const LengthArrays& lengths) {
  const PlanConfig& p = d.config;
  if (p.backward != call.backward) {
    throw ArgumentError("metadata", p.backward
                                        ? "is a backward plan (flash_attn_metadata(..., "
                                          "backward=True)); flash_attn needs a forward plan"
                                        : "is a forward plan; flash_attn_backward needs one made "
                                          "with flash_attn_metadata(..., backward=True)");
  }
  same("num_heads_q", p.num_heads_q, call.num_heads_q);
  same("num_heads_kv", p.num_heads_kv, call.num_heads_kv);
  same("head_dim", p.head_dim, call.head_dim);
  same("head_dim_v", p.head_dim_v, call.head_dim_v);
  same("batch_size", p.batch_size, call.batch_size);
  // A negative value means the call leaves it to the metadata (not given, not implied by a shape).
  if (call.max_seqlen_q >= 0) same("max_seqlen_q", p.max_seqlen_q, call.max_seqlen_q);
  if (call.max_seqlen_kv >= 0) same("max_seqlen_kv", p.max_seqlen_kv, call.max_seqlen_kv);
  same("mask_mode", static_cast<int64_t>(p.mask_mode), static_cast<int64_t>(call.mask_mode));
  same("win_left", p.win_left, call.win_left);
  same("win_right", p.win_right, call.win_right);
  same_layout("layout_q", p.layout_q, call.layout_q);
  same_layout("layout_kv", p.layout_kv, call.layout_kv);
  same_layout("layout_out", p.layout_out, call.layout_out);
  const ArrayPrint* planned = d.length_prints;
  ArrayPrint given[4];
  length_prints(p, lengths, given);
  for (int i = 0; i < 4; ++i) {
    if (planned[i].present != given[i].present) {
      throw ArgumentError("metadata", std::string("was planned ") +
                                          (planned[i].present ? "with " : "without ") +
                                          kLengthNames[i] + ", but this call passes " +
                                          (given[i].present ? "it" : "none"));
    }
    if (planned[i].low != given[i].low || planned[i].high != given[i].high) {
      throw ArgumentError("metadata", std::string("was planned for other ") + kLengthNames[i] +
                                          " values than this call's");
    }
  }
}

}  // namespace opmesh::core::attention::metadata
