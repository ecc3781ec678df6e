// The routing status word of a device (megatron_mok/routing_errors.py mirrors it): the
// schedule latches the first overflow and the first invalid expert id here, sticky until
// the host has raised them, so a bad routing is reported without a host sync in the pass.
#pragma once

namespace megatron_mok {
namespace routing_status {

enum Bits : int { kOverflow = 1, kInvalidIds = 2 };

// int32 entries of the status tensor.
enum Index : int {
  kBits = 0,            // Bits, OR-ed over every pass since the host last cleared it
  // the first overflow: this rank's row table could not hold its routes
  kOverflowRank = 1,    // EP rank whose table overflowed
  kRowsNeeded = 2,      // padded rows its routing needs
  kCapacity = 3,        // rows its table holds
  kBusiestExpert = 4,   // global id of the local expert with the most routes
  kBusiestRows = 5,     // that expert's routes
  kDroppedRoutes = 6,   // routes left out of the pass
  kEpSize = 7,
  kTokens = 8,          // T per rank
  kTopk = 9,
  kLocalExperts = 10,
  // the first invalid expert id (outside [-1, num_experts))
  kInvalidRank = 11,    // EP rank of the token
  kInvalidToken = 12,
  kInvalidK = 13,
  kInvalidValue = 14,
  kInvalidCount = 15,   // invalid routes in that pass
  kSize = 16,
};

}  // namespace routing_status
}  // namespace megatron_mok
