// Runs the AOTInductor package of a decoder step that calls opmesh's operators, from C++ with
// no Python: libopmesh_ops registers the operators, libtorch's package loader runs the step.
// Checks the output and the in-place cache append against what Python computed.
//
// Usage: run_decoder_step DIR   (DIR from export_decoder_step.py)
#include <opmesh/ops.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<at::Tensor> out;
  for (const auto& value : torch::pickle_load(bytes).toList())
    out.push_back(value.get().toTensor());
  return out;
}

double max_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: run_decoder_step DIR\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::cout << "opmesh operator library " << opmesh::library_version() << "\n";
  std::vector<at::Tensor> inputs = load_tensors(dir + "/inputs.pt");
  const std::vector<at::Tensor> expected = load_tensors(dir + "/expected.pt");

  torch::inductor::AOTIModelPackageLoader loader(dir + "/decoder_step.pt2");
  std::vector<at::Tensor> outputs = loader.run(inputs);

  const double out_diff = max_difference(outputs.at(0), expected.at(0));
  const double k_diff = max_difference(inputs.at(1), expected.at(1));
  const double v_diff = max_difference(inputs.at(2), expected.at(2));
  std::cout << "output max difference " << out_diff << ", key cache " << k_diff << ", value cache "
            << v_diff << "\n";

  // The same attention through the typed C++ entry point, on the updated cache.
  opmesh::FlashAttnOptions options;
  options.block_table = inputs.at(3);
  options.seqused_kv = inputs.at(4);
  options.mask_mode = 3;
  const at::Tensor q = at::randn({inputs.at(0).size(0), 1, 8, 32});
  const auto [direct, lse] = opmesh::flash_attn(q, inputs.at(1), inputs.at(2), options);
  std::cout << "direct call output " << direct.sizes() << "\n";
  // Every keyword of the operator is an option: soft-capping at 1 changes the result, at 1e6
  // (far above every score) it does not.
  options.softcap = 1.0;
  const at::Tensor capped = std::get<0>(opmesh::flash_attn(q, inputs.at(1), inputs.at(2), options));
  options.softcap = 1e6;
  const at::Tensor loose = std::get<0>(opmesh::flash_attn(q, inputs.at(1), inputs.at(2), options));
  const double cap_diff = max_difference(capped, direct);
  const double loose_diff = max_difference(loose, direct);
  std::cout << "softcap 1 changes the output by " << cap_diff << ", softcap 1e6 by " << loose_diff
            << "\n";

  const bool ok = out_diff <= 1e-4 && k_diff == 0.0 && v_diff == 0.0 && direct.size(2) == 8 &&
                  cap_diff > 1e-3 && loose_diff <= 1e-5;
  std::cout << (ok ? "OK" : "MISMATCH") << "\n";
  return ok ? 0 : 1;
}
