/// @file
/// Schedules: which replica moves or reduces which chunk at which step.
///
/// A schedule is plain host data, independent of where bytes live. Each replica
/// owns a *program*, a list of steps executed in order; a step may also wait for
/// steps of other replicas (its `deps`). A backend (CPU threads, CUDA streams)
/// executes programs; the tests check schedules by simulation, with no backend.
///
/// Every step names memory symbolically (replica r's input or output buffer, at
/// an element offset), so one schedule serves every call with the same shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "distvals/dtype.hpp"
#include "distvals/export.hpp"

namespace distvals {

/// The collectives a group runs.
enum class collective : std::uint8_t { all_reduce, reduce, broadcast, all_gather, reduce_scatter };

/// Lower-case name ("all_reduce", ...). Never throws.
DISTVALS_EXPORT const char* collective_name(collective c) noexcept;

/// A place in memory: element `offset` of replica `replica`'s input or output buffer.
struct slot_ref {
  std::int32_t replica = 0;
  bool output = false;
  std::size_t offset = 0;
};

/// A step waits until step `step` of replica `replica`'s program has completed.
struct step_dep {
  std::int32_t replica = 0;
  std::int32_t step = 0;
};

/// One unit of work of a replica.
struct step {
  enum class kind_t : std::uint8_t {
    copy,    ///< every dst = srcs[0]
    reduce,  ///< every dst = op(srcs[0], srcs[1], ...), element-wise
  };
  kind_t kind = kind_t::copy;
  std::size_t count = 0;          ///< elements written to each destination
  bool finalize = false;          ///< apply the op's epilogue (mean: divide by N) to the result
  std::vector<slot_ref> srcs;     ///< read, `count` elements each
  std::vector<slot_ref> dsts;     ///< written, `count` elements each
  std::vector<step_dep> deps;     ///< steps of other replicas that must complete first
};

/// Programs for all replicas of one collective call shape.
struct schedule {
  collective kind = collective::all_reduce;
  algorithm algo = algorithm::direct;
  int replicas = 0;
  std::size_t count = 0;  ///< elements per replica input (all_gather: per replica; reduce_scatter: total)
  int root = 0;
  std::vector<std::vector<step>> programs;  ///< programs[r] runs on replica r, in order
};

/// What shapes a schedule: the collective, algorithm, replica count, element count,
/// root and the pipelining chunk (elements; 0 for the default).
struct schedule_key {
  collective kind = collective::all_reduce;
  algorithm algo = algorithm::direct;
  int replicas = 1;
  std::size_t count = 0;
  int root = 0;
  std::size_t chunk = 0;
  std::size_t align = 16;  ///< slice boundaries are multiples of this many elements
  bool operator==(const schedule_key& o) const noexcept {
    return kind == o.kind && algo == o.algo && replicas == o.replicas && count == o.count &&
           root == o.root && chunk == o.chunk && align == o.align;
  }
};

/// Builds the schedule for `key`. `algorithm::automatic` must have been resolved
/// already (see choose_algorithm). Throws invalid_argument_error for a bad key.
DISTVALS_EXPORT schedule make_schedule(const schedule_key& key);

/// The all-reduce algorithm that `automatic` stands for, given the replica count and
/// bytes per replica. Never throws.
DISTVALS_EXPORT algorithm choose_algorithm(int replicas, std::size_t bytes) noexcept;

/// The `[begin, end)` element range of part `part` of `parts` nearly equal parts of
/// `count` elements, boundaries rounded to multiples of `align`. Never throws.
DISTVALS_EXPORT void split_range(std::size_t count, int parts, int part, std::size_t align,
                                 std::size_t* begin, std::size_t* end) noexcept;

namespace algorithms {
// One builder per algorithm file; make_schedule dispatches to them.
schedule ring_all_reduce(const schedule_key& key);
schedule tree_all_reduce(const schedule_key& key);
schedule direct_all_reduce(const schedule_key& key);
schedule direct_reduce(const schedule_key& key);
schedule direct_broadcast(const schedule_key& key);
schedule direct_all_gather(const schedule_key& key);
schedule direct_reduce_scatter(const schedule_key& key);
}  // namespace algorithms

}  // namespace distvals
