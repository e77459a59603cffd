// The schedule builders, one per algorithm file; make_schedule() dispatches to them.
// Private to the library (not exported): call make_schedule(). Not installed.
#pragma once

#include "distvals/schedule.hpp"

namespace distvals::algorithms {
/// Ring all-reduce: chunked reduce-scatter then all-gather around the ring. Any thread.
schedule ring_all_reduce(const schedule_key& key);
/// Double binary tree all-reduce: pipelined reduce up, broadcast down. Any thread.
schedule tree_all_reduce(const schedule_key& key);
/// Direct all-reduce: replica r reduces slice r from all inputs into all outputs. Any thread.
schedule direct_all_reduce(const schedule_key& key);
/// Direct reduce: the replicas reduce slices of the inputs into the root's output. Any thread.
schedule direct_reduce(const schedule_key& key);
/// Direct broadcast: each replica copies the root's input into its own output. Any thread.
schedule direct_broadcast(const schedule_key& key);
/// Direct all-gather: each replica copies every input, in order, into its own output. Any thread.
schedule direct_all_gather(const schedule_key& key);
/// Direct reduce-scatter: replica r reduces block r of all inputs into its output. Any thread.
schedule direct_reduce_scatter(const schedule_key& key);
}  // namespace distvals::algorithms
