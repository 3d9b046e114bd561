// The Python module opmesh._C: loading it registers the operators. It also reports which SIMD
// levels the CPU kernels can use here, for tests and diagnostics.
#include <Python.h>

#include <string>
#include <vector>

#include "attention/cost_model.h"
#include "attention/metadata.h"
#include "attention/mla_plan.h"
#include "cpu_features.h"
#include "errors.h"
#include "kernel_choice.h"
#include "kernels/kernel_set.h"
#include "worker_times.h"

namespace {

PyObject* supported_simd_levels(PyObject*, PyObject*) {
  const auto levels = opmesh::core::supported_isas();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(levels.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < levels.size(); ++i) {
    PyList_SET_ITEM(list, i, PyUnicode_FromString(opmesh::core::isa_name(levels[i])));
  }
  return list;
}

PyObject* active_simd_level(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(opmesh::core::isa_name(opmesh::core::active_isa()));
  } catch (const opmesh::core::ArgumentError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

// The kind of work a Python string names ("compute" or "memory"); false with a ValueError set.
bool parse_work(const char* kind, opmesh::core::Work* work) {
  const std::string k(kind);
  if (k != "compute" && k != "memory") {
    PyErr_Format(PyExc_ValueError, "kind: expected 'compute' or 'memory', got '%s'", kind);
    return false;
  }
  *work = k == "memory" ? opmesh::core::Work::kMemory : opmesh::core::Work::kCompute;
  return true;
}

// {"pairs": bool, "source": str, "pairs_ns": float, "fp32_ns": float, "kernel_set": str} for
// "compute" or "memory" work on bf16 inputs at the active level.
PyObject* bf16_choice(PyObject*, PyObject* arg) {
  const char* kind = PyUnicode_AsUTF8(arg);
  opmesh::core::Work work;
  if (kind == nullptr || !parse_work(kind, &work)) return nullptr;
  try {
    namespace core = opmesh::core;
    const core::Isa isa = core::active_isa();
    const core::Bf16Choice c = core::bf16_choice(work, isa);
    const core::kernels::KernelSet& set =
        core::kernels::select_set(isa, core::DType::kBFloat16, -1, work == core::Work::kCompute);
    return Py_BuildValue("{s:O,s:s,s:d,s:d,s:s}", "pairs", c.pairs ? Py_True : Py_False, "source",
                         c.source, "pairs_ns", c.pairs_ns, "fp32_ns", c.fp32_ns, "kernel_set",
                         set.name);
  } catch (const opmesh::core::ArgumentError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

// Measures "compute" or "memory" work over `rounds` rounds at the active level and writes the
// calibration file; returns {"pairs", "source", "pairs_ns", "fp32_ns", "path"}.
PyObject* bf16_calibrate(PyObject*, PyObject* args) {
  const char* kind = nullptr;
  int rounds = 0;
  opmesh::core::Work work;
  if (!PyArg_ParseTuple(args, "si", &kind, &rounds) || !parse_work(kind, &work)) return nullptr;
  try {
    namespace core = opmesh::core;
    const core::Bf16Choice c = core::calibrate_bf16(work, core::active_isa(), rounds);
    return Py_BuildValue("{s:O,s:s,s:d,s:d,s:s}", "pairs", c.pairs ? Py_True : Py_False, "source",
                         c.source, "pairs_ns", c.pairs_ns, "fp32_ns", c.fp32_ns, "path",
                         core::bf16_calibration_path().c_str());
  } catch (const opmesh::core::ArgumentError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

// [{"name", "isa", "word", "depth_align", "row_align"}] for every kernel set usable now, and
// how the amx_bf16 level runs its tiles ("hardware", "emulated" or "none").
PyObject* kernel_sets(PyObject*, PyObject*) {
  namespace core = opmesh::core;
  try {
    const core::kernels::KernelSet* sets[16];
    const int n = core::kernels::available_sets(sets, 16);
    PyObject* list = PyList_New(n);
    if (list == nullptr) return nullptr;
    for (int i = 0; i < n; ++i) {
      const auto& s = *sets[i];
      PyObject* item = Py_BuildValue(
          "{s:s,s:s,s:s,s:L,s:L}", "name", s.name, "isa", core::isa_name(s.isa), "word",
          s.word == core::kernels::Word::kBf16Pair ? "bf16_pair" : "float32", "depth_align",
          static_cast<long long>(s.depth_align), "row_align", static_cast<long long>(s.row_align));
      if (item == nullptr) {
        Py_DECREF(list);
        return nullptr;
      }
      PyList_SET_ITEM(list, i, item);
    }
    return Py_BuildValue("(Ns)", list, core::amx_tiles_name(core::amx_tiles()));
  } catch (const core::ArgumentError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyObject* set_worker_timing(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  opmesh::binding::WorkerTimes::enable(on != 0);
  Py_RETURN_NONE;
}

PyObject* last_worker_times(PyObject*, PyObject*) {
  const auto times = opmesh::binding::WorkerTimes::last();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(times.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < times.size(); ++i) {
    PyList_SET_ITEM(list, i, PyLong_FromLongLong(times[i]));
  }
  return list;
}

namespace attn = opmesh::core::attention;

// Decodes the int32 words of a bytes-like buffer with read(words, count) into out, releasing
// the buffer; a core ArgumentError becomes ValueError (false returned).
template <class Read, class Out>
bool read_words(Py_buffer& buffer, Read read, Out& out) {
  try {
    out = read(static_cast<const int32_t*>(buffer.buf),
               static_cast<int64_t>(buffer.len / sizeof(int32_t)));
  } catch (const opmesh::core::ArgumentError& e) {
    PyBuffer_Release(&buffer);
    PyErr_SetString(PyExc_ValueError, e.what());
    return false;
  }
  PyBuffer_Release(&buffer);
  return true;
}

// Decodes the int32 words of a metadata tensor passed as a bytes-like object; with `extra`, a
// second, required argument is returned there.
bool decode(PyObject* args, attn::metadata::Decoded& out, PyObject** extra = nullptr) {
  Py_buffer buffer;
  const bool parsed =
      extra ? PyArg_ParseTuple(args, "y*O", &buffer, extra) : PyArg_ParseTuple(args, "y*", &buffer);
  if (!parsed) return false;
  return read_words(buffer, attn::metadata::read, out);
}

bool set_item(PyObject* dict, const char* key, PyObject* value) {
  if (value == nullptr) return false;
  const int rc = PyDict_SetItemString(dict, key, value);
  Py_DECREF(value);
  return rc == 0;
}

PyObject* position(const attn::Position& p) { return Py_BuildValue("(iiii)", p.b, p.h, p.t, p.k); }

PyObject* describe_metadata(PyObject*, PyObject* args) {
  attn::metadata::Decoded d;
  if (!decode(args, d)) return nullptr;
  const attn::PlanConfig& c = d.config;
  const attn::Plan& p = d.plan;
  PyObject* dict = PyDict_New();
  if (dict == nullptr) return nullptr;
  const attn::BackwardPlan& bp = d.backward;
  const size_t workers = c.backward ? bp.cost.size() : p.workers.size();
  PyObject* costs = PyList_New(static_cast<Py_ssize_t>(workers));
  PyObject* ranges = PyList_New(static_cast<Py_ssize_t>(workers));
  for (size_t i = 0; costs && ranges && i < workers; ++i) {
    if (c.backward) {
      // Unit index ranges into the key pass's and the query pass's canonical unit lists.
      PyList_SET_ITEM(costs, i, PyFloat_FromDouble(bp.cost[i]));
      PyList_SET_ITEM(ranges, i,
                      Py_BuildValue("{s:(ii),s:(ii)}", "key_units", bp.key_begin[i], bp.key_end[i],
                                    "query_units", bp.query_begin[i], bp.query_end[i]));
      continue;
    }
    PyList_SET_ITEM(costs, i, PyFloat_FromDouble(p.workers[i].cost));
    PyList_SET_ITEM(ranges, i,
                    Py_BuildValue("{s:N,s:N,s:i,s:i}", "begin", position(p.workers[i].begin), "end",
                                  position(p.workers[i].end), "begin_slot", p.workers[i].begin_slot,
                                  "end_slot", p.workers[i].end_slot));
  }
  PyObject* combines = PyList_New(static_cast<Py_ssize_t>(p.combines.size()));
  for (size_t i = 0; combines && i < p.combines.size(); ++i) {
    const attn::CombineTask& t = p.combines[i];
    PyList_SET_ITEM(combines, i,
                    Py_BuildValue("(iiiii)", t.b, t.h, t.t, t.first_slot, t.num_slots));
  }
  if (costs == nullptr || ranges == nullptr || combines == nullptr || PyErr_Occurred()) {
    Py_XDECREF(costs);
    Py_XDECREF(ranges);
    Py_XDECREF(combines);
    Py_DECREF(dict);
    return nullptr;
  }
  const bool ok =
      set_item(dict, "version", PyLong_FromLong(attn::metadata::kVersion)) &&
      set_item(dict, "direction", PyUnicode_FromString(c.backward ? "backward" : "forward")) &&
      set_item(dict, "fused", PyBool_FromLong(c.backward && bp.fused)) &&
      set_item(dict, "num_workers", PyLong_FromLongLong(c.num_workers)) &&
      set_item(dict, "worker_cost", costs) && set_item(dict, "workers", ranges) &&
      set_item(dict, "combines", combines) &&
      set_item(dict, "makespan", PyFloat_FromDouble(p.makespan)) &&
      set_item(dict, "lower_bound", PyFloat_FromDouble(p.lower_bound)) &&
      set_item(dict, "total_cost", PyFloat_FromDouble(p.total_cost)) &&
      set_item(dict, "num_tasks", PyLong_FromLongLong(p.num_tasks)) &&
      set_item(dict, "num_splits",
               PyLong_FromLongLong(static_cast<long long>(p.combines.size()))) &&
      set_item(dict, "num_slots", PyLong_FromLongLong(p.num_slots)) &&
      set_item(dict, "deterministic", PyBool_FromLong(c.deterministic)) &&
      set_item(dict, "split_keys", PyLong_FromLongLong(p.chunk_tiles * attn::kKeyTile)) &&
      set_item(dict, "query_positions_per_tile", PyLong_FromLongLong(p.geometry.positions)) &&
      set_item(dict, "rows_per_tile", PyLong_FromLongLong(p.geometry.rows)) &&
      set_item(dict, "key_tile", PyLong_FromLongLong(attn::kKeyTile)) &&
      set_item(dict, "num_heads_q", PyLong_FromLongLong(c.num_heads_q)) &&
      set_item(dict, "num_heads_kv", PyLong_FromLongLong(c.num_heads_kv)) &&
      set_item(dict, "head_dim", PyLong_FromLongLong(c.head_dim)) &&
      set_item(dict, "head_dim_v", PyLong_FromLongLong(c.head_dim_v)) &&
      set_item(dict, "batch_size", PyLong_FromLongLong(c.batch_size)) &&
      set_item(dict, "max_seqlen_q", PyLong_FromLongLong(c.max_seqlen_q)) &&
      set_item(dict, "max_seqlen_kv", PyLong_FromLongLong(c.max_seqlen_kv)) &&
      set_item(dict, "mask_mode", PyLong_FromLong(static_cast<long>(c.mask_mode))) &&
      set_item(dict, "win_left", PyLong_FromLongLong(c.win_left)) &&
      set_item(dict, "win_right", PyLong_FromLongLong(c.win_right)) &&
      set_item(dict, "layout_q", PyUnicode_FromString(attn::layout_name(c.layout_q))) &&
      set_item(dict, "layout_kv", PyUnicode_FromString(attn::layout_name(c.layout_kv))) &&
      set_item(dict, "layout_out", PyUnicode_FromString(attn::layout_name(c.layout_out)));
  if (!ok) {
    Py_DECREF(dict);
    return nullptr;
  }
  return dict;
}

// The pieces of every worker's stretch with their modelled cost, given the per-sequence
// (q_len, k_len) pairs the plan was made for:
// [[(b, h, t, k_from, k_to, rows, cost, task cost, combine cost per partial, masked tiles),
//   ...], ...].
PyObject* plan_pieces(PyObject*, PyObject* args) {
  attn::metadata::Decoded d;
  PyObject* lens = nullptr;
  if (!decode(args, d, &lens)) return nullptr;
  PyObject* seq = PySequence_Fast(lens, "lengths: expected a list of (q_len, k_len)");
  if (seq == nullptr) return nullptr;
  std::vector<attn::Sequence> seqs;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    long long ql = 0, kl = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LL", &ql, &kl)) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (ql < 0 || ql > d.config.max_seqlen_q || kl < 0 || kl > d.config.max_seqlen_kv) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_ValueError,
                   "lengths: entry %zd is (%lld, %lld), outside the plan's maximum lengths", i, ql,
                   kl);
      return nullptr;
    }
    attn::Sequence s;
    s.q_len = ql;
    s.k_len = kl;
    seqs.push_back(s);
  }
  Py_DECREF(seq);
  if (static_cast<int64_t>(seqs.size()) != d.config.batch_size) {
    PyErr_SetString(PyExc_ValueError, "lengths: expected one (q_len, k_len) per sequence");
    return nullptr;
  }
  // The stretches are walked below: prove first that they cover these sequences exactly once.
  try {
    attn::verify_coverage(d.config, seqs, d.plan);
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_ValueError, "metadata: %s", e.what());
    return nullptr;
  }
  const attn::UnitWalker walker(d.config, seqs);
  const attn::CostModel& m = attn::default_cost_model();
  const int64_t dims = d.config.head_dim + d.config.head_dim_v;
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const attn::WorkerRange& r : d.plan.workers) {
    PyObject* pieces = PyList_New(0);
    bool ok = pieces != nullptr;
    walker.for_each_piece(r.begin, r.end,
                          [&](int32_t b, int32_t h, int32_t t, int32_t k_from, int32_t k_to,
                              const attn::TileSpan& sp) {
                            if (!ok) return;
                            const int64_t rows = (walker.tile_end(b, t) - walker.tile_begin(t)) *
                                                 d.plan.geometry.group;
                            const double task = attn::task_cost(m, rows, dims);
                            double cost = task;
                            int masked = 0;
                            for (int64_t j = k_from; j < k_to; ++j) {
                              const bool edge = j < sp.full_begin || j >= sp.full_end;
                              masked += edge ? 1 : 0;
                              cost += attn::block_cost(m, rows, dims, edge);
                            }
                            const double combine = attn::combine_cost(m, rows, d.config.head_dim_v);
                            PyObject* item =
                                Py_BuildValue("(iiiiiidddi)", b, h, t, k_from, k_to,
                                              static_cast<int>(rows), cost, task, combine, masked);
                            ok = item != nullptr && PyList_Append(pieces, item) == 0;
                            Py_XDECREF(item);
                          });
    if (!ok || PyList_Append(out, pieces) != 0) {
      Py_XDECREF(pieces);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(pieces);
  }
  return out;
}

// The words of a plan format for the worker count `arg` (size_words: the format's).
PyObject* plan_words_for(PyObject* arg, int64_t (*size_words)(int64_t)) {
  const long long workers = PyLong_AsLongLong(arg);
  if (workers == -1 && PyErr_Occurred()) return nullptr;
  if (workers < 1 || workers > (1 << 16)) {
    PyErr_Format(PyExc_ValueError, "num_workers: must be in [1, 65536], got %lld", workers);
    return nullptr;
  }
  return PyLong_FromLongLong(size_words(workers));
}

PyObject* metadata_words(PyObject*, PyObject* arg) {
  return plan_words_for(arg, attn::metadata::size_words);
}

PyObject* mla_metadata_words(PyObject*, PyObject* arg) {
  return plan_words_for(arg, opmesh::core::mla_plan::size_words);
}

PyObject* describe_mla_metadata(PyObject*, PyObject* args) {
  Py_buffer buffer;
  if (!PyArg_ParseTuple(args, "y*", &buffer)) return nullptr;
  opmesh::core::mla_plan::Plan plan;
  if (!read_words(buffer, opmesh::core::mla_plan::read, plan)) return nullptr;
  PyObject* workers = PyList_New(0);
  if (workers == nullptr) return nullptr;
  for (const auto& st : plan.workers) {
    PyObject* item =
        Py_BuildValue("((LL)(LL)d)", static_cast<long long>(st.begin.unit),
                      static_cast<long long>(st.begin.key), static_cast<long long>(st.end.unit),
                      static_cast<long long>(st.end.key), static_cast<double>(st.cost));
    if (item == nullptr || PyList_Append(workers, item) != 0) {
      Py_XDECREF(item);
      Py_DECREF(workers);
      return nullptr;
    }
    Py_DECREF(item);
  }
  PyObject* dict = PyDict_New();
  if (dict == nullptr) {
    Py_DECREF(workers);
    return nullptr;
  }
  const bool ok = set_item(dict, "operator", PyUnicode_FromString("sparse_flash_mla")) &&
                  set_item(dict, "num_workers", PyLong_FromSsize_t(plan.workers.size())) &&
                  set_item(dict, "rows", PyLong_FromLongLong(plan.rows)) &&
                  set_item(dict, "makespan", PyFloat_FromDouble(plan.makespan)) &&
                  set_item(dict, "lower_bound", PyFloat_FromDouble(plan.lower_bound)) &&
                  set_item(dict, "total_cost", PyFloat_FromDouble(plan.total_cost)) &&
                  set_item(dict, "workers", workers);
  if (!ok) {
    Py_DECREF(dict);
    return nullptr;
  }
  return dict;
}

PyMethodDef methods[] = {
    {"_mla_metadata_words", mla_metadata_words, METH_O,
     "Length of a sparse_flash_mla_metadata tensor planned for num_workers."},
    {"_describe_mla_metadata", describe_mla_metadata, METH_VARARGS,
     "Decodes the words of a sparse_flash_mla_metadata tensor into a dict."},
    {"_metadata_words", metadata_words, METH_O,
     "Length of a flash_attn_metadata tensor planned for num_workers."},
    {"_describe_metadata", describe_metadata, METH_VARARGS,
     "Decodes the words of a flash_attn_metadata tensor into a dict."},
    {"_plan_pieces", plan_pieces, METH_VARARGS,
     "Per-worker pieces of a plan with their modelled cost (ns)."},
    {"_kernel_sets", kernel_sets, METH_NOARGS, "(kernel sets usable now, amx tile implementation)"},
    {"_bf16_calibrate", bf16_calibrate, METH_VARARGS,
     "Measures the bf16 kernel choice for a kind of work and writes the calibration file."},
    {"_bf16_choice", bf16_choice, METH_O,
     "Which kernels bf16 inputs use for 'compute' or 'memory' work."},
    {"_set_worker_timing", set_worker_timing, METH_O,
     "Record per-logical-worker busy times of flash_attn calls (ns)."},
    {"_last_worker_times", last_worker_times, METH_NOARGS,
     "Busy times (ns) of each logical worker of the last recorded call."},
    {"supported_simd_levels", supported_simd_levels, METH_NOARGS,
     "SIMD levels this CPU and build support, lowest first."},
    {"active_simd_level", active_simd_level, METH_NOARGS,
     "The level the CPU kernels use now (capped by OPMESH_SIMD_MAX)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "opmesh operators (loaded for registration).",
                      -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* m = PyModule_Create(&module);
  // The kernels' token limit, which the Python layer compares band sides and windows with.
  if (m != nullptr &&
      PyModule_AddIntConstant(m, "MAX_TOKENS", opmesh::core::attention::kMaxTokens) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
