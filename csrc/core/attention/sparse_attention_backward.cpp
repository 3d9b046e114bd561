// sparse_flash_attention's backward, deterministic for any executor:
// - pass 1, per query token: each head's log-sum-exp (from the statistics and the sink) and
//   delta = dout . out, dq (a sum over the token's selected keys in selection order) and the
//   token's share of dsinks;
// - pass 2, per block of keys: dk and dv of each key, summed over the tokens that selected it in
//   token order (each block owned by one worker, so no two workers add into one row);
// - dsinks: the tokens' shares summed in token order.
// P and dS are recomputed from q and k in both passes: no buffer grows with S1 x S2.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "sparse_attention.h"
#include "sparse_attention_detail.h"

namespace opmesh::core {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kTokensPerTask = 8;

void store_zeros(void* dst, DType dtype, int64_t n) {
  if (n > 0) std::memset(dst, 0, n * dtype_size(dtype));  // all-zero bits are 0 in every dtype
}

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t e = 0; e < n; ++e) acc += a[e] * b[e];
  return acc;
}

void axpy(float w, const float* x, float* y, int64_t n) {
  for (int64_t e = 0; e < n; ++e) y[e] += w * x[e];
}

class Backward {
 public:
  Backward(const SparseAttentionParams& p, const SparseAttentionGrads& gr)
      : p_(p), gr_(gr), geo_(p), g_(geo_.groups()), dqk_(p.head_dim + p.rope_dim) {
    const int64_t rows = p.layout_query == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
    lse_.assign(rows * p.heads_q, kInf);
    delta_.assign(rows * p.heads_q, 0.0f);
    if (p.sinks != nullptr) sink_share_.assign(rows * p.heads_q, 0.0f);
  }

  const sparse::Geometry& geometry() const { return geo_; }

  // The rows of one token and key head: query (query | rope), dout and out, G heads each.
  struct TokenRows {
    std::vector<float> q, dout, out;
  };

