// The fused optimizer kernels against a plain double-precision reference of torch.optim's SGD and
// Adam/AdamW updates, for both instruction sets. Over 50 steps the float kernels must stay
// within 2e-6 relative (of max(|reference|, lr * steps)) of the reference: a few float roundings
// per step, with no drift from a wrong operation order or coefficient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/types.h"
#include "optim/optim_kernels.h"

namespace rumor::optim {
namespace {

std::vector<const KernelSet*> sets() {
  std::vector<const KernelSet*> out{kernel_set(Isa::kGeneric)};
  if (const KernelSet* s = kernel_set(Isa::kAvx2)) out.push_back(s);
  return out;
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double floor,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), floor);
    worst = std::max(worst, err);
  }
  EXPECT_LE(worst, 2e-6) << what;
}

struct SgdCase {
  double lr, momentum, dampening, wd;
  bool nesterov, maximize;
};

TEST(Optim, SgdMatchesDoubleReference) {
  const size_t n = 1037;  // not a multiple of any vector width
  const int steps = 50;
  const SgdCase cases[] = {{0.1, 0, 0, 0, false, false},      {0.05, 0.9, 0, 0, false, false},
                           {0.05, 0.9, 0, 1e-2, true, false}, {0.02, 0.8, 0.3, 1e-3, false, true},
                           {0.01, 0, 0, 0.1, false, true},    {0.03, 0.95, 0, 0, true, true}};
  for (const KernelSet* set : sets()) {
    for (const auto& c : cases) {
      SgdHyper h{c.lr, c.momentum, c.dampening, c.wd, c.nesterov, c.maximize};
      std::vector<float> p = randn(n, 1), buf(n);
      std::vector<double> rp(p.begin(), p.end()), rbuf(n);
      for (int s = 0; s < steps; ++s) {
        const std::vector<float> g = randn(n, 100 + s, 0.5f);
        sgd_step(p.data(), g.data(), buf.data(), n, h, s == 0, set);
        for (size_t i = 0; i < n; ++i) {
          double d = c.maximize ? -double(g[i]) : double(g[i]);
          d += c.wd * rp[i];
          if (c.momentum != 0) {
            rbuf[i] = s == 0 ? d : rbuf[i] * c.momentum + (1 - c.dampening) * d;
            d = c.nesterov ? d + c.momentum * rbuf[i] : rbuf[i];
          }
          rp[i] -= c.lr * d;
        }
      }
      expect_close(p, rp, c.lr * steps, set->isa);
      if (c.momentum != 0) expect_close(buf, rbuf, 1.0, set->isa);
    }
  }
}

struct AdamCase {
  double lr, b1, b2, eps, wd;
  bool decoupled, amsgrad, maximize;
};

TEST(Optim, AdamMatchesDoubleReference) {
  const size_t n = 1031;
  const int steps = 50;
  const AdamCase cases[] = {{1e-3, 0.9, 0.999, 1e-8, 0, false, false, false},
                            {1e-2, 0.9, 0.99, 1e-6, 1e-2, false, false, false},
                            {1e-3, 0.8, 0.999, 1e-8, 0.1, true, false, false},
                            {5e-3, 0.9, 0.999, 1e-8, 1e-2, true, true, true},
                            {1e-3, 0.3, 0.9, 1e-3, 0, false, true, false}};
  for (const KernelSet* set : sets()) {
    for (const auto& c : cases) {
      AdamHyper h{c.lr, c.b1, c.b2, c.eps, c.wd, c.decoupled, c.amsgrad, c.maximize};
      std::vector<float> p = randn(n, 2), m(n), v(n), vmax(n);
      std::vector<double> rp(p.begin(), p.end()), rm(n), rv(n), rvmax(n);
      for (int s = 1; s <= steps; ++s) {
        // Gradients well away from zero: where g and v are tiny, eps dominates and the relative
        // error of a float step is not meaningful.
        std::vector<float> g = randn(n, 200 + s, 0.1f);
        adam_step(p.data(), g.data(), m.data(), v.data(), vmax.data(), n, h, s, set);
        const double bc1 = 1 - std::pow(c.b1, s), bc2 = 1 - std::pow(c.b2, s);
        for (size_t i = 0; i < n; ++i) {
          double d = c.maximize ? -double(g[i]) : double(g[i]);
          if (c.wd != 0 && c.decoupled) rp[i] *= 1 - c.lr * c.wd;
          if (c.wd != 0 && !c.decoupled) d += c.wd * rp[i];
          rm[i] = c.b1 * rm[i] + (1 - c.b1) * d;
          rv[i] = c.b2 * rv[i] + (1 - c.b2) * d * d;
          rvmax[i] = std::max(rvmax[i], rv[i]);
          const double vv = c.amsgrad ? rvmax[i] : rv[i];
          rp[i] -= (c.lr / bc1) * rm[i] / (std::sqrt(vv) / std::sqrt(bc2) + c.eps);
        }
      }
      expect_close(p, rp, c.lr * steps, set->isa);
      expect_close(m, rm, 1e-2, set->isa);
      expect_close(v, rv, 1e-4, set->isa);
    }
  }
}

