/// @file
/// Exceptions thrown by distvals and the DISTVALS_EXPECTS check macro.
///
/// Every exception derives from a standard one, so code that catches
/// std::invalid_argument or std::runtime_error keeps working. They are thrown in
/// the thread that made the failing call (in the per-replica style, every replica's
/// thread gets its own exception).
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "distvals/export.hpp"

namespace distvals {

/// Bad arguments from the caller (shape, count, root, device). Thrown before any data is touched.
class DISTVALS_EXPORT invalid_argument_error : public std::invalid_argument {
 public:
  /// Takes the message; std::invalid_argument's constructors.
  using std::invalid_argument::invalid_argument;
};

/// A dtype the operation cannot handle, or dtypes that differ where they must agree.
/// Thrown before any data is touched.
class DISTVALS_EXPORT dtype_error : public invalid_argument_error {
 public:
  /// Takes the message; invalid_argument_error's constructors.
  using invalid_argument_error::invalid_argument_error;
};

/// Replicas of one group called a collective with arguments that disagree
/// (kind, dtype, op, count, root or algorithm). Raised on every replica.
class DISTVALS_EXPORT mismatch_error : public invalid_argument_error {
 public:
  /// Takes the message; invalid_argument_error's constructors.
  using invalid_argument_error::invalid_argument_error;
};

/// A wait passed its deadline; the message names the replicas that did not arrive.
/// The group is aborted afterwards (see group::reset()).
class DISTVALS_EXPORT timeout_error : public std::runtime_error {
 public:
  /// Takes the message; std::runtime_error's constructors.
  using std::runtime_error::runtime_error;
};

/// The collective was aborted: another replica failed or the caller cancelled the group.
/// `replica()` is the replica that caused it, or -1 for a cancel from outside.
class DISTVALS_EXPORT aborted_error : public std::runtime_error {
 public:
  /// The message and the replica that caused the abort (-1: cancelled from outside).
  /// Throws only std::bad_alloc.
  aborted_error(const std::string& what, int replica) : std::runtime_error(what), replica_(replica) {}
  /// The replica whose failure aborted the group, or -1 when cancelled from outside.
  /// Never throws; any thread.
  int replica() const noexcept { return replica_; }

 private:
  int replica_;
};

/// A call started on a group that an earlier failure (a timeout, an abort) left aborted:
/// nothing runs until reset(). The message names the original failure; `replica()` is
/// the replica that caused it (-1: from outside) and `original()` its message.
class DISTVALS_EXPORT group_aborted_error : public aborted_error {
 public:
  /// The message, the replica that caused the original failure and that failure's message.
  /// Throws only std::bad_alloc.
  group_aborted_error(const std::string& what, int replica, std::string original)
      : aborted_error(what, replica), original_(std::move(original)) {}
  /// The message of the failure that aborted the group. Never throws; any thread.
  const std::string& original() const noexcept { return original_; }

 private:
  std::string original_;
};

/// The group was closed; no more collectives can run on it.
class DISTVALS_EXPORT closed_error : public std::runtime_error {
 public:
  /// Takes the message; std::runtime_error's constructors.
  using std::runtime_error::runtime_error;
};

/// A CUDA call failed; the message names the call, file, line and CUDA error.
class DISTVALS_EXPORT cuda_error : public std::runtime_error {
 public:
  /// Takes the message; std::runtime_error's constructors.
  using std::runtime_error::runtime_error;
};

namespace detail {
/// Throws invalid_argument_error("<message> (<condition> failed at <file>:<line>)");
/// the target of DISTVALS_EXPECTS, not meant to be called directly. Any thread.
[[noreturn]] DISTVALS_EXPORT void throw_expects(const char* condition, const char* file, int line,
                                                const std::string& message);
}  // namespace detail

}  // namespace distvals

/// Checks a precondition; on failure throws distvals::invalid_argument_error with
/// `message`, followed by the condition, the file and the line. Any thread.
#define DISTVALS_EXPECTS(cond, message)                                               \
  do {                                                                                \
    if (!(cond)) ::distvals::detail::throw_expects(#cond, __FILE__, __LINE__, (message)); \
  } while (0)