  void load_token(TokenRows& t, const Sequence& s, int64_t i, int64_t g) const {
    t.q.resize(g_ * dqk_);
    t.dout.resize(g_ * p_.value_dim);
    t.out.resize(g_ * p_.value_dim);
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      float* q = t.q.data() + r * dqk_;
      sparse::load(p_.query, p_.dtype, geo_.query_offset(p_.query_stride, s, i, h),
                   p_.query_stride[3], p_.head_dim, q);
      if (p_.rope_dim > 0) {
        sparse::load(p_.query_rope, p_.dtype, geo_.query_offset(p_.query_rope_stride, s, i, h),
                     p_.query_rope_stride[3], p_.rope_dim, q + p_.head_dim);
      }
      sparse::load(gr_.dout, p_.dtype, geo_.query_offset(gr_.dout_stride, s, i, h),
                   gr_.dout_stride[3], p_.value_dim, t.dout.data() + r * p_.value_dim);
      sparse::load(gr_.out, p_.dtype, geo_.query_offset(gr_.out_stride, s, i, h), gr_.out_stride[3],
                   p_.value_dim, t.out.data() + r * p_.value_dim);
    }
  }

  void load_key(const Sequence& s, int64_t j, int64_t g, float* k, float* v) const {
    sparse::load(p_.key, p_.dtype, geo_.key_offset(p_.key_stride, s, j, g), p_.key_stride[3],
                 p_.head_dim, k);
    if (p_.rope_dim > 0) {
      sparse::load(p_.key_rope, p_.dtype, geo_.key_offset(p_.key_rope_stride, s, j, g),
                   p_.key_rope_stride[3], p_.rope_dim, k + p_.head_dim);
    }
    sparse::load(p_.value, p_.dtype, geo_.key_offset(p_.value_stride, s, j, g), p_.value_stride[3],
                 p_.value_dim, v);
  }

  // Pass 1 for token i of s and key head g.
  // Writes the token's rows of lse_, delta_ and sink_share_ (no other task touches them).
  void query_pass(const Sequence& s, int64_t i, int64_t g, std::vector<int32_t>& keys, TokenRows& t,
                  std::vector<float>& kv) {
    load_token(t, s, i, g);
    const int64_t row = geo_.token(s, i) * p_.heads_q + g * g_;
    const int64_t stats = geo_.stats_offset(s, i, g);
    std::vector<float> dq(g_ * dqk_, 0.0f);
    float* lse = lse_.data() + row;
    float* delta = delta_.data() + row;
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      const float m = gr_.softmax_max[stats + r];
      const float l = gr_.softmax_sum[stats + r];
      delta[r] =
          dot(t.dout.data() + r * p_.value_dim, t.out.data() + r * p_.value_dim, p_.value_dim);
      if (m == -kInf) {
        lse[r] = kInf;  // nothing selected: no probability anywhere
        continue;
      }
      const float sink = p_.sinks != nullptr ? std::exp(p_.sinks[h] - m) : 0.0f;
      lse[r] = m + std::log(l + sink);
      if (p_.sinks != nullptr) {
        sink_share_[row + r] = -std::exp(p_.sinks[h] - lse[r]) * delta[r];
      }
    }
    geo_.select(s, i, g, keys);
    kv.resize(dqk_ + p_.value_dim);
    float* k = kv.data();
    float* v = k + dqk_;
    for (int32_t j : keys) {
      load_key(s, j, g, k, v);
      for (int64_t r = 0; r < g_; ++r) {
        if (lse[r] == kInf) continue;
        const float* q = t.q.data() + r * dqk_;
        const float p = std::exp(p_.scale * dot(q, k, dqk_) - lse[r]);
        const float dp = dot(t.dout.data() + r * p_.value_dim, v, p_.value_dim);
        axpy(p_.scale * p * (dp - delta[r]), k, dq.data() + r * dqk_, dqk_);
      }
    }
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      store_row(gr_.dq, p_.dtype, (geo_.token(s, i) * p_.heads_q + h) * p_.head_dim, 1, p_.head_dim,
                dq.data() + r * dqk_, 1.0f);
      if (p_.rope_dim > 0) {
        store_row(gr_.dq_rope, p_.dtype, (geo_.token(s, i) * p_.heads_q + h) * p_.rope_dim, 1,
                  p_.rope_dim, dq.data() + r * dqk_ + p_.head_dim, 1.0f);
      }
    }
  }

  // Pass 2: keys [j0, j1) of sequence s and key head g.
  void key_pass(const Sequence& s, int64_t g, int64_t j0, int64_t j1, std::vector<int32_t>& keys,
                TokenRows& t) const {
    const int64_t n = j1 - j0;
    std::vector<float> dk(n * dqk_, 0.0f), dv(n * p_.value_dim, 0.0f);
    std::vector<float> kv(dqk_ + p_.value_dim);
    float* k = kv.data();
    float* v = k + dqk_;
    for (int64_t i = 0; i < s.q_len; ++i) {
      geo_.select(s, i, g, keys);
      bool loaded = false;
      const int64_t row = geo_.token(s, i) * p_.heads_q + g * g_;
      for (int32_t j : keys) {
        if (j < j0 || j >= j1) continue;
        if (!loaded) {
          load_token(t, s, i, g);
          loaded = true;
        }
        load_key(s, j, g, k, v);
        float* dkj = dk.data() + (j - j0) * dqk_;
        float* dvj = dv.data() + (j - j0) * p_.value_dim;
        for (int64_t r = 0; r < g_; ++r) {
          const float lse = lse_[row + r];
          if (lse == kInf) continue;
          const float* q = t.q.data() + r * dqk_;
          const float* dout = t.dout.data() + r * p_.value_dim;
          const float p = std::exp(p_.scale * dot(q, k, dqk_) - lse);
          const float dp = dot(dout, v, p_.value_dim);
          axpy(p, dout, dvj, p_.value_dim);
          axpy(p_.scale * p * (dp - delta_[row + r]), q, dkj, dqk_);
        }
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t key_row = key_row_of(s, j) * p_.heads_k + g;
      store_row(gr_.dk, p_.dtype, key_row * p_.head_dim, 1, p_.head_dim,
                dk.data() + (j - j0) * dqk_, 1.0f);
      if (p_.rope_dim > 0) {
        store_row(gr_.dk_rope, p_.dtype, key_row * p_.rope_dim, 1, p_.rope_dim,
                  dk.data() + (j - j0) * dqk_ + p_.head_dim, 1.0f);
      }
      store_row(gr_.dv, p_.dtype, key_row * p_.value_dim, 1, p_.value_dim,
                dv.data() + (j - j0) * p_.value_dim, 1.0f);
    }
  }

  void finish_sinks() const {
    if (gr_.dsinks == nullptr) return;
    std::fill(gr_.dsinks, gr_.dsinks + p_.heads_q, 0.0f);
    if (p_.sinks == nullptr) return;
    const int64_t rows = static_cast<int64_t>(sink_share_.size()) / p_.heads_q;
    std::vector<double> sum(p_.heads_q, 0.0);
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t h = 0; h < p_.heads_q; ++h) sum[h] += sink_share_[t * p_.heads_q + h];
    }
    for (int64_t h = 0; h < p_.heads_q; ++h) gr_.dsinks[h] = static_cast<float>(sum[h]);
  }

  // Key row j of s in the key tensor's token order (BSND b * S2 + j, TND k_begin + j).
  int64_t key_row_of(const Sequence& s, int64_t j) const {
    return p_.layout_kv == Layout::kTND ? s.k_begin + j : s.batch * p_.seq_k + j;
  }

 private:
  const SparseAttentionParams& p_;
  const SparseAttentionGrads& gr_;
  sparse::Geometry geo_;
  int64_t g_;
  int64_t dqk_;
  std::vector<float> lse_;         // [rows][N1]: +inf where nothing is selected
  std::vector<float> delta_;       // [rows][N1]
  std::vector<float> sink_share_;  // [rows][N1]
};

}  // namespace

