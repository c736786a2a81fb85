// SPDX-License-Identifier: MIT
// The worked examples of Part 2 (§6–§11), computed by apex and printed beside the values the
// document prints. Where the two differ, the document is wrong and the line says so
// (SEED-NOTES.md). Each value is also checked against the correct figure: a line that differs is
// marked MISMATCH and the program exits with 1, so that ctest catches it. `scripts/run.sh demo`
// builds and runs this program after 01_part1_worked_examples.
#include <apex/apex.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <string>
#include <vector>

namespace {

constexpr std::int64_t kMiB = std::int64_t{1} << 20;
constexpr std::int64_t kGiB = std::int64_t{1} << 30;

// The mismatches of a run: check() counts a failed comparison and returns the mark that ends
// its line.
struct Report {
  int checks = 0;
  int mismatches = 0;
  const char* check(bool ok) {
    ++checks;
    if (!ok) ++mismatches;
    return ok ? "" : "   <-- MISMATCH";
  }
};

// Whether every entry of m is within tol of the expected values, row by row.
bool near(const apex::RowMatrix<double>& m, const std::vector<double>& expected, double tol) {
  if (static_cast<std::size_t>(m.size()) != expected.size()) return false;
  for (apex::Index i = 0; i < m.rows(); ++i) {
    for (apex::Index j = 0; j < m.cols(); ++j) {
      if (std::abs(m(i, j) - expected[static_cast<std::size_t>(i * m.cols() + j)]) > tol) {
        return false;
      }
    }
  }
  return true;
}

void print_rows(const char* label, const apex::RowMatrix<double>& m, const char* mark,
                const char* document) {
  std::printf("  %-26s apex:", label);
  for (apex::Index i = 0; i < m.rows(); ++i) {
    std::printf(" [");
    for (apex::Index j = 0; j < m.cols(); ++j) std::printf("%s%.5f", j ? ", " : "", m(i, j));
    std::printf("]");
  }
  std::printf("%s\n  %-26s doc:  %s\n", mark, "", document);
}

// Text followed by blanks up to `width` characters (UTF-8: "§" is one character, two bytes).
std::string padded(const std::string& text, std::size_t width) {
  std::size_t characters = 0;
  for (const char c : text) characters += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return text + std::string(characters < width ? width - characters : 0, ' ');
}

std::string mebibytes(std::int64_t bytes) {
  char text[32];
  if (bytes >= kGiB && bytes % kGiB == 0) {
    std::snprintf(text, sizeof text, "%lld GiB", static_cast<long long>(bytes / kGiB));
  } else {
    std::snprintf(text, sizeof text, "%lld MiB", static_cast<long long>(bytes / kMiB));
  }
  return text;
}

void sdpa_example(Report& report) {
  std::printf("§6.4 SDPA, Q [2 x 2], K and V [3 x 2], d_h = 2, no mask\n");
  apex::RowMatrix<double> q(2, 2), k(3, 2), v(3, 2);
  q << 1, 0,  //
      0, 1;
  k << 1, 0,  //
      0, 1,   //
      1, 1;
  v << 1, 2,  //
      3, 4,   //
      5, 6;
  // With V = I the attention output is the matrix of softmax weights itself.
  const apex::RowMatrix<double> weights = apex::sdpa(q, k, apex::RowMatrix<double>::Identity(3, 3));
  print_rows("softmax(QK^T / sqrt 2)", weights,
             report.check(near(weights, {0.401, 0.198, 0.401, 0.198, 0.401, 0.401}, 5e-4)),
             "[0.401, 0.198, 0.401] [0.198, 0.401, 0.401]");
  const apex::RowMatrix<double> out = apex::sdpa(q, k, v);
  print_rows("output", out, report.check(near(out, {3.0, 4.0, 3.40667, 4.40667}, 5e-6)),
             "[3.000, 4.000] [3.406, 4.406] (row 1 truncated: 3.40667, 4.40667)");
  std::printf("\n");
}

void mha_sizes(Report& report) {
  std::printf("§7.3 MHA parameters, 4·d·H_q·d_h (= 4d² when H_q·d_h = d), no biases\n");
  const std::int64_t square = apex::mha_parameter_count(4096, 32, 128);
  std::printf("  %-26s apex: %lld = 4d²%s\n", "d = 4096, 32 heads of 128",
              static_cast<long long>(square), report.check(square == 4LL * 4096 * 4096));
  const std::int64_t large = apex::mha_parameter_count(7168, 128, 128);
  std::printf("  %-26s apex: %lld (H_q·d_h = 16384 is not d: 4d² = %lld)%s\n",
              "d = 7168, 128 heads of 128", static_cast<long long>(large), 4LL * 7168 * 7168,
              report.check(large == 469762048));
  std::printf("  %-26s doc:  the formula only\n\n", "");

  std::printf("§7.4 KV cache per layer, 2·B·S·H·d_h·bytes: 128K tokens, 128 heads of 128, FP16\n");
  const std::int64_t bytes = apex::kv_cache_bytes(1, 131072, 128, 128, 2);
  std::printf("  %-26s apex: %lld bytes = %s%s\n", "K and V", static_cast<long long>(bytes),
              mebibytes(bytes).c_str(), report.check(bytes == 8 * kGiB));
  std::printf("  %-26s doc:  4 GB (wrong: that is K alone; K and V take 8 GiB)\n\n", "");
}

void gqa_examples(Report& report) {
  std::printf("§8.3 KV cache relative to MHA, H_q = 128\n");
  const double gqa = apex::kv_cache_ratio(apex::HeadCounts{128, 8});
  const double mqa = apex::kv_cache_ratio(apex::HeadCounts{128, 1});
  std::printf("  %-26s apex: %.4f (%.0fx smaller)%s\n", "GQA, H_kv = 8", gqa, 1.0 / gqa,
              report.check(gqa == 0.0625));
  std::printf("  %-26s doc:  0.0625x (16x smaller)\n", "");
  std::printf("  %-26s apex: %.7f%s\n", "MQA, H_kv = 1", mqa, report.check(mqa == 0.0078125));
  std::printf("  %-26s doc:  0.0078x (rounded: 1/128 = 0.0078125)\n\n", "");

  std::printf("§8.4 GQA head assignment, H_q = 4, H_kv = 2, G = 2\n");
  std::printf("  %-26s apex:", "KV head of Q0 Q1 Q2 Q3");
  const apex::Index expected[] = {0, 0, 1, 1};
  bool ok = true;
  for (apex::Index i = 0; i < 4; ++i) {
    const apex::Index kv = apex::kv_head_for(apex::HeadCounts{4, 2}, i);
    ok = ok && kv == expected[i];
    std::printf(" %lld", static_cast<long long>(kv));
  }
  std::printf("%s\n  %-26s doc:  Q0, Q1 -> K0, V0 (group 0); Q2, Q3 -> K1, V1 (group 1)\n\n",
              report.check(ok), "");
}

// APEX-1 Large as §9.4 gives it (d_kv = 512, H_q = 128, d_h = 128), with H_kv = 8 (§8.3) and
// d = 7168 (Part 1, §2.5). The documents give no d_q and no d_r: d_q = 1536 and d_r = 64 are
// DeepSeek-V3's values, assumed here; d_q does not enter the cache size.
apex::MlaConfig apex1_large_mla(apex::Index rope_key_heads) {
  apex::MlaConfig c;
  c.d_model = 7168;
  c.d_q = 1536;
  c.d_kv = 512;
  c.num_q_heads = 128;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.rope_dim = 64;
  c.num_rope_key_heads = rope_key_heads;
  return c;
}

void mla_cache(Report& report) {
  std::printf("§9.4 MLA cache relative to MHA, APEX-1 Large: d_kv = 512, H_q = 128, d_h = 128\n");
  const double document = apex::mla_cache_ratio_document(apex1_large_mla(0));
  std::printf("  %-26s apex: %.4f%% (a %.4f%% reduction)%s\n", "c_kv only (the document)",
              100.0 * document, 100.0 * (1.0 - document), report.check(document == 0.015625));
  std::printf("  %-26s doc:  1.6%% (98.4%% reduction): 512 / 32768, rounded\n", "");
  const double per_head = apex::mla_cache_ratio(apex1_large_mla(0));
  const double shared = apex::mla_cache_ratio(apex1_large_mla(1));
  std::printf("  %-26s apex: %.4f%% with H_kr = H_kv = 8, %.4f%% with one shared head%s\n",
              "c_kv + K_rope (d_r = 64)", 100.0 * per_head, 100.0 * shared,
              report.check(per_head == 0.03125 && shared == 0.017578125));
  std::printf("  %-26s doc:  not counted; K_rope comes from x, not c_kv, so it is cached too\n\n",
              "");
}

void cache_table(Report& report) {
  std::printf(
      "§7.4, §8.3, §9.4, §10.3 cache per layer, APEX-1 Large, 128K tokens, W = 4096, FP16\n");
  apex::CacheComparisonParams p;
  p.num_q_heads = 128;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.latent_dim = 512;
  p.rope_dim = 64;  // assumed, as above
  p.rope_heads = 8;
  p.window = 4096;
  p.context = 131072;
  const std::vector<apex::CacheComparisonRow> rows = apex::cache_comparison(p);
  const std::int64_t expected[] = {8 * kGiB,  512 * kMiB, 64 * kMiB,
                                   16 * kMiB, 128 * kMiB, 256 * kMiB};
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const bool ok = r < std::size(expected) && rows[r].bytes_per_layer == expected[r];
    std::printf(
        "  %s %s %6lld values/token %8s %9.5f%%%s\n", padded(rows[r].method, 20).c_str(),
        padded(rows[r].cached, 27).c_str(), static_cast<long long>(rows[r].values_per_token),
        mebibytes(rows[r].bytes_per_layer).c_str(), 100.0 * rows[r].relative, report.check(ok));
  }
  const char* count_mark = report.check(rows.size() == std::size(expected));
  if (*count_mark != '\0') {
    std::printf("  %zu rows, not %zu%s\n", rows.size(), std::size(expected), count_mark);
  }
  std::printf("  (§10.3: the window keeps 4096 of the 131072 tokens, 32x less than GQA)\n\n");
}

