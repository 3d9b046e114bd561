// compressor and its backward on MindSpore tensors: the shapes were checked by the shared torch
// shape functions in Python; the core checks the values and computes. The state cache is one of
// the runner's inputs (contiguous, so MindSpore hands over its own memory) and written in place,
// as are the projections the forward keeps for the backward.
#include <algorithm>
#include <memory>
#include <vector>

#include "compressor/compressor.h"
#include "compressor_params.h"
#include "ms_call.h"

namespace opmesh::ms_binding {
namespace {

// The core's params of a call without tensor pointers (added in the runner), and the host
// arrays they point into.
template <class Call>
core::CompressorParams base_params(const Call& c, std::shared_ptr<common::CompressorHost>& host) {
  host = std::make_shared<common::CompressorHost>(common::compressor_host(c));
  return checked([&] { return common::compressor_params(c, *host); });
}

// cmp_kv's shape: [B, ceil(S / r), D], or [min(T, T // r + B), D] for x [T, H].
std::vector<int64_t> cmp_kv_shape(const core::CompressorParams& p) {
  const int64_t r = p.cmp_ratio;
  if (p.packed) return {std::min(p.tokens, p.tokens / r + p.batch), p.dim};
  return {p.batch, (p.seq_len + r - 1) / r, p.dim};
}

}  // namespace

py::object compressor(const CompressorCall& call) {
  resolve({&call.x, &call.wkv, &call.wgate, &call.state_cache, &call.ape});
  resolve(call.projections);
  std::shared_ptr<common::CompressorHost> host;
  const core::CompressorParams base = base_params(call, host);
  const std::vector<OutputSpec> outs{{call.x.data_type(), cmp_kv_shape(base)}};
  return launch(
      "OpmeshCompressor", inputs_of(call), outs,
      [call, base, host](const std::vector<ms::Tensor>& in, std::vector<ms::Tensor>& out) {
        const CompressorCall c = with_inputs(call, in);
        core::CompressorParams p = base;
        common::point_compressor(p, c, out[0]);
        checked([&] {
          cpu_kernels().compressor(p, ThreadExecutor());
          return 0;
        });
      });
}

py::object compressor_backward(const CompressorBackwardCall& call) {
  resolve({&call.grad_cmp_kv, &call.x, &call.wkv, &call.wgate, &call.ape});
  resolve(call.projections);
  std::shared_ptr<common::CompressorHost> host;
  const core::CompressorParams base = base_params(call, host);
  const std::vector<OutputSpec> outs{{call.x.data_type(), call.x.shape()},
                                     {call.wkv.data_type(), call.wkv.shape()},
                                     {call.wgate.data_type(), call.wgate.shape()},
                                     {call.ape.data_type(), call.ape.shape()}};
  return launch(
      "OpmeshCompressorGrad", inputs_of(call), outs,
      [call, base, host](const std::vector<ms::Tensor>& in, std::vector<ms::Tensor>& out) {
        const CompressorBackwardCall c = with_inputs(call, in);
        core::CompressorParams p = base;
        common::point_compressor(p, c, c.grad_cmp_kv);
        const core::CompressorGrads g =
            common::compressor_grads(p, c.grad_cmp_kv, out[0], out[1], out[2], out[3]);
        checked([&] {
          cpu_kernels().compressor_backward(p, g, ThreadExecutor());
          return 0;
        });
      });
}

}  // namespace opmesh::ms_binding
