// Argument handling shared by the CPU and Meta kernels of flash_attn and flash_attn_metadata:
// everything that can be decided from devices, dtypes, ranks, sizes and argument values without
// reading tensor data. The Meta kernel runs exactly these checks, so a shape function (and so
// torch.export) refuses what the CPU kernel would refuse, with the same message.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string_view>

#include "attention/config.h"
#include "checks.h"
#include "conventions.h"
#include "errors.h"
#include "op_call.h"

namespace opmesh::binding {

namespace attn = core::attention;

// Positions of the batch, sequence, head and dim axes of a q/k/v tensor in `layout`
// (-1: absent). Paged caches read as [block][slot][head][dim].
struct Axes {
  int b, s, n, d;
  int rank;
};
Axes axes_of(attn::Layout layout);

struct FlashAttnArgs {
  attn::PlanConfig config;  // heads, dims, layouts, mask, windows; batch_size when concrete
  c10::SymInt batch;        // q's batch (TND: the number of cu_seqlens_q entries - 1)
  Axes qa{};
  Axes ka{};
  bool paged = false;
  bool q_tnd = false;
  bool kv_tnd = false;
  bool no_heads = false;       // q and k have 0 heads: no rows, empty outputs, the core not called
  float softmax_scale = 0.0f;  // the given scale, or 1 / sqrt(head_dim)
};

// The checks in order: devices, dtypes, layouts and ranks, shapes and size limits, argument
// values. Every failure is a Python exception whose message starts with the argument's name.
// (return_softmax_lse is not read.)
FlashAttnArgs check_flash_attn_args(const FlashAttnCall& call);

// flash_attn's outputs for checked arguments, uninitialised: attn_out in layout_out with v's
// head dim, and the lse ([B, Nq, S1] / [Nq, T1]) or an empty tensor.
std::tuple<at::Tensor, at::Tensor> flash_attn_outputs(const at::Tensor& q, const at::Tensor& v,
                                                      const FlashAttnArgs& args,
                                                      bool return_softmax_lse);

// A length array of flash_attn_metadata: int32, 1-D, `count` entries, on one device whose
// memory the host can read (never meta).
void check_plan_lengths(const std::optional<at::Tensor>& t, const char* name,
                        const c10::SymInt& count);

}  // namespace opmesh::binding
