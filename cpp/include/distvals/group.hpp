/// @file
/// A group of N local replicas and the collectives they run together, on host memory
/// (CPU replicas) or CUDA device memory (GPU replicas).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "distvals/buffer.hpp"
#include "distvals/device.hpp"
#include "distvals/dtype.hpp"
#include "distvals/export.hpp"
#include "distvals/schedule.hpp"

namespace distvals {

/// A timeout that never expires: waits end only when the awaited replicas arrive, or on
/// abort(), cancel(), close() or the interrupt hook. Longer timeouts are clamped to it.
inline constexpr std::chrono::nanoseconds no_timeout = std::chrono::nanoseconds::max();

/// `seconds` as a timeout: positive finite values rounded up to whole nanoseconds (so
/// nothing positive becomes 0, which means "the default"), infinity and values too large
/// for a duration become no_timeout. Returns 0 for NaN, zero and negative values (the
/// caller decides whether that is an error). Never throws; any thread.
DISTVALS_EXPORT std::chrono::nanoseconds timeout_from_seconds(double seconds) noexcept;

/// Most replicas one group may have (a GPU group: 64).
inline constexpr int max_group_size = 1 << 16;

/// Settings of a group. Every field has a usable default. A plain aggregate, read once
/// by the group's constructor; any thread may build one.
struct group_options {
  /// Longest time any wait inside a collective may take before timeout_error, kept to
  /// the nanosecond. 0: 300 s, or DISTVALS_TIMEOUT_SECONDS when it holds a positive
  /// number ("inf" or anything too large for a duration: no_timeout); no_timeout: none.
  std::chrono::nanoseconds timeout{0};
  /// CPU: worker threads that run the single-call style (caller included).
  /// 0: min(replicas, hardware threads).
  int threads = 0;
  /// CPU: pipelining chunk of ring and tree, in bytes; 0: the default (256 KiB). A chunk
  /// that would cut a buffer into more than 16,384 chunks is raised to fit.
  std::size_t chunk_bytes = 0;
  /// CPU: how long a wait spins before it yields and then blocks, in microseconds, at
  /// most 10,000 (larger values are taken as 10,000). Negative: the default (20 µs, none
  /// when replicas outnumber hardware threads).
  int spin_us = -1;
  /// GPU: logical GPUs per CUDA device; replica "GPU:k" runs on CUDA device
  /// k / logical_per_gpu (several replicas may share one GPU).
  int logical_per_gpu = 1;
  /// GPU: enable peer access between distinct GPUs where the hardware allows it.
  bool peer_access = true;
  /// Optional hook that blocked waits call about every 50 ms (from whichever thread is
  /// waiting); returning true cancels the group, as cancel() does. Bindings use it to
  /// honour keyboard interrupts. Must not throw.
  std::function<bool()> interrupted;
};

/// One collective call: what every replica must agree on. A plain aggregate; any thread.
struct call_desc {
  /// Which collective.
  collective kind = collective::all_reduce;
  /// Element type of every input and output.
  dtype type = dtype::float32;
  /// Reduction operator (all_reduce, reduce, reduce_scatter; ignored otherwise).
  reduce_op op = reduce_op::sum;
  /// All-reduce algorithm (other collectives always run `direct`).
  algorithm algo = algorithm::automatic;
  std::size_t count = 0;  ///< elements of each replica's input
  int root = 0;           ///< reduce and broadcast only
  /// All fields equal. Never throws; any thread.
  bool operator==(const call_desc& o) const noexcept {
    return kind == o.kind && type == o.type && op == o.op && algo == o.algo && count == o.count &&
           root == o.root;
  }
  /// Some field differs. Never throws; any thread.
  bool operator!=(const call_desc& o) const noexcept { return !(*this == o); }
};

/// Per-call settings of a per-replica call. A plain aggregate; any thread.
struct replica_options {
  /// Longest wait of this call; 0: the group's timeout; no_timeout: none.
  std::chrono::nanoseconds timeout{0};
  /// The logical shape of this replica's input, outermost dimension first; every
  /// replica of a call must pass the same shape (mismatch_error names the first
  /// difference). Read during the call only; may be null when `ndim` is 0 or less (with
  /// `ndim` above 0 a null `shape` is an invalid_argument_error).
  const std::int64_t* shape = nullptr;
  /// Number of dimensions in `shape`: 0 is a scalar, which differs from a vector of one
  /// element; negative (the default) gives no shape, and the input counts as a flat
  /// vector of `count` elements. The count alone, not a null pointer, says "no shape",
  /// so that an empty shape (whose storage may well be null) is never read as a vector.
  int ndim = -1;
};

namespace detail {
/// A replica index of any integer type as the int the group uses (-1 when it does not
/// fit, which the group refuses as out of range). Never throws.
template <class I>
constexpr int replica_index(I r) noexcept {
  static_assert(std::is_integral_v<I>, "a replica index is an integer");
  if constexpr (std::is_signed_v<I>) {
    return r < 0 || static_cast<std::make_unsigned_t<I>>(r) > static_cast<unsigned>(std::numeric_limits<int>::max())
               ? -1
               : static_cast<int>(r);
  } else {
    return r > static_cast<unsigned>(std::numeric_limits<int>::max()) ? -1 : static_cast<int>(r);
  }
}
template <class I>
using if_index = std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int>;
}  // namespace detail

/// N replicas in one process that run collectives together.
///
/// The replicas live on CPUs ("CPU:k", host memory, run by the group's worker threads)
/// or on GPUs ("GPU:k", CUDA device memory, run by kernels; see distvals/cuda/group.hpp
/// for the GPU-only calls). Both kinds share everything but how the work runs: the
/// checks, the meeting of per-replica callers, timeouts and failure handling.
///
/// Two call styles:
///  - single call: one thread passes all N buffers; the group runs the whole collective.
///    Calls from several threads are serialized.
///  - per replica: N threads, one per replica, each pass their own buffers; they meet,
///    check that they agree, and the collective runs (on CPUs each replica executes its
///    own part; on GPUs replica 0 launches the whole collective for all).
/// A group runs one collective at a time. The styles may be used from different threads
/// at once: a single call waits until no per-replica call is in flight (per-replica calls
/// that start a new collective wait for it meanwhile), and per-replica calls wait while a
/// single call runs, each within its timeout.
///
/// Every wait honours the timeout. A failure in one replica (timeout, abort) releases
/// the others, which throw too; the group then stays aborted until reset(), and calls
/// that start meanwhile throw group_aborted_error naming the failure.
///
/// Constructing and destroying a group are not synchronized with anything else: no
/// other thread may use the group while it is built or destroyed.
class DISTVALS_EXPORT group {
 public:
  /// A group of `replicas` CPU replicas ("CPU:0" .. "CPU:n-1"), with its worker
  /// threads started. Throws invalid_argument_error when replicas < 1 or above
  /// max_group_size, and std::system_error when a worker thread cannot be started.
  explicit group(int replicas, group_options options = {});
  /// A group over the given devices: all CPUs, or all GPUs ("GPU:k" runs on CUDA device
  /// k / options.logical_per_gpu). Throws invalid_argument_error for duplicates, an
  /// empty list, a mix of CPUs and GPUs, GPUs in a build without the CUDA backend or
  /// more than 64 of them; cuda_error when no GPU is usable; std::system_error when a
  /// worker thread cannot be started.
  explicit group(const std::vector<device>& devices, group_options options = {});
  /// Closes the group (see close()) and joins its workers. No thread may still be
  /// using the group, nor call into it afterwards.
  virtual ~group();
  /// Not copyable: a group owns threads and shared state.
  group(const group&) = delete;
  /// Not copyable: a group owns threads and shared state.
  group& operator=(const group&) = delete;

