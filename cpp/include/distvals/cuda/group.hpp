/// @file
/// distvals::cuda::group: a group of GPU replicas, with the calls only GPUs have.
///
/// It is a distvals::group (same checks, per-replica meeting, timeouts and failure
/// handling) whose executor runs on CUDA like NCCL: replicas that share a device (logical
/// GPUs) are served by one kernel launch per collective that reads all N inputs and
/// writes all N outputs, on one stream (the caller's when given); replicas on several
/// devices by one launch per device, ordered by one start and one end event per device;
/// devices without peer access to each other through staged copies. Nothing allocates
/// device memory or waits on the host in the steady state of enqueued calls.
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/group.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <cstddef>
#include <vector>

#include "distvals/buffer.hpp"
#include "distvals/cuda/stream.hpp"
#include "distvals/device.hpp"
#include "distvals/export.hpp"
#include "distvals/group.hpp"

namespace distvals::cuda {

/// Most replicas one GPU group may have (one launch's arguments hold every pointer).
inline constexpr int max_replicas = 64;

/// The options of a GPU group are those of every group (group.hpp).
using group_options = distvals::group_options;

/// N replicas on CUDA devices. Buffers are device memory of the replica's GPU.
class DISTVALS_EXPORT group : public distvals::group {
 public:
  /// Replica r runs on CUDA device gpus[r]; a device may repeat (logical replicas). The
  /// replicas are named "GPU:0" .. "GPU:n-1". Throws invalid_argument_error for an empty
  /// list, too many replicas or a device that does not exist, and cuda_error when there
  /// is no usable GPU at all.
  explicit group(const std::vector<int>& gpus, group_options options = {});
  /// Replicas on logical devices "GPU:k": GPU:k runs on CUDA device k / logical_per_gpu.
  /// Throws as above, and for CPU devices or duplicates.
  group(const std::vector<device>& devices, int logical_per_gpu, group_options options = {});

  /// The CUDA device of each replica. Never throws.
  const std::vector<int>& gpus() const noexcept;
  /// True when kernels of replica `a` read and write replica `b`'s memory directly (the
  /// same device, or peer access). Never throws.
  bool direct_access(int a, int b) const noexcept;
  /// The group's stream on replica `r`'s device: work queued there by the caller comes
  /// before the next synchronous collective. Throws invalid_argument_error, closed_error.
  stream_view replica_stream(int r) const;

  using distvals::group::run;
  /// run() that also starts only after the work queued so far on every stream of
  /// `wait_for` (where the inputs were produced), without waiting on the host for it.
  void run(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
           const std::vector<stream_view>& wait_for);
  /// Enqueues `desc` after the work already on `caller` (and on every stream of
  /// `wait_for`) and makes `caller` wait for its completion; returns without waiting on
  /// the host. Buffers must stay alive until `caller` gets past the collective. Calls are
  /// ordered one after another whatever streams they use. Same validation and throws as
  /// run().
  void enqueue(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
               stream_view caller, const std::vector<stream_view>& wait_for = {});
  /// The per-replica run() whose collective also starts after the work queued so far on
  /// `wait_for` (this replica's inputs were produced there).
  void run(int replica, const call_desc& desc, buffer_view in, buffer_view out, const replica_options& options,
           stream_view wait_for);
};

/// The all-reduce algorithm `automatic` stands for on a GPU group: `direct`, a single
/// pass over the data in one launch per device (every algorithm runs that way on GPUs).
/// Never throws.
DISTVALS_EXPORT algorithm choose_gpu_algorithm(const group& g, std::size_t bytes) noexcept;

}  // namespace distvals::cuda

namespace distvals {
/// The CUDA group under its flat name.
using cuda_group = cuda::group;
}  // namespace distvals
