// The schemas of every opmesh operator, and only here. Kernels register per backend in their own
// files.
#include <torch/library.h>

TORCH_LIBRARY(opmesh, m) {
  m.def(
      "dense_lightning_indexer_softmax_lse(Tensor query_index, Tensor key_index, Tensor weights, "
      "*, "
      "Tensor? actual_seq_qlen=None, Tensor? actual_seq_klen=None, str layout=\"BSND\", "
      "int sparse_mode=3, int pre_tokens=9223372036854775807, "
      "int next_tokens=9223372036854775807) -> (Tensor softmax_max, Tensor softmax_sum)");
  m.def(
      "dense_lightning_indexer_grad_kl_loss(Tensor query, Tensor key, Tensor query_index, "
      "Tensor key_index, Tensor weights, Tensor softmax_max, Tensor softmax_sum, "
      "Tensor softmax_max_index, Tensor softmax_sum_index, float scale_value=1.0, *, "
      "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? actual_seq_qlen=None, "
      "Tensor? actual_seq_klen=None, str layout=\"BSND\", int sparse_mode=3, "
      "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807) -> "
      "(Tensor d_query_index, Tensor d_key_index, Tensor d_weights, Tensor loss)");
  m.def(
      "flash_attn_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, "
      "int? head_dim_v=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
      "Tensor? seqused_q=None, Tensor? seqused_kv=None, SymInt batch_size, SymInt max_seqlen_q, "
      "SymInt max_seqlen_kv, int mask_mode=0, int win_left=-1, int win_right=-1, "
      "str layout_q=\"BSND\", str layout_kv=\"BSND\", str layout_out=\"BSND\", "
      "int? num_workers=None, bool deterministic=False, bool backward=False) -> Tensor");
  m.def(
      "flash_attn(Tensor q, Tensor k, Tensor v, *, Tensor? block_table=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, Tensor? seqused_q=None, "
      "Tensor? seqused_kv=None, Tensor? sinks=None, Tensor? metadata=None, "
      "float? softmax_scale=None, int mask_mode=0, int win_left=-1, int win_right=-1, "
      "SymInt? max_seqlen_q=None, SymInt? max_seqlen_kv=None, str layout_q=\"BSND\", "
      "str layout_kv=\"BSND\", str layout_out=\"BSND\", bool return_softmax_lse=False) "
      "-> (Tensor attn_out, Tensor softmax_lse)");
  // flash_attn's gradients (autograd.cpp calls it; its kernels are in flash_attn_backward.cpp).
  m.def(
      "flash_attn_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, *, "
      "Tensor? dlse=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
      "Tensor? seqused_q=None, Tensor? seqused_kv=None, Tensor? sinks=None, "
      "float? softmax_scale=None, int mask_mode=0, int win_left=-1, int win_right=-1, "
      "SymInt? max_seqlen_q=None, SymInt? max_seqlen_kv=None, str layout_q=\"BSND\", "
      "str layout_kv=\"BSND\", str layout_out=\"BSND\", Tensor? metadata=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def(
      "kv_cache_write_(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, *, "
      "str layout=\"BSND\") -> (Tensor out, Tensor lse)");
}