  /// Number of replicas. Never throws; any thread.
  int size() const noexcept;
  /// The replicas' devices, replica r on devices()[r]. Never throws; any thread.
  const std::vector<device>& devices() const noexcept;
  /// The options in force (defaults resolved). Never throws; any thread.
  const group_options& options() const noexcept;
  /// CPU: how long idle worker threads keep spinning for the next collective after one
  /// ends, in microseconds, on top of options().spin_us (clamped to 0 .. 100000); returns
  /// the previous value. A caller about to run several collectives back to back (the
  /// leaves of one structure) raises it for them and puts it back afterwards: no call of
  /// the batch then waits for a sleeping thread to wake up, and between batches the
  /// workers sleep. Lowering it ends a spin in progress. No effect on GPU groups. Never
  /// throws; any thread.
  int set_linger_us(int us) noexcept;
  /// CPU: opens (`open` true) or closes a batch of collectives that one caller issues
  /// back to back (the leaves of one structure); returns the number of batches open
  /// afterwards. While any batch is open, idle workers keep spinning at least
  /// batch_linger_us between calls, so no call of a batch waits for a sleeping thread.
  /// Batches from several threads may overlap: the workers sleep again once the last
  /// one closes (closing more than were opened leaves the count at 0). Unlike raising
  /// and restoring set_linger_us, overlapping batches cannot leave the workers
  /// spinning. No effect on GPU groups. Never throws; any thread.
  int batch(bool open) noexcept;
  /// How long idle workers linger while a batch is open, in microseconds: far more than
  /// the gap between two calls of a batch, far less than anything worth a core.
  static constexpr int batch_linger_us = 200;

