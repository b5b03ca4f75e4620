// PowerSGD: its kernels against double-precision references, and its bucket op over real ranks
// against a double-precision reference of one step of the algorithm.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "compress/powersgd_kernels.h"
#include "ops/powersgd.h"
#include "ranks.h"

namespace rumor {
namespace {

namespace psgd = compress::powersgd;
using testing::make_world;
using testing::quick_options;
using testing::run_ranks;

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

std::vector<const psgd::KernelSet*> sets() {
  std::vector<const psgd::KernelSet*> s{psgd::kernel_set(psgd::Isa::kGeneric)};
  if (const auto* a = psgd::kernel_set(psgd::Isa::kAvx2)) s.push_back(a);
  return s;
}

struct Shape {
  size_t n, m;
  uint32_t k;
};
const Shape kShapes[] = {{1, 1, 1},  {3, 17, 1}, {5, 33, 2}, {7, 100, 3},
                         {9, 64, 4}, {4, 50, 5}, {2, 31, 7}, {6, 16, 6}};

// |got - want| within a few float roundings of the sum of the magnitudes that entered it.
void expect_close(float got, double want, double magnitude, const std::string& where) {
  EXPECT_NEAR(got, want, 1e-6 * magnitude + 1e-30) << where;
}

TEST(PowerSgdKernels, ProjectMatchesDouble) {
  for (const auto* ks : sets()) {
    for (const auto& s : kShapes) {
      auto a = randn(s.n * s.m, 1), add = randn(s.n * s.m, 2), qt = randn(s.k * s.m, 3);
      for (bool with_add : {false, true}) {
        auto x = a;
        std::vector<float> p(s.n * s.k);
        ks->project(x.data(), with_add ? add.data() : nullptr, s.n, s.m, qt.data(), s.k, p.data());
        for (size_t i = 0; i < s.n; ++i) {
          for (size_t j = 0; j < s.m; ++j)
            ASSERT_EQ(x[i * s.m + j], with_add ? a[i * s.m + j] + add[i * s.m + j] : a[i * s.m + j]);
          for (uint32_t c = 0; c < s.k; ++c) {
            double want = 0, mag = 0;
            for (size_t j = 0; j < s.m; ++j) {
              want += double(x[i * s.m + j]) * qt[c * s.m + j];
              mag += std::abs(double(x[i * s.m + j]) * qt[c * s.m + j]);
            }
            expect_close(p[i * s.k + c], want, mag, std::string(ks->isa) + " project");
          }
        }
      }
    }
  }
}

TEST(PowerSgdKernels, BackProjectMatchesDouble) {
  for (const auto* ks : sets()) {
    for (const auto& s : kShapes) {
      auto a = randn(s.n * s.m, 4), p = randn(s.n * s.k, 5);
      std::vector<float> qt(s.k * s.m, 123.f);  // overwritten, not accumulated into
      ks->back_project(a.data(), s.n, s.m, p.data(), s.k, qt.data());
      for (uint32_t c = 0; c < s.k; ++c)
        for (size_t j = 0; j < s.m; ++j) {
          double want = 0, mag = 0;
          for (size_t i = 0; i < s.n; ++i) {
            want += double(a[i * s.m + j]) * p[i * s.k + c];
            mag += std::abs(double(a[i * s.m + j]) * p[i * s.k + c]);
          }
          expect_close(qt[c * s.m + j], want, mag, std::string(ks->isa) + " back_project");
        }
    }
  }
}

// Every rank must turn the same reduced P and Q into the same bits, whatever its CPU.
TEST(PowerSgdKernels, ReconstructIsExactOrderAndIsaIndependent) {
  for (const auto& s : kShapes) {
    auto p = randn(s.n * s.k, 6), qt = randn(s.k * s.m, 7), e0 = randn(s.n * s.m, 8);
    std::vector<std::vector<float>> outs;
    for (const auto* ks : sets()) {
      std::vector<float> out(s.n * s.m), err = e0;
      ks->reconstruct(p.data(), s.n, s.k, qt.data(), s.m, out.data(), err.data());
      for (size_t i = 0; i < s.n; ++i)
        for (size_t j = 0; j < s.m; ++j) {
          float v = p[i * s.k] * qt[j];
          for (uint32_t c = 1; c < s.k; ++c) {
            const float prod = p[i * s.k + c] * qt[c * s.m + j];
            v = v + prod;
          }
          ASSERT_EQ(out[i * s.m + j], v) << ks->isa;
          ASSERT_EQ(err[i * s.m + j], e0[i * s.m + j] - v) << ks->isa;
        }
      outs.push_back(out);
    }
    for (const auto& o : outs) EXPECT_EQ(o, outs.front());
  }
}

TEST(PowerSgdKernels, OrthogonalizeGramSchmidt) {
  for (const auto& s : kShapes) {
    if (s.k > s.n) continue;
    auto x = randn(s.n * s.k, 9);
    const auto x0 = x;
    std::vector<double> scratch(s.n * s.k);
    psgd::orthogonalize(x.data(), s.n, s.k, 0.0, scratch.data());
    for (uint32_t a = 0; a < s.k; ++a)
      for (uint32_t b = 0; b < s.k; ++b) {
        double dot = 0;
        for (size_t i = 0; i < s.n; ++i) dot += double(x[i * s.k + a]) * x[i * s.k + b];
        EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << s.n << "x" << s.k << " columns " << a << "," << b;
      }
    // The first column keeps its direction: x0[:,0] / |x0[:,0]|.
    double norm = 0;
    for (size_t i = 0; i < s.n; ++i) norm += double(x0[i * s.k]) * x0[i * s.k];
    norm = std::sqrt(norm);
    for (size_t i = 0; i < s.n; ++i) EXPECT_EQ(x[i * s.k], static_cast<float>(x0[i * s.k] * (1.0 / norm)));
  }
  // epsilon: column / (norm + epsilon); a zero column stays zero with or without it.
  std::vector<float> x{3.f, 0.f, 4.f, 0.f};  // 2 x 2, second column zero
  std::vector<double> scratch(4);
  psgd::orthogonalize(x.data(), 2, 2, 0.0, scratch.data());
  EXPECT_EQ(x, (std::vector<float>{0.6f, 0.f, 0.8f, 0.f}));
  x = {3.f, 0.f, 4.f, 0.f};
  psgd::orthogonalize(x.data(), 2, 2, 1.0, scratch.data());
  EXPECT_EQ(x[0], static_cast<float>(3.0 * (1.0 / 6.0)));
  EXPECT_EQ(x[2], static_cast<float>(4.0 * (1.0 / 6.0)));
  EXPECT_EQ(x[1], 0.f);
  EXPECT_EQ(x[3], 0.f);
}

// Reference of one compressing step over all ranks in double: returns the averaged bucket, and
// per rank the new error; P and Q after the step.
struct RefOut {
  std::vector<double> out, p, q;
  std::vector<std::vector<double>> err;
};

void gs(std::vector<double>& x, size_t n, uint32_t k) {
  for (uint32_t c = 0; c < k; ++c) {
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += x[i * k + c] * x[i * k + c];
    const double inv = 1.0 / std::sqrt(ss);
    for (size_t i = 0; i < n; ++i) x[i * k + c] *= inv;
    for (uint32_t d = c + 1; d < k; ++d) {
      double dot = 0;
      for (size_t i = 0; i < n; ++i) dot += x[i * k + c] * x[i * k + d];
      for (size_t i = 0; i < n; ++i) x[i * k + d] -= dot * x[i * k + c];
    }
  }
}

TEST(PowerSgdOp, ThreeRanksMatchDoubleReferenceAndAgree) {
  // Bucket: a 6 x 40 matrix (rank 2), a 5-element vector, a 30 x 8 matrix (rank 2).
  ops::PowerSgdConfig cfg;
  cfg.matrices = {{0, 6, 40, 2, 0, 0}, {245, 30, 8, 2, 12, 80}};
  cfg.uncompressed = {{240, 5}};
  const size_t count = 245 + 240, p_count = 12 + 60, q_count = 80 + 16;
  const uint32_t world = 3;
  auto w = make_world(testing::one_host(world), quick_options(false));
  const auto q0 = randn(q_count, 77);  // the same initial Q on every rank
  std::vector<std::vector<float>> grads, outs(world), errs_out(world), ps(world), qs(world);
  std::vector<std::vector<float>> err0;
  for (uint32_t r = 0; r < world; ++r) {
    grads.push_back(randn(count, 100 + r));
    err0.push_back(randn(count, 200 + r));
    for (const auto& u : cfg.uncompressed)
      std::fill(err0[r].begin() + u.offset, err0[r].begin() + u.offset + u.count, 0.f);
  }
  auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
    std::vector<float> p(p_count), q = q0, e = err0[r], g = grads[r];
    ops::PowerSgdBucketOp op(cfg, count, p.data(), p_count, q.data(), q_count, e.data());
    op.set_compressing(true);
    op.run(c, g.data(), count, DType::F32);
    outs[r] = g;
    errs_out[r] = e;
    ps[r] = p;
    qs[r] = q;
  });
  testing::expect_all_ok(errs);
  if (HasFailure()) return;
  for (uint32_t r = 1; r < world; ++r) {
    EXPECT_EQ(outs[r], outs[0]) << "rank " << r;
    EXPECT_EQ(ps[r], ps[0]) << "rank " << r;
    EXPECT_EQ(qs[r], qs[0]) << "rank " << r;
  }
  // The reference.
  std::vector<double> out(count, 0.0);
  for (const auto& u : cfg.uncompressed)
    for (size_t i = 0; i < u.count; ++i) {
      for (uint32_t r = 0; r < world; ++r) out[u.offset + i] += grads[r][u.offset + i];
      out[u.offset + i] /= world;
    }
  for (const auto& mx : cfg.matrices) {
    std::vector<double> q(q0.begin() + mx.q_offset, q0.begin() + mx.q_offset + mx.m * mx.k);
    gs(q, mx.m, mx.k);
    std::vector<std::vector<double>> mats(world, std::vector<double>(mx.n * mx.m));
    std::vector<double> p(mx.n * mx.k, 0.0), qn(mx.m * mx.k, 0.0);
    for (uint32_t r = 0; r < world; ++r)
      for (size_t t = 0; t < mx.n * mx.m; ++t)
        mats[r][t] = double(grads[r][mx.offset + t]) + err0[r][mx.offset + t];
    for (uint32_t r = 0; r < world; ++r)
      for (size_t i = 0; i < mx.n; ++i)
        for (uint32_t c = 0; c < mx.k; ++c)
          for (size_t j = 0; j < mx.m; ++j) p[i * mx.k + c] += mats[r][i * mx.m + j] * q[j * mx.k + c];
    gs(p, mx.n, mx.k);
    for (uint32_t r = 0; r < world; ++r)
      for (size_t j = 0; j < mx.m; ++j)
        for (uint32_t c = 0; c < mx.k; ++c)
          for (size_t i = 0; i < mx.n; ++i)
            qn[j * mx.k + c] += mats[r][i * mx.m + j] * p[i * mx.k + c] / world;
    for (size_t t = 0; t < mx.n * mx.k; ++t) EXPECT_NEAR(ps[0][mx.p_offset + t], p[t], 1e-4);
    for (size_t t = 0; t < mx.m * mx.k; ++t) EXPECT_NEAR(qs[0][mx.q_offset + t], qn[t], 1e-4);
    for (size_t i = 0; i < mx.n; ++i)
      for (size_t j = 0; j < mx.m; ++j) {
        double v = 0;
        for (uint32_t c = 0; c < mx.k; ++c) v += p[i * mx.k + c] * qn[j * mx.k + c];
        out[mx.offset + i * mx.m + j] = v;
        for (uint32_t r = 0; r < world; ++r)
          EXPECT_NEAR(errs_out[r][mx.offset + i * mx.m + j], mats[r][i * mx.m + j] - v, 1e-4);
      }
  }
  for (size_t t = 0; t < count; ++t) EXPECT_NEAR(outs[0][t], out[t], 1e-4) << t;
  for (uint32_t r = 0; r < world; ++r)
    for (const auto& u : cfg.uncompressed)
      for (size_t i = 0; i < u.count; ++i) EXPECT_EQ(errs_out[r][u.offset + i], 0.f);
}

