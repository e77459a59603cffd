// Timeouts of the engine: the default (300 s or DISTVALS_TIMEOUT_SECONDS), conversions
// from seconds that keep sub-millisecond values and saturate instead of overflowing,
// deadlines that never wrap, and how a timeout is named in messages. Not installed.
#pragma once

#include <chrono>
#include <string>

namespace distvals::detail {

using clock_type = std::chrono::steady_clock;

/// The group default: DISTVALS_TIMEOUT_SECONDS when it holds a positive number (through
/// timeout_from_seconds, so "inf" means no timeout), otherwise 300 s. Never throws.
std::chrono::nanoseconds default_timeout() noexcept;

/// `timeout` when positive, else the default. Never throws.
std::chrono::nanoseconds resolve_timeout(std::chrono::nanoseconds timeout) noexcept;

/// now + timeout, saturating at the largest time point (no_timeout never expires).
/// Never throws.
clock_type::time_point deadline_after(std::chrono::nanoseconds timeout) noexcept;

/// "0.0004 s", "300 s" or "no timeout", for messages. Throws only std::bad_alloc.
std::string timeout_text(std::chrono::nanoseconds timeout);

}  // namespace distvals::detail
