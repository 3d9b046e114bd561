// Helpers of the CPU kernels that hand tensors to the core: host copies of length arrays and the
// concrete sizes of a CPU call.
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

}  // namespace opmesh::binding