// Half-precision wire: P, Q and the uncompressed values are rounded before the sums; every rank
// still ends with the same bits, within half precision of the float32 wire's result.
TEST(PowerSgdOp, HalfWireAgreesAcrossRanks) {
  for (DType wire : {DType::F16, DType::BF16}) {
    ops::PowerSgdConfig cfg;
    cfg.matrices = {{0, 12, 20, 2, 0, 0}};
    cfg.uncompressed = {{240, 7}};
    const size_t count = 247, p_count = 24, q_count = 40;
    const uint32_t world = 3;
    auto w = make_world(testing::one_host(world), quick_options(false));
    const auto q0 = randn(q_count, 5);
    std::vector<std::vector<float>> half(world), full(world);
    auto errs = run_ranks(w, [&](Communicator& c, uint32_t r) {
      for (DType d : {wire, DType::F32}) {
        auto cfg_d = cfg;
        cfg_d.wire = d;
        std::vector<float> p(p_count), q = q0, e(count, 0.f), g = randn(count, 300 + r);
        ops::PowerSgdBucketOp op(cfg_d, count, p.data(), p_count, q.data(), q_count, e.data());
        op.set_compressing(true);
        op.run(c, g.data(), count, DType::F32);
        (d == wire ? half : full)[r] = g;
      }
    });
    testing::expect_all_ok(errs);
    if (HasFailure()) return;
    const double tol = wire == DType::F16 ? 1e-2 : 5e-2;
    for (uint32_t r = 0; r < world; ++r) {
      EXPECT_EQ(half[r], half[0]) << "rank " << r;
      for (size_t t = 0; t < count; ++t)
        EXPECT_NEAR(half[r][t], full[r][t], tol * (1 + std::abs(full[r][t]))) << dtype_name(wire) << " " << t;
    }
    EXPECT_NE(half[0], full[0]) << "the wire dtype changed nothing";
  }
}

