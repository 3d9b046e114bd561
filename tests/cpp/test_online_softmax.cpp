#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "online_softmax.h"

namespace opmesh::core {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

SoftmaxStats direct(const std::vector<float>& x) {
  double m = -kInf;
  for (float v : x) m = std::max<double>(m, v);
  double s = 0;
  for (float v : x) s += std::exp(v - m);
  return {static_cast<float>(m), static_cast<float>(s)};
}

TEST(OnlineSoftmax, EmptyStateIsMinusInfZero) {
  SoftmaxStats s;
  EXPECT_EQ(s.max, -kInf);
  EXPECT_EQ(s.sum, 0.0f);
  absorb(s, nullptr, 0);
  EXPECT_EQ(s.max, -kInf);
  EXPECT_EQ(s.sum, 0.0f);
}

TEST(OnlineSoftmax, BlockwiseEqualsDirectForEveryBlockSize) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 30.0f);
  std::vector<float> x(301);
  for (float& v : x) v = dist(rng);
  const SoftmaxStats want = direct(x);
  for (int block : {1, 3, 64, 300, 301}) {
    SoftmaxStats s;
    for (size_t i = 0; i < x.size(); i += block) {
      absorb(s, x.data() + i, static_cast<int>(std::min<size_t>(block, x.size() - i)));
    }
    EXPECT_EQ(s.max, want.max) << "block " << block;
    EXPECT_NEAR(s.sum, want.sum, 1e-5 * want.sum) << "block " << block;
  }
}

TEST(OnlineSoftmax, MergeOfSplitsEqualsWhole) {
  const std::vector<float> x = {3.0f, -1.0f, 250.0f, 249.5f, -80.0f, 0.0f};
  const SoftmaxStats want = direct(x);
  for (size_t cut = 0; cut <= x.size(); ++cut) {
    SoftmaxStats a, b;
    absorb(a, x.data(), static_cast<int>(cut));
    absorb(b, x.data() + cut, static_cast<int>(x.size() - cut));
    const SoftmaxStats ab = merge(a, b);
    const SoftmaxStats ba = merge(b, a);
    EXPECT_EQ(ab.max, want.max);
    EXPECT_NEAR(ab.sum, want.sum, 1e-6 * want.sum);
    EXPECT_EQ(ab.max, ba.max);
    EXPECT_FLOAT_EQ(ab.sum, ba.sum);
  }
}

TEST(OnlineSoftmax, MergeWithEmptyIsIdentity) {
  const float x[] = {-1e30f, -1e30f};
  SoftmaxStats a;
  absorb(a, x, 2);
  const SoftmaxStats m = merge(a, SoftmaxStats{});
  EXPECT_EQ(m.max, a.max);
  EXPECT_EQ(m.sum, 2.0f);
  const SoftmaxStats e = merge(SoftmaxStats{}, SoftmaxStats{});
  EXPECT_EQ(e.max, -kInf);
  EXPECT_EQ(e.sum, 0.0f);
}

TEST(OnlineSoftmax, NanReachesBothStatistics) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (size_t where = 0; where < 3; ++where) {
    std::vector<float> x = {1.0f, 5.0f, -2.0f};
    x[where] = nan;
    SoftmaxStats s;
    absorb(s, x.data(), 3);
    EXPECT_TRUE(std::isnan(s.max)) << where;
    EXPECT_TRUE(std::isnan(s.sum)) << where;
    // A later finite block must not hide it, nor an earlier one.
    const float later[] = {100.0f};
    absorb(s, later, 1);
    EXPECT_TRUE(std::isnan(s.max)) << where;
    SoftmaxStats clean;
    absorb(clean, later, 1);
    EXPECT_TRUE(std::isnan(merge(clean, s).max)) << where;
  }
}

}  // namespace
}  // namespace opmesh::core
