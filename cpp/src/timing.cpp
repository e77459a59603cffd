// Timing loops for the benchmarks (see timing.hpp).
#include "distvals/timing.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu/claim.hpp"
#include "cpu/relax.hpp"
#include "distvals/schedule.hpp"
#include "validate.hpp"

namespace distvals {
namespace cpu {
// The CPU kernels' streaming-store threshold (kernels.cpp).
std::size_t streaming_store_min_bytes() noexcept;
std::size_t set_streaming_store_min_bytes(std::size_t bytes) noexcept;
}  // namespace cpu

std::size_t streaming_store_min_bytes() noexcept { return cpu::streaming_store_min_bytes(); }

std::size_t set_streaming_store_min_bytes(std::size_t bytes) noexcept {
  return cpu::set_streaming_store_min_bytes(bytes);
}

std::vector<double> time_collective(group& g, const call_desc& desc, const std::vector<buffer_view>& in,
                                    const std::vector<buffer_view>& out, int iterations, int warmup) {
  using clk = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i) g.run(desc, in, out);
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const auto a = clk::now();
    g.run(desc, in, out);
    t.push_back(std::chrono::duration<double>(clk::now() - a).count());
  }
  return t;
}

std::vector<double> time_copy(int threads, std::size_t bytes, int iterations, int warmup) {
  using clk = std::chrono::steady_clock;
  // Checked as time_memory_bound checks them: with no thread the barrier below would
  // wait forever for one.
  if (threads < 1) throw std::invalid_argument("time_copy needs at least one thread");
  if (iterations < 1 || warmup < 0) throw std::invalid_argument("time_copy: iterations >= 1, warmup >= 0");
  std::vector<buffer> src, dst;
  for (int i = 0; i < threads; ++i) {
    src.emplace_back(bytes, dtype::uint8);
    dst.emplace_back(bytes, dtype::uint8);
    std::memset(src.back().data(), i + 1, bytes);
  }
  // A sense-reversing spin barrier: rounds start together and end when the slowest
  // thread is done, which is what a collective waits for too.
  std::atomic<int> arrived{0};
  std::atomic<int> phase{0};
  auto barrier = [&]() {
    const int p = phase.load();
    if (arrived.fetch_add(1) + 1 == threads) {
      arrived.store(0);
      phase.store(p + 1);
    } else {
      while (phase.load() == p) {
        cpu::relax();
        if (threads > static_cast<int>(std::thread::hardware_concurrency())) std::this_thread::yield();
      }
    }
  };
  const int rounds = warmup + iterations;
  std::vector<double> times(static_cast<std::size_t>(rounds));
  auto body = [&](int id) {
    for (int it = 0; it < rounds; ++it) {
      barrier();
      const auto a = clk::now();
      std::memcpy(dst[id].data(), src[id].data(), bytes);
      barrier();
      if (id == 0) times[it] = std::chrono::duration<double>(clk::now() - a).count();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(body, i);
  body(0);
  for (auto& th : pool) th.join();
  return std::vector<double>(times.begin() + warmup, times.end());
}

// ---- the memory bound: read every byte, store it back in place or into an output ---
namespace {

// Bytes the compiler must keep: a volatile round trip for the unaligned ends (dst may
// be src: the in-place bound).
void move_bytes(char* dst, const char* src, std::size_t n) noexcept {
  volatile char* d = dst;
  const volatile char* s = src;
  for (std::size_t i = 0; i < n; ++i) d[i] = s[i];
}

// Reads every byte of [src, src + n) and stores it to [dst, dst + n) (dst == src: back
// in place) with plain or non-temporal stores. The empty asm statements make each loaded
// vector opaque, so in place the stores cannot be dropped as storing what memory already
// holds. Four vectors per iteration; the body is aligned for dst's stores (loads are
// unaligned, which costs nothing when src == dst), unaligned head and tail go bytewise.
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) void move_avx2(char* dst, const char* src, std::size_t n, bool stream) noexcept {
  const std::size_t align = stream ? 64 : 32;
  std::size_t head = (align - reinterpret_cast<std::uintptr_t>(dst) % align) % align;
  if (head > n) head = n;
  move_bytes(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n / 128 * 128;
  for (std::size_t i = 0; i < body; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    asm volatile("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d));
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
    }
  }
  if (stream) _mm_sfence();
  move_bytes(dst + body, src + body, n - body);
}

void move_sse2(char* dst, const char* src, std::size_t n, bool stream) noexcept {
  const std::size_t align = stream ? 64 : 16;
  std::size_t head = (align - reinterpret_cast<std::uintptr_t>(dst) % align) % align;
  if (head > n) head = n;
  move_bytes(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n / 64 * 64;
  for (std::size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    asm volatile("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d));
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    } else {
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
  }
  if (stream) _mm_sfence();
  move_bytes(dst + body, src + body, n - body);
}
#endif

// Portable: 8-byte words (no streaming stores without an instruction set for them).
[[maybe_unused]] void move_words(char* dst, const char* src, std::size_t n, bool) noexcept {
  std::size_t head = (8 - reinterpret_cast<std::uintptr_t>(dst) % 8) % 8;
  if (head > n) head = n;
  move_bytes(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n / 32 * 32;
  for (std::size_t i = 0; i < body; i += 32) {
    std::uint64_t w[4];
    std::memcpy(w, src + i, 32);
    asm volatile("" : "+r"(w[0]), "+r"(w[1]), "+r"(w[2]), "+r"(w[3]));
    std::memcpy(dst + i, w, 32);
  }
  move_bytes(dst + body, src + body, n - body);
}

using move_fn = void (*)(char*, const char*, std::size_t, bool) noexcept;

move_fn pick_move() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return &move_avx2;
  return &move_sse2;
#else
  return &move_words;
#endif
}

bool has_streaming_stores() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  return true;
#else
  return false;
#endif
}

// One cache line per flag: the workers spin on theirs.
struct alignas(64) bound_slot {
  std::atomic<std::uint64_t> go{0};
  std::atomic<std::uint64_t> taken{0};
};

// Round numbers only grow over one measurement.
bool take(bound_slot& s, std::uint64_t seq) noexcept { return cpu::claim_share(s.taken, seq); }

}  // namespace

bool memory_bound_has_streaming() noexcept { return has_streaming_stores(); }

std::vector<double> time_memory_bound(const std::vector<buffer_view>& bufs, int threads, bool streaming,
                                      int iterations, int warmup, const std::vector<buffer_view>& outs) {
  using clk = std::chrono::steady_clock;
  if (bufs.empty()) throw std::invalid_argument("time_memory_bound needs at least one buffer");
  if (threads < 1) throw std::invalid_argument("time_memory_bound needs at least one thread");
  if (iterations < 1 || warmup < 0) throw std::invalid_argument("time_memory_bound: iterations >= 1, warmup >= 0");
  const move_fn move = pick_move();
  streaming = streaming && has_streaming_stores();
  const std::size_t count = bufs[0].count, esize = dtype_size(bufs[0].type);
  for (const auto& b : bufs) {
    if (b.count != count || b.type != bufs[0].type) {
      throw std::invalid_argument("time_memory_bound: every buffer needs the same count and dtype");
    }
    if (b.count != 0 && b.data == nullptr) throw std::invalid_argument("time_memory_bound: null buffer");
  }
  // Out of place: one output per buffer, of its count and dtype, overlapping no other
  // array (the collectives' own check), and not its buffer either, which that check
  // allows as in place (an output that shared bytes with its input would be the in-place
  // bound in part).
  if (!outs.empty()) {
    if (outs.size() != bufs.size()) {
      throw std::invalid_argument("time_memory_bound: " + std::to_string(outs.size()) + " outputs for " +
                                  std::to_string(bufs.size()) + " buffers");
    }
    for (std::size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].count != count || outs[i].type != bufs[0].type) {
        throw std::invalid_argument("time_memory_bound: output " + std::to_string(i) +
                                    " needs the buffers' count and dtype");
      }
      if (outs[i].count != 0 && outs[i].data == nullptr) throw std::invalid_argument("time_memory_bound: null output");
      if (count != 0 && outs[i].data == bufs[i].data) {
        throw std::invalid_argument("time_memory_bound: output " + std::to_string(i) +
                                    " is its buffer (in place: call without outputs)");
      }
    }
    call_desc d;
    d.type = bufs[0].type;
    d.count = count;
    detail::check_overlaps(d, bufs, outs);
  }
  // Part p: slice p of every buffer, cut like the direct algorithm's slices (16-element
  // boundaries), so each thread keeps the same bytes in its own caches from round to round.
  auto run_part = [&](int p) {
    std::size_t b = 0, e = 0;
    split_range(count, threads, p, 16, &b, &e);
    if (b == e) return;
    for (std::size_t i = 0; i < bufs.size(); ++i) {
      char* src = static_cast<char*>(bufs[i].data) + b * esize;
      char* dst = outs.empty() ? src : static_cast<char*>(outs[i].data) + b * esize;
      move(dst, src, (e - b) * esize, streaming);
    }
  };

  const int rounds = warmup + iterations;
  std::vector<double> times(static_cast<std::size_t>(rounds));
  if (threads == 1) {
    for (int it = 0; it < rounds; ++it) {
      const auto a = clk::now();
      run_part(0);
      times[it] = std::chrono::duration<double>(clk::now() - a).count();
    }
    return std::vector<double>(times.begin() + warmup, times.end());
  }

  // Workers 1 .. threads-1 wait for a round by spinning (rounds come back to back, as
  // the collective's calls do in its timing loop), and yield after a while.
  std::unique_ptr<bound_slot[]> slots(new bound_slot[static_cast<std::size_t>(threads)]);
  alignas(64) std::atomic<int> done{0};
  alignas(64) std::atomic<bool> stop{false};
  auto worker = [&](int w) {
    bound_slot& me = slots[w];
    std::uint64_t seen = 0;
    for (;;) {
      const auto spin_end = clk::now() + std::chrono::microseconds(80);
      for (unsigned i = 1; me.go.load(std::memory_order_acquire) == seen && !stop.load(); ++i) {
        cpu::relax();
        if ((i & 63u) == 0 && clk::now() > spin_end) std::this_thread::yield();
      }
      if (stop.load()) return;
      seen = me.go.load(std::memory_order_acquire);
      if (!take(me, seen)) continue;  // the caller did this part itself
      run_part(w);
      done.fetch_add(1);
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int w = 1; w < threads; ++w) pool.emplace_back(worker, w);
  } catch (...) {
    stop.store(true);
    for (auto& th : pool) th.join();
    throw;
  }
  // A round, as group::run does it: hand parts 1.. to the workers, run part 0, take over
  // every part no worker has started, wait for the workers that did start.
  for (int it = 0; it < rounds; ++it) {
    const std::uint64_t seq = static_cast<std::uint64_t>(it) + 1;
    done.store(0);
    const auto a = clk::now();
    for (int w = 1; w < threads; ++w) slots[w].go.store(seq, std::memory_order_release);
    run_part(0);
    int started = threads - 1;
    for (int w = 1; w < threads; ++w) {
      if (take(slots[w], seq)) {
        --started;
        run_part(w);
      }
    }
    for (unsigned i = 1; done.load() != started; ++i) {
      cpu::relax();
      if ((i & 1023u) == 0) std::this_thread::yield();
    }
    times[it] = std::chrono::duration<double>(clk::now() - a).count();
  }
  stop.store(true);
  for (auto& th : pool) th.join();
  return std::vector<double>(times.begin() + warmup, times.end());
}

}  // namespace distvals
