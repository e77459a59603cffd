// Timeouts: parsing, saturation and naming (see timeout.hpp).
#include "timeout.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "distvals/group.hpp"

namespace distvals {

std::chrono::nanoseconds timeout_from_seconds(double seconds) noexcept {
  if (!(seconds > 0)) return std::chrono::nanoseconds{0};  // NaN, zero, negative
  // Compare in double before converting: anything at or beyond the largest duration
  // (about 292 years) is "forever", which is what such a timeout means in practice.
  const double ns = std::ceil(seconds * 1e9);
  if (!(ns < static_cast<double>(no_timeout.count()))) return no_timeout;
  return std::chrono::nanoseconds(static_cast<std::chrono::nanoseconds::rep>(ns < 1 ? 1 : ns));
}

namespace detail {

std::chrono::nanoseconds default_timeout() noexcept {
  if (const char* env = std::getenv("DISTVALS_TIMEOUT_SECONDS")) {
    char* end = nullptr;
    const double s = std::strtod(env, &end);
    // The whole value must be a number (surrounding blanks aside); "5s" or "" is not.
    while (end != nullptr && *end == ' ') ++end;
    if (end != env && end != nullptr && *end == '\0') {
      const auto t = timeout_from_seconds(s);
      if (t.count() > 0) return t;
    }
  }
  return std::chrono::seconds(300);
}

std::chrono::nanoseconds resolve_timeout(std::chrono::nanoseconds timeout) noexcept {
  return timeout.count() > 0 ? timeout : default_timeout();
}

clock_type::time_point deadline_after(std::chrono::nanoseconds timeout) noexcept {
  const auto now = clock_type::now();
  const auto room = clock_type::time_point::max() - now;  // a duration in the clock's unit
  if (timeout >= std::chrono::duration_cast<std::chrono::nanoseconds>(room)) return clock_type::time_point::max();
  return now + std::chrono::duration_cast<clock_type::duration>(timeout);
}

std::string timeout_text(std::chrono::nanoseconds timeout) {
  if (timeout == no_timeout) return "no timeout";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g s", static_cast<double>(timeout.count()) * 1e-9);
  return buf;
}

}  // namespace detail
}  // namespace distvals