  // ----- single-call style: any one thread, all N buffers -------------------------

  /// Runs `desc` over all replicas: `in[r]` and `out[r]` are replica r's buffers,
  /// in place when in[r] and out[r] are the same memory; returns when every output is
  /// complete. Validates everything before touching data (throws invalid_argument_error,
  /// dtype_error); throws timeout_error, aborted_error, group_aborted_error,
  /// closed_error or cuda_error while running. Any thread; calls from several threads
  /// run one after another.
  void run(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out);

  /// All-reduce: every out[r] = op over all in[j]. Same throws and threads as run();
  /// the dtype and count are taken from in[0] (invalid_argument_error when `in` is empty).
  void all_reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, reduce_op op,
                  algorithm algo = algorithm::automatic);
  /// Reduce to `root`: out[root] = op over all in[j]; other outputs are not touched.
  /// Same throws and threads as run(); invalid_argument_error for a root out of range.
  void reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root, reduce_op op);
  /// Broadcast: every out[r] = in[root]; other inputs are not read.
  /// Same throws and threads as run(); invalid_argument_error for a root out of range.
  void broadcast(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root);
  /// All-gather: out[r] (N·count elements) = in[0] ++ in[1] ++ ... ++ in[N-1].
  /// Same throws and threads as run().
  void all_gather(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out);
  /// Reduce-scatter: out[r] (count/N elements) = op over all in[j] of block r.
  /// Same throws and threads as run(); invalid_argument_error when count is not a
  /// multiple of N.
  void reduce_scatter(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, reduce_op op);

  // ----- per-replica style: the thread of replica `replica` -----------------------

  /// Replica `replica`'s part of `desc`; blocks until the collective is complete for
  /// this replica. All replicas must call with equal `desc` (and shapes, see
  /// replica_options) or every one of them throws mismatch_error naming the first
  /// difference. Call from one thread per replica, all N concurrently; never two threads
  /// for the same replica. Throws invalid_argument_error or dtype_error (on every
  /// replica, when any replica's buffers are bad or overlap another replica's, before any
  /// data is touched), mismatch_error, timeout_error, aborted_error, group_aborted_error,
  /// closed_error or cuda_error.
  void run(int replica, const call_desc& desc, buffer_view in, buffer_view out, const replica_options& options);
  /// run() with only a timeout (0: the group's).
  void run(int replica, const call_desc& desc, buffer_view in, buffer_view out,
           std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0});

  /// Replica `replica`'s part of an all-reduce: out = op over every replica's in.
  /// The same as run() with the call_desc built from `in` (each thing stated once).
  /// `replica` may be any integer type.
  template <class I, detail::if_index<I> = 0>
  void all_reduce(I replica, buffer_view in, buffer_view out, reduce_op op, algorithm algo = algorithm::automatic) {
    run(detail::replica_index(replica), call_desc{collective::all_reduce, in.type, op, algo, in.count, 0}, in, out);
  }
  /// Replica `replica`'s part of a reduce to `root` (only the root's `out` is written).
  template <class I, detail::if_index<I> = 0>
  void reduce(I replica, buffer_view in, buffer_view out, int root, reduce_op op) {
    run(detail::replica_index(replica), call_desc{collective::reduce, in.type, op, algorithm::direct, in.count, root},
        in, out);
  }
  /// Replica `replica`'s part of a broadcast from `root` (only the root's `in` is read).
  template <class I, detail::if_index<I> = 0>
  void broadcast(I replica, buffer_view in, buffer_view out, int root) {
    run(detail::replica_index(replica),
        call_desc{collective::broadcast, out.type, reduce_op::sum, algorithm::direct, out.count, root}, in, out);
  }
  /// Replica `replica`'s part of an all-gather (`out` holds N · in.count elements).
  template <class I, detail::if_index<I> = 0>
  void all_gather(I replica, buffer_view in, buffer_view out) {
    run(detail::replica_index(replica),
        call_desc{collective::all_gather, in.type, reduce_op::sum, algorithm::direct, in.count, 0}, in, out);
  }
  /// Replica `replica`'s part of a reduce-scatter (`out` holds in.count / N elements).
  template <class I, detail::if_index<I> = 0>
  void reduce_scatter(I replica, buffer_view in, buffer_view out, reduce_op op) {
    run(detail::replica_index(replica),
        call_desc{collective::reduce_scatter, in.type, op, algorithm::direct, in.count, 0}, in, out);
  }

  /// Replica `replica`'s part of the next per-replica collective when its arguments were
  /// found invalid before a call_desc could be built (a language binding's own checks):
  /// it arrives like run() and, once all replicas have arrived, every replica of that
  /// call throws `why` (dtype_error when `type_error`, invalid_argument_error otherwise;
  /// the others' messages add which replica reported it). No data is touched and the
  /// group stays usable. The other replicas call run() as usual. Same waits, timeout and
  /// failure exceptions as run().
  void report_invalid(int replica, const std::string& why, bool type_error,
                      std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0});

  // ----- failure handling: any thread --------------------------------------------

  /// Aborts the collective in flight and every later one until reset(): every waiting
  /// replica throws aborted_error naming `replica` and `why`. Never throws; any thread,
  /// including a replica's own thread after its call failed.
  void abort(int replica, const std::string& why) noexcept;
  /// abort() from outside the replicas (replica -1), e.g. on a keyboard interrupt.
  /// Never throws; any thread.
  void cancel() noexcept;
  /// True once aborted (or timed out) and not yet reset. Never throws; any thread.
  bool aborted() const noexcept;
  /// Clears an abort so the group can run again. Call only when no collective is in
  /// flight, from any thread; throws std::logic_error otherwise, closed_error when the
  /// group is closed.
  void reset();
  /// Stops the workers and frees resources; later calls throw closed_error and
  /// waiters are released with closed_error. Idempotent; never throws. Any thread that
  /// is not itself inside a collective of this group; returns once every waiter has left.
  void close() noexcept;
  /// True once closed. Never throws; any thread.
  bool closed() const noexcept;

  /// Opaque implementation (meeting, failure state, executor); not part of the API.
  struct impl;

 protected:
  /// For the library's own factories and subclasses: a group over a prepared `impl`.
  explicit group(std::unique_ptr<impl> state) noexcept;
  /// The implementation, for subclasses. Never throws.
  impl& state() const noexcept { return *impl_; }

 private:
  std::unique_ptr<impl> impl_;
};

/// Checks `desc` against the buffers of one replica: counts, dtypes, root and op (not
/// where the memory lives, which the backend checks); throws invalid_argument_error or
/// dtype_error naming the replica and what is wrong. Used by both call styles.
/// Touches no data; any thread.
DISTVALS_EXPORT void validate_replica_buffers(const call_desc& desc, int replicas, int replica,
                                              const buffer_view& in, const buffer_view& out);

}  // namespace distvals