TEST(Optim, InstructionSetsAgree) {
  // The vector set differs from the baseline only by fused multiply-adds: within a few ulps.
  const KernelSet* fast = kernel_set(Isa::kAvx2);
  if (fast == nullptr) GTEST_SKIP() << "no AVX2 on this CPU";
  const size_t n = 4099;
  std::vector<float> g = randn(n, 7, 0.1f);
  std::vector<float> p1 = randn(n, 8), p2 = p1, m1(n), m2(n), v1(n), v2(n);
  AdamHyper h{1e-3, 0.9, 0.999, 1e-8, 1e-2, true, false, false};
  for (int s = 1; s <= 5; ++s) {
    adam_step(p1.data(), g.data(), m1.data(), v1.data(), nullptr, n, h, s, kernel_set(Isa::kGeneric));
    adam_step(p2.data(), g.data(), m2.data(), v2.data(), nullptr, n, h, s, fast);
  }
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(p1[i], p2[i], 1e-6 * std::max(1.0f, std::fabs(p1[i]))) << i;
}

TEST(Optim, SlicesOnThreadsGiveTheSameBits) {
  // Elementwise updates: splitting the buffer over threads must not change a single bit.
  const size_t n = (size_t{1} << 20) + 37;  // several slices, and a tail
  const std::vector<float> g = randn(n, 11, 0.1f), p0 = randn(n, 12);
  for (unsigned threads : {2u, 3u, 8u}) {
    std::vector<float> p1 = p0, p2 = p0, m1(n), m2(n), v1(n), v2(n), b1(n), b2(n);
    AdamHyper h{1e-3, 0.9, 0.999, 1e-8, 1e-2, true, true, false};
    std::vector<float> x1(n), x2(n);
    for (int s = 1; s <= 3; ++s) {
      adam_step(p1.data(), g.data(), m1.data(), v1.data(), x1.data(), n, h, s, nullptr, 1);
      adam_step(p2.data(), g.data(), m2.data(), v2.data(), x2.data(), n, h, s, nullptr, threads);
      sgd_step(p1.data(), g.data(), b1.data(), n, SgdHyper{0.1, 0.9, 0, 1e-4, true, false}, s == 1, nullptr,
               1);
      sgd_step(p2.data(), g.data(), b2.data(), n, SgdHyper{0.1, 0.9, 0, 1e-4, true, false}, s == 1, nullptr,
               threads);
    }
    ASSERT_EQ(p1, p2) << threads << " threads";
    ASSERT_EQ(m1, m2);
    ASSERT_EQ(v1, v2);
    ASSERT_EQ(x1, x2);
    ASSERT_EQ(b1, b2);
  }
}

TEST(Optim, RejectsBadArguments) {
  std::vector<float> p(4), g(4), m(4), v(4);
  SgdHyper nest{0.1, 0, 0, 0, true, false};
  EXPECT_THROW(sgd_step(p.data(), g.data(), m.data(), 4, nest, true), Error);
  SgdHyper nan_lr{std::nan(""), 0, 0, 0, false, false};
  EXPECT_THROW(sgd_step(p.data(), g.data(), nullptr, 4, nan_lr, true), Error);
  SgdHyper mom{0.1, 0.9, 0, 0, false, false};
  EXPECT_THROW(sgd_step(p.data(), g.data(), nullptr, 4, mom, true), Error);
  AdamHyper betas{1e-3, 1.0, 0.999, 1e-8, 0, false, false, false};
  EXPECT_THROW(adam_step(p.data(), g.data(), m.data(), v.data(), nullptr, 4, betas, 1), Error);
  AdamHyper ams{1e-3, 0.9, 0.999, 1e-8, 0, false, true, false};
  EXPECT_THROW(adam_step(p.data(), g.data(), m.data(), v.data(), nullptr, 4, ams, 1), Error);
  AdamHyper ok{1e-3, 0.9, 0.999, 1e-8, 0, false, false, false};
  EXPECT_THROW(adam_step(p.data(), g.data(), m.data(), v.data(), nullptr, 4, ok, 0), Error);
  EXPECT_NO_THROW(adam_step(p.data(), g.data(), m.data(), v.data(), nullptr, 4, ok, 1));
}

}  // namespace
}  // namespace rumor::optim