TEST(PowerSgdOp, RejectsLayoutsThatDoNotTileTheBucket) {
  std::vector<float> p(64), q(64), e(100);
  auto make = [&](ops::PowerSgdConfig cfg, size_t count) {
    ops::PowerSgdBucketOp op(std::move(cfg), count, p.data(), 64, q.data(), 64, e.data());
  };
  ops::PowerSgdConfig gap;
  gap.matrices = {{0, 4, 4, 1, 0, 0}};
  gap.uncompressed = {{20, 5}};
  EXPECT_THROW(make(gap, 25), Error);
  ops::PowerSgdConfig overlap;
  overlap.matrices = {{0, 4, 4, 1, 0, 0}};
  overlap.uncompressed = {{10, 15}};
  EXPECT_THROW(make(overlap, 25), Error);
  ops::PowerSgdConfig rank;
  rank.matrices = {{0, 4, 4, 5, 0, 0}};
  EXPECT_THROW(make(rank, 16), Error);
  ops::PowerSgdConfig outside;
  outside.matrices = {{0, 4, 4, 1, 0, 62}};
  EXPECT_THROW(make(outside, 16), Error);
  ops::PowerSgdConfig fine;
  fine.matrices = {{0, 4, 4, 1, 0, 0}};
  fine.uncompressed = {{16, 9}};
  EXPECT_NO_THROW(make(fine, 25));
}

}  // namespace
}  // namespace rumor
