// The schemas of every opmesh operator. Kernels register per backend in their own files.
#include <torch/library.h>

TORCH_LIBRARY(opmesh, m) {
  m.def(
      "dense_lightning_indexer_softmax_lse(Tensor query_index, Tensor key_index, Tensor weights, "
      "*, "
      "Tensor? actual_seq_qlen=None, Tensor? actual_seq_klen=None, str layout=\"BSND\", "
      "int sparse_mode=3) -> (Tensor softmax_max, Tensor softmax_sum)");
}
