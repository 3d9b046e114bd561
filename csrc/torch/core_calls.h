// Helpers of the CPU kernels that hand tensors to the core: host copies of length arrays, the
// core's views of q/k/v-like tensors, and the core's ArgumentError as a Python ValueError.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "attention/flash_attn.h"
#include "errors.h"
#include "flash_attn_args.h"

namespace opmesh::binding {

// A host copy of an optional int32 length array.
struct HostInts {
  at::Tensor tensor;  // contiguous int32 on the CPU, or undefined
  const int32_t* data() const { return tensor.defined() ? tensor.data_ptr<int32_t>() : nullptr; }
};

// Lengths were checked (dtype, rank, entries, device) before: this only brings them to the host.
inline HostInts host_ints(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return {};
  return {t->to(at::kCPU).contiguous()};
}

// Host copies of a call's four length arrays (cu_seqlens_q/kv, seqused_q/kv), as the core reads
// them. Call is any call struct with those fields.
struct HostLengths {
  HostInts cq, ck, uq, uk;
  attn::LengthArrays arrays;
  template <class Call>
  explicit HostLengths(const Call& call)
      : cq(host_ints(call.cu_seqlens_q)),
        ck(host_ints(call.cu_seqlens_kv)),
        uq(host_ints(call.seqused_q)),
        uk(host_ints(call.seqused_kv)),
        arrays{cq.data(), ck.data(), uq.data(), uk.data()} {}
};

// A CPU kernel's optional size (concrete there).
inline std::optional<int64_t> concrete_or_none(const std::optional<c10::SymInt>& v) {
  if (!v.has_value()) return std::nullopt;
  return v->expect_int();
}

// The core's [batch][sequence][head][dim] view of a tensor in `layout`.
inline attn::View view_of(const at::Tensor& t, attn::Layout layout) {
  const Axes a = axes_of(layout);
  attn::View v;
  v.data = t.data_ptr();
  v.sb = a.b >= 0 ? t.stride(a.b) : 0;
  v.ss = t.stride(a.s);
  v.sn = t.stride(a.n);
  v.sd = t.stride(a.d);
  return v;
}

}  // namespace opmesh::binding
