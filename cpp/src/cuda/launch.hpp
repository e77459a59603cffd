// The one kernel of the CUDA executor: what a launch is told, and how a collective
// splits into segments. Compiled by the host compiler (the executor, the host model)
// and by nvcc (the kernel), so both read a collective the same way. Not installed.
//
// A collective over N replicas is a few *segments*, each reading `nsrc` sources and
// writing `ndst` destinations, `len` elements each, at fixed offsets into the replicas'
// buffers:
//
//   all_reduce      1 segment:  in[0..N)           -> out[0..N)           count elements
//   reduce          1 segment:  in[0..N)           -> out[root]           count
//   broadcast       1 segment:  in[root]           -> out[0..N)           count
//   all_gather      N segments: in[s]              -> out[0..N) + s*count count
//   reduce_scatter  N segments: in[0..N) + s*m     -> out[s]              m = count / N
//
// A launch may cover part `part` of `parts` of every segment (one part per device when
// the replicas span several GPUs); a segment of one source and no mean is a copy.
#pragma once

#include <cstddef>
#include <cstdint>

#include "distvals/dtype.hpp"
#include "distvals/schedule.hpp"
#include "split.hpp"

#if defined(__CUDACC__)
#define DISTVALS_LAUNCH_HD __host__ __device__ __forceinline__
#else
#define DISTVALS_LAUNCH_HD inline
#endif

namespace distvals::cuda {

/// Most replicas of a GPU group: one launch's arguments hold every replica's pointers.
inline constexpr int max_launch_replicas = 64;

/// Everything one kernel launch needs, passed by value (about 1 KiB).
struct launch_args {
  const void* in[max_launch_replicas];  ///< replica r's input (as the kernel reads it)
  void* out[max_launch_replicas];       ///< replica r's output
  int n = 0;                            ///< replicas
  collective kind = collective::all_reduce;
  dtype type = dtype::float32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  std::size_t count = 0;  ///< elements of each input, as in call_desc
  int part = 0;           ///< this launch covers part `part` of `parts` of every segment
  int parts = 1;
  int multiprocessors = 1;  ///< of the device: the launcher sizes the grid to one full wave
};

/// dtype_size(), also in device code.
DISTVALS_LAUNCH_HD std::size_t element_size(dtype t) {
  switch (t) {
    case dtype::int8:
    case dtype::uint8: return 1;
    case dtype::float16:
    case dtype::bfloat16: return 2;
    case dtype::float32:
    case dtype::int32: return 4;
    default: return 8;
  }
}

/// Elements are split between parts at multiples of this many, so every part but the
/// last starts 16-byte aligned relative to the segment start for every dtype.
inline constexpr std::size_t part_align = 16;

using detail::part_range;

/// Number of segments of the collective.
DISTVALS_LAUNCH_HD int segments(const launch_args& a) {
  return a.kind == collective::all_gather || a.kind == collective::reduce_scatter ? a.n : 1;
}

/// Elements of every source and destination of a segment.
DISTVALS_LAUNCH_HD std::size_t segment_length(const launch_args& a) {
  return a.kind == collective::reduce_scatter ? a.count / static_cast<std::size_t>(a.n) : a.count;
}

/// Sources of segment `s`.
DISTVALS_LAUNCH_HD int segment_sources(const launch_args& a, int s) {
  (void)s;
  return a.kind == collective::broadcast || a.kind == collective::all_gather ? 1 : a.n;
}

/// Destinations of segment `s`.
DISTVALS_LAUNCH_HD int segment_destinations(const launch_args& a, int s) {
  (void)s;
  return a.kind == collective::reduce || a.kind == collective::reduce_scatter ? 1 : a.n;
}

/// Source `j` of segment `s`: the element where the segment starts.
DISTVALS_LAUNCH_HD const char* segment_source(const launch_args& a, int s, int j, std::size_t esize) {
  switch (a.kind) {
    case collective::broadcast: return static_cast<const char*>(a.in[a.root]);
    case collective::all_gather: return static_cast<const char*>(a.in[s]);
    case collective::reduce_scatter:
      return static_cast<const char*>(a.in[j]) + static_cast<std::size_t>(s) * segment_length(a) * esize;
    default: return static_cast<const char*>(a.in[j]);
  }
}

/// Destination `d` of segment `s`: the element where the segment starts.
DISTVALS_LAUNCH_HD char* segment_destination(const launch_args& a, int s, int d, std::size_t esize) {
  switch (a.kind) {
    case collective::reduce: return static_cast<char*>(a.out[a.root]);
    case collective::reduce_scatter: return static_cast<char*>(a.out[s]);
    case collective::all_gather: return static_cast<char*>(a.out[d]) + static_cast<std::size_t>(s) * a.count * esize;
    default: return static_cast<char*>(a.out[d]);
  }
}

/// True when the reduction ends with the mean's division (by the replica count).
DISTVALS_LAUNCH_HD bool takes_mean(const launch_args& a) {
  return a.op == reduce_op::mean &&
         (a.kind == collective::all_reduce || a.kind == collective::reduce || a.kind == collective::reduce_scatter);
}

/// True when a segment is a plain copy (one source, no mean): moved as bytes.
DISTVALS_LAUNCH_HD bool is_copy(const launch_args& a) { return segment_sources(a, 0) == 1 && !takes_mean(a); }

}  // namespace distvals::cuda