// §11.3 as the document draws it, without its "← ..." notes.
constexpr const char* kGlobalPicture =
    "Position:  0  1  2  3  4  5  6  7  8  9\n"
    "    0:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
    "    1:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
    "    2:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
    "    3:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
    "    4:     █  █  █  █  █  ·  ·  ·  ·  ·\n"
    "    5:     █  █  █  █  █  █  ·  ·  ·  ·\n"
    "    9:     █  █  █  █  █  █  █  █  █  █\n";
constexpr const char* kLocalPicture =
    "Position:  0  1  2  3  4  5  6  7  8  9\n"
    "    0:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
    "    3:     █  █  █  █  ·  ·  ·  ·  ·  ·\n"
    "    4:     ·  █  █  █  █  ·  ·  ·  ·  ·\n"
    "    7:     ·  ·  ·  ·  █  █  █  █  ·  ·\n"
    "    9:     ·  ·  ·  ·  ·  ·  █  █  █  █\n";

// Prints a picture indented by two blanks.
void print_indented(const std::string& text) {
  std::size_t begin = 0;
  while (begin < text.size()) {
    const std::size_t end = text.find('\n', begin);
    std::printf("  %s\n", text.substr(begin, end - begin).c_str());
    begin = end == std::string::npos ? text.size() : end + 1;
  }
}