void sparse_flash_attention_backward(const SparseAttentionParams& p, const SparseAttentionGrads& gr,
                                     const Executor& executor, Isa isa) {
  if (p.layout_kv == Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", "PA_BSND (paged keys and values) has no backward");
  }
  validate(p);
  if (!isa_supported(isa)) {
    throw ArgumentError("isa", std::string(isa_name(isa)) + " is not supported by this CPU");
  }
  const int64_t q_rows = p.layout_query == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
  const int64_t k_rows = p.layout_kv == Layout::kTND ? p.seq_k : p.batch * p.seq_k;
  // Rows no pass reaches (past a length) are zero.
  store_zeros(gr.dq, p.dtype, q_rows * p.heads_q * p.head_dim);
  store_zeros(gr.dk, p.dtype, k_rows * p.heads_k * p.head_dim);
  store_zeros(gr.dv, p.dtype, k_rows * p.heads_k * p.value_dim);
  if (p.rope_dim > 0) {
    store_zeros(gr.dq_rope, p.dtype, q_rows * p.heads_q * p.rope_dim);
    store_zeros(gr.dk_rope, p.dtype, k_rows * p.heads_k * p.rope_dim);
  }
  Backward run(p, gr);
  const std::vector<Sequence>& seqs = run.geometry().sequences();
  const int threads = std::max(1, executor.num_workers());

  struct Tokens {
    int32_t b;
    int64_t i0, i1;
  };
  std::vector<Tokens> token_tasks;
  for (const Sequence& s : seqs) {
    for (int64_t i = 0; i < s.q_len; i += kTokensPerTask) {
      token_tasks.push_back(
          {static_cast<int32_t>(s.batch), i, std::min(s.q_len, i + kTokensPerTask)});
    }
  }
  run_dynamic(executor, static_cast<int64_t>(token_tasks.size()), [&](int64_t t, int) {
    std::vector<int32_t> keys;
    Backward::TokenRows rows;
    std::vector<float> kv;
    const Tokens& task = token_tasks[t];
    for (int64_t i = task.i0; i < task.i1; ++i) {
      for (int64_t g = 0; g < p.heads_k; ++g) run.query_pass(seqs[task.b], i, g, keys, rows, kv);
    }
  });

  // Key blocks: about four per thread per (sequence, key head), at least 64 keys each.
  struct Keys {
    int32_t b;
    int64_t g, j0, j1;
  };
  std::vector<Keys> key_tasks;
  for (const Sequence& s : seqs) {
    const int64_t block = std::max<int64_t>(64, (s.k_len + 4 * threads - 1) / (4 * threads));
    for (int64_t g = 0; g < p.heads_k; ++g) {
      for (int64_t j = 0; j < s.k_len; j += block) {
        key_tasks.push_back({static_cast<int32_t>(s.batch), g, j, std::min(s.k_len, j + block)});
      }
    }
  }
  run_dynamic(executor, static_cast<int64_t>(key_tasks.size()), [&](int64_t t, int) {
    std::vector<int32_t> keys;
    Backward::TokenRows rows;
    const Keys& task = key_tasks[t];
    run.key_pass(seqs[task.b], task.g, task.j0, task.j1, keys, rows);
  });
  run.finish_sinks();
}

}  // namespace opmesh::core
