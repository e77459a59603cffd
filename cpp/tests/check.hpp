// A tiny test harness: CHECK records a failure and carries on, each test binary returns
// the number of failures, and ctest runs every binary. No outside dependency.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace distvals_test {

/// True when DISTVALS_TEST_QUICK is set to anything but "" or "0": tests then run a
/// reduced matrix (fewer replica counts, sizes and dtypes), for the sanitizer and
/// valgrind builds, which run many times slower.
inline bool quick() {
  const char* v = std::getenv("DISTVALS_TEST_QUICK");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

inline int& failures() {
  static int f = 0;
  return f;
}

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  if (failures() <= 50) std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
}

struct test_case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<test_case>& registry() {
  static std::vector<test_case> r;
  return r;
}

struct registrar {
  registrar(const char* name, std::function<void()> fn) { registry().push_back({name, std::move(fn)}); }
};

inline int run_all() {
  int ran = 0;
  for (auto& t : registry()) {
    const int before = failures();
    const auto start = std::chrono::steady_clock::now();
    try {
      t.fn();
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, std::string(t.name) + " threw " + e.what());
    }
    ++ran;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("[%s] %s (%.2f s)\n", failures() == before ? "ok" : "FAIL", t.name, secs);
    std::fflush(stdout);
  }
  std::printf("%d tests, %d failed checks\n", ran, failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace distvals_test

#define DV_CAT2(a, b) a##b
#define DV_CAT(a, b) DV_CAT2(a, b)
#define TEST_CASE(name)                                                            \
  static void DV_CAT(test_fn_, __LINE__)();                                        \
  static ::distvals_test::registrar DV_CAT(test_reg_, __LINE__)(name, &DV_CAT(test_fn_, __LINE__)); \
  static void DV_CAT(test_fn_, __LINE__)()
#define CHECK(cond)                                                                \
  do {                                                                             \
    if (!(cond)) ::distvals_test::fail(__FILE__, __LINE__, #cond);                 \
  } while (0)
#define CHECK_MSG(cond, msg)                                                       \
  do {                                                                             \
    if (!(cond)) ::distvals_test::fail(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)
#define CHECK_THROWS_AS(expr, type)                                                \
  do {                                                                             \
    bool dv_thrown = false;                                                        \
    try {                                                                          \
      expr;                                                                        \
    } catch (const type&) {                                                        \
      dv_thrown = true;                                                            \
    } catch (...) {                                                                \
    }                                                                              \
    if (!dv_thrown) ::distvals_test::fail(__FILE__, __LINE__, #expr " did not throw " #type); \
  } while (0)
#define TEST_MAIN()                                                                \
  int main() { return ::distvals_test::run_all(); }
