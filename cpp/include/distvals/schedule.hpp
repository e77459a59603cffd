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
///
/// Schedules are plain values: building, copying and reading one never touches a
/// group, so any thread may do it at any time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "distvals/dtype.hpp"
#include "distvals/export.hpp"

namespace distvals {

/// The collectives a group runs.
enum class collective : std::uint8_t {
  all_reduce,     ///< every replica gets op over all inputs
  reduce,         ///< the root gets op over all inputs
  broadcast,      ///< every replica gets the root's input
  all_gather,     ///< every replica gets all inputs, concatenated in replica order
  reduce_scatter  ///< replica r gets block r of op over all inputs
};

/// Lower-case name ("all_reduce", ...). Never throws; any thread.
DISTVALS_EXPORT const char* collective_name(collective c) noexcept;

/// A place in memory: element `offset` of replica `replica`'s input or output buffer.
struct slot_ref {
  std::int32_t replica = 0;  ///< whose buffer
  bool output = false;       ///< the output buffer (true) or the input buffer (false)
  std::size_t offset = 0;    ///< first element, counted in elements
};

/// A step waits until step `step` of replica `replica`'s program has completed.
struct step_dep {
  std::int32_t replica = 0;  ///< whose program
  std::int32_t step = 0;     ///< index into that program
};

/// One unit of work of a replica.
struct step {
  /// What the step does with its sources.
  enum class kind_t : std::uint8_t {
    copy,    ///< every dst = srcs[0]
    reduce,  ///< every dst = op(srcs[0], srcs[1], ...), element-wise
  };
  kind_t kind = kind_t::copy;     ///< copy or reduce
  std::size_t count = 0;          ///< elements written to each destination
  bool finalize = false;          ///< apply the op's epilogue (mean: divide by N) to the result
  std::vector<slot_ref> srcs;     ///< read, `count` elements each
  std::vector<slot_ref> dsts;     ///< written, `count` elements each
  std::vector<step_dep> deps;     ///< steps of other replicas that must complete first
};

/// Programs for all replicas of one collective call shape.
struct schedule {
  collective kind = collective::all_reduce;  ///< the collective it implements
  algorithm algo = algorithm::direct;        ///< the algorithm (never `automatic`)
  int replicas = 0;                          ///< N, the number of programs
  std::size_t count = 0;  ///< elements per replica input (all_gather: per replica; reduce_scatter: total)
  int root = 0;  ///< reduce and broadcast only
  std::vector<std::vector<step>> programs;  ///< programs[r] runs on replica r, in order
};

/// What shapes a schedule: the collective, algorithm, replica count, element count,
/// root and the pipelining chunk (elements; 0 for the default).
struct schedule_key {
  collective kind = collective::all_reduce;  ///< the collective
  algorithm algo = algorithm::direct;        ///< resolved algorithm (not `automatic`)
  int replicas = 1;                          ///< N
  std::size_t count = 0;                     ///< elements, as in schedule::count
  int root = 0;                              ///< reduce and broadcast only
  /// pipelining chunk in elements; 0: one chunk. Ring and tree raise a chunk that would
  /// cut a range into more than 16,384 chunks (step numbers stay small, and so does the
  /// schedule).
  std::size_t chunk = 0;
  std::size_t align = 16;  ///< slice boundaries are multiples of this many elements
  /// `direct` only: into how many slices the work is cut (programs 0 .. parts-1 get one
  /// each, the others none); 0 means one per replica. A backend that runs the replicas
  /// on fewer threads passes its thread count, so each thread gets one long slice.
  int parts = 0;
  /// All fields equal (schedules are cached by key). Never throws; any thread.
  bool operator==(const schedule_key& o) const noexcept {
    return kind == o.kind && algo == o.algo && replicas == o.replicas && count == o.count &&
           root == o.root && chunk == o.chunk && align == o.align && parts == o.parts;
  }
};

/// Builds the schedule for `key`. `algorithm::automatic` must have been resolved
/// already (see choose_algorithm). Throws invalid_argument_error for a bad key
/// (replicas < 1, root out of range, `automatic` for all_reduce) and std::bad_alloc.
/// Collectives other than all_reduce always get the `direct` schedule. Any thread.
DISTVALS_EXPORT schedule make_schedule(const schedule_key& key);

/// The all-reduce algorithm that `automatic` stands for, given the replica count and
/// bytes per replica. Never throws; any thread.
DISTVALS_EXPORT algorithm choose_algorithm(int replicas, std::size_t bytes) noexcept;

/// The `[begin, end)` element range of part `part` of `parts` nearly equal parts of
/// `count` elements, boundaries rounded to multiples of `align`. Never throws; any thread.
DISTVALS_EXPORT void split_range(std::size_t count, int parts, int part, std::size_t align,
                                 std::size_t* begin, std::size_t* end) noexcept;
}  // namespace distvals