void mask_picture(Report& report, const char* title, apex::Index layer,
                  const std::vector<apex::Index>& rows, const char* document) {
  const apex::LayerMaskParams params{/*prefix=*/4, /*window=*/4, /*global_every=*/6};
  const std::string picture = apex::render_mask(apex::build_mask(layer, 10, params), rows);
  std::printf("§11.3 %s, layer %lld, S = 10, P = 4, W = 4\n", title, static_cast<long long>(layer));
  print_indented(picture);
  const bool ok = picture == document;
  std::printf("  %s%s\n",
              ok ? "identical to the document's picture" : "the document's picture differs:",
              report.check(ok));
  if (!ok) print_indented(document);
}

void mask_examples(Report& report) {
  std::printf("§11.2 layer types, F_g = 6\n  %-26s apex: ", "layers 0-11");
  std::string types;
  for (apex::Index layer = 0; layer < 12; ++layer) {
    types += apex::is_global_layer(layer) ? 'G' : 'L';
  }
  std::printf("%s%s\n  %-26s doc:  LLLLLGLLLLLG\n\n", types.c_str(),
              report.check(types == "LLLLLGLLLLLG"), "");
  mask_picture(report, "global layer (full causal after the prefix)", 5, {0, 1, 2, 3, 4, 5, 9},
               kGlobalPicture);
  std::printf("\n");
  mask_picture(report, "local layer (window W after the prefix, §10.2)", 0, {0, 3, 4, 7, 9},
               kLocalPicture);
  std::printf(
      "  (row 4: position 4 is past the prefix, so it no longer sees position 0: 4 - 0 = W)\n");
}

int run() {
  std::printf("APEX-1 Part 2 worked examples, computed by apex %d.%d.%d\n\n", APEX_VERSION_MAJOR,
              APEX_VERSION_MINOR, APEX_VERSION_PATCH);
  Report report;
  sdpa_example(report);
  mha_sizes(report);
  gqa_examples(report);
  mla_cache(report);
  cache_table(report);
  mask_examples(report);
  if (report.mismatches != 0) {
    std::printf("\n%d of %d checks differ from the correct values\n", report.mismatches,
                report.checks);
    return 1;
  }
  std::printf("\nall %d checks match the correct values\n", report.checks);
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
