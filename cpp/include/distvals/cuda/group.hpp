/// @file
/// distvals::cuda::group: N replicas on CUDA devices that run collectives together.
///
/// The same schedules as the CPU backend (ring, tree, direct; see schedule.hpp) run
/// here as kernels, one stream per replica. A step that depends on another replica's
/// step waits for an event recorded after that step (cudaStreamWaitEvent), so a whole
/// collective is enqueued from one host thread without any host round trip.
///
/// Several replicas may share one physical GPU (logical GPUs): each keeps its own
/// stream and its own buffers. Between distinct GPUs, kernels reach peer memory
/// directly where cudaDeviceCanAccessPeer allows it; otherwise the data is staged
/// with cudaMemcpyPeerAsync through a scratch buffer of the reading replica.
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/group.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distvals/buffer.hpp"
#include "distvals/cuda/stream.hpp"
#include "distvals/device.hpp"
#include "distvals/export.hpp"
#include "distvals/group.hpp"

namespace distvals::cuda {

/// Most replicas one CUDA group may have (one kernel argument block holds every pointer).
inline constexpr int max_replicas = 64;

/// Settings of a CUDA group. Every field has a usable default.
struct group_options {
  /// Longest host wait of a synchronous call before timeout_error.
  /// 0: 300 s, or the environment variable DISTVALS_TIMEOUT_SECONDS.
  std::chrono::milliseconds timeout{0};
  /// Pipelining chunk of ring and tree, in bytes; 0: the default (16 MiB).
  std::size_t chunk_bytes = 0;
  /// Enable peer access between distinct GPUs where the hardware allows it.
  bool peer_access = true;
  /// Optional hook that host waits call about every 50 ms; returning true cancels the
  /// group, as cancel() does. Must not throw.
  std::function<bool()> interrupted;
};

/// N replicas on CUDA devices. One collective runs at a time (calls from several
/// threads are serialized); buffers are device memory of the replica's GPU.
class DISTVALS_EXPORT group {
 public:
  /// Replica r runs on CUDA device gpus[r]; a device may repeat (logical replicas).
  /// The replicas are named "GPU:0" .. "GPU:n-1". Throws invalid_argument_error for an
  /// empty list, too many replicas or a device that does not exist, and cuda_error
  /// when there is no usable GPU at all.
  explicit group(const std::vector<int>& gpus, group_options options = {});
  /// Replicas on logical devices "GPU:k": GPU:k runs on CUDA device
  /// k / logical_per_gpu. Throws as above, and for CPU devices or duplicates.
  group(const std::vector<device>& devices, int logical_per_gpu, group_options options = {});
  /// Closes the group (see close()).
  ~group();
  group(const group&) = delete;
  group& operator=(const group&) = delete;

  /// Number of replicas.
  int size() const noexcept;
  /// The replicas' logical devices ("GPU:k").
  const std::vector<device>& devices() const noexcept;
  /// The CUDA device of each replica.
  const std::vector<int>& gpus() const noexcept;
  /// The options in force (defaults resolved).
  const group_options& options() const noexcept;
  /// True when kernels of replica `a` read and write replica `b`'s memory directly.
  bool direct_access(int a, int b) const noexcept;
  /// The stream replica `r` runs its steps on.
  stream_view replica_stream(int r) const;

  /// Runs `desc` and returns when every output is complete. The call is ordered after
  /// all work issued earlier on the legacy default stream of every device of the group
  /// (and the blocking streams there). Validates everything before touching data
  /// (invalid_argument_error, dtype_error); throws timeout_error, aborted_error,
  /// closed_error or cuda_error.
  void run(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out);

  /// Enqueues `desc` after the work already on `caller` and makes `caller` wait for its
  /// completion; returns without waiting on the host. Buffers must stay alive until
  /// `caller` gets past the collective. Same validation and throws as run().
  void enqueue(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
               stream_view caller);

  /// All-reduce: every out[r] = op over all in[j]. In place when out[r] is in[r].
  void all_reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, reduce_op op,
                  algorithm algo = algorithm::automatic);
  /// Reduce to `root`: out[root] = op over all in[j]; other outputs are not touched.
  void reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root, reduce_op op);
  /// Broadcast: every out[r] = in[root].
  void broadcast(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root);
  /// All-gather: out[r] (N·count elements) = in[0] ++ ... ++ in[N-1].
  void all_gather(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out);
  /// Reduce-scatter: out[r] (count/N elements) = op over all in[j] of block r.
  void reduce_scatter(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, reduce_op op);

  /// Releases a host wait in progress and fails every later call with aborted_error
  /// naming `replica` and `why`, until reset(). Work already on the streams still runs.
  void abort(int replica, const std::string& why) noexcept;
  /// abort() from outside the replicas (replica -1).
  void cancel() noexcept;
  /// True once aborted (or timed out) and not yet reset.
  bool aborted() const noexcept;
  /// Clears an abort; only when no call is in flight (std::logic_error otherwise).
  void reset();
  /// Waits for calls in flight to leave, then frees streams, events and scratch
  /// memory; later calls throw closed_error. Idempotent; never throws.
  void close() noexcept;
  /// True once closed.
  bool closed() const noexcept;

  /// Opaque implementation.
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

/// The all-reduce algorithm `automatic` stands for on a CUDA group: `direct` when every
/// replica reaches every other one's memory (one GPU, or peer access everywhere),
/// `ring` otherwise (each step then stages only one neighbour's data). Never throws.
DISTVALS_EXPORT algorithm choose_gpu_algorithm(const group& g, std::size_t bytes) noexcept;

}  // namespace distvals::cuda

namespace distvals {
/// The CUDA group under its flat name.
using cuda_group = cuda::group;
}  // namespace distvals
