// SPDX-License-Identifier: MIT
// The worked examples of Part 1 (§2–§5), computed by apex and printed beside the values the
// document prints. Where the two differ, the document is wrong and the line says so
// (SEED-NOTES.md). `scripts/run.sh demo` builds and runs this program.
#include <apex/apex.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

constexpr double kPi = 3.14159265358979323846;

void print_row(const char* label, const apex::RowMatrix<double>& m, const char* document) {
  std::printf("  %-26s apex:", label);
  for (apex::Index i = 0; i < m.rows(); ++i) {
    std::printf(" [");
    for (apex::Index j = 0; j < m.cols(); ++j) std::printf("%s%.5f", j ? ", " : "", m(i, j));
    std::printf("]");
  }
  std::printf("\n  %-26s doc:  %s\n", "", document);
}

void embedding_example() {
  std::printf("§2.4 Embedding, d = 4, tokens [1, 0, 2]\n");
  apex::RowMatrix<double> table(3, 4);
  table << 0.01, -0.03, 0.02, 0.01,  //
      -0.02, 0.04, -0.01, 0.03,      //
      0.03, 0.01, -0.04, 0.02;
  const apex::RowMatrix<double> x = apex::embed(table, std::vector<std::int64_t>{1, 0, 2});
  print_row("Embed(tokens) * sqrt(4)", x,
            "[-0.04, 0.08, -0.02, 0.06] [0.02, -0.06, 0.04, 0.02] [0.06, 0.02, -0.08, 0.04]");
  std::printf("§2.5 Weight tying, V = 151,643, d = 7,168\n  %-26s apex: %lld\n", "parameters saved",
              static_cast<long long>(apex::tied_parameters_saved(151643, 7168)));
  std::printf("  %-26s doc:  1.09B\n\n", "");
}

void rms_norm_example() {
  std::printf("§3.4 RMSNorm, x = [2, -1, 0.5, 1.5], gamma = 1, eps = 1e-6\n");
  apex::RowMatrix<double> x(1, 4);
  x << 2.0, -1.0, 0.5, 1.5;
  const apex::RowMatrix<double> y = apex::rms_norm(x, apex::Vector<double>::Ones(4));
  print_row("RMSNorm(x)", y, "[1.4606, -0.7303, 0.3651, 1.0954]");
  std::printf("  %-26s apex: %.6f   doc: ~1.0\n\n", "mean(out^2)", y.array().square().mean());
}

void rope_examples() {
  std::printf("§4.3 RoPE frequencies, d_h = 8, base 10000\n");
  const apex::Vector<double> theta = apex::rope_frequencies(8, 10000.0);
  std::printf("  %-26s apex:", "theta_i");
  for (apex::Index i = 0; i < theta.size(); ++i) std::printf(" %.5g", theta(i));
  std::printf("\n  %-26s apex:", "wavelength 2*pi/theta_i");
  for (apex::Index i = 0; i < theta.size(); ++i) std::printf(" %.4g", 2.0 * kPi / theta(i));
  std::printf(
      "\n  %-26s doc:  1.0000 0.0316 0.0010 0.00003 / 6.28 198.7 6283 198692"
      "\n  %-26s (the document's table does not follow its formula; apex follows the formula)\n\n",
      "", "");

  std::printf("§4.6 RoPE at position m = 3, d_h = 4, q = [1.0, 0.5, 0.3, -0.2]\n");
  const apex::RopeTable<double> table(4, 4);
  apex::RowMatrix<double> q(1, 4);
  q << 1.0, 0.5, 0.3, -0.2;
  const apex::RowMatrix<double> rotated = apex::rope(table, 3, q);
  print_row("q'", rotated, "[-1.061, -0.354, 0.306, -0.191]");
  std::printf("  %-26s apex: %.5f = %.5f   doc: 1.187 (the exact norm is 1.17473)\n\n",
              "||q|| = ||q'||", q.norm(), rotated.norm());
}

void yarn_example() {
  std::printf("§5.5-5.6 YaRN, 4K -> 128K: s = 32, L = 4096, d = 32, base 10000\n");
  apex::YarnParams params;
  params.scale = 32.0;
  params.original_context = 4096;
  const apex::Vector<double> plain = apex::rope_frequencies(32, params.base);
  const apex::Vector<double> scaled = apex::yarn_frequencies(32, params);
  const std::vector<apex::YarnRegime> regimes = apex::yarn_regimes(32, params);
  const char* names[] = {"high-frequency (kept)", "mid-frequency (blended)",
                         "low-frequency (divided by s)"};
  const char* document[] = {"HIGH-FREQ, theta' = 1.0", "MID-FREQ (t ~ 20.2 -> clamped)",
                            "LOW-FREQ, theta' = 0.0001 / 32 = 0.000003125"};
  const int pairs[] = {0, 8, 15};
  for (int k = 0; k < 3; ++k) {
    const auto i = static_cast<size_t>(pairs[k]);
    std::printf("  pair %-2d theta = %.6g -> theta' = %.6g, %s\n          doc: %s\n", pairs[k],
                plain(pairs[k]), scaled(pairs[k]), names[static_cast<int>(regimes[i])],
                document[k]);
  }
  std::printf("  %-26s apex: %.6f   doc: 1.347\n", "attention factor",
              apex::yarn_attention_factor(params));
  std::printf("  (the document's theta_15 = 0.0001 is rounded: 10000^(-30/32) = %.6g)\n",
              plain(15));
}

}  // namespace

int main() {
  std::printf("APEX-1 Part 1 worked examples, computed by apex %d.%d.%d\n\n", APEX_VERSION_MAJOR,
              APEX_VERSION_MINOR, APEX_VERSION_PATCH);
  embedding_example();
  rms_norm_example();
  rope_examples();
  yarn_example();
  return 0;
}
