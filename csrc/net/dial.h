// The dialing side of the handshake (net/handshake.h) on a blocking socket, bounded by the
// caller's deadline.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/types.h"
#include "net/handshake.h"
#include "net/socket.h"

namespace rumor::net {

struct DialRequest {
  uint32_t rank = 0;  // this process's world rank
  uint64_t comm_id = 0;
  uint32_t stream = 0;
  std::optional<uint32_t> peer_rank;  // whom the address should reach; nullopt: anyone (probes)
};

enum class DialOutcome { kAccepted, kBusy };

// Runs the handshake on a connected socket. kBusy: the listener dropped this connection for its
// pending cap, dial again. Throws Error naming `what`, the failed step and the likely cause
// otherwise.
DialOutcome client_handshake(int fd, const Key& key, const DialRequest& req, const Deadline& deadline,
                             const std::string& what);

// connect_tcp() and client_handshake(), dialing again while the listener is busy.
Fd dial(const HostPort& to, const Key& key, const DialRequest& req, const Deadline& deadline,
        const std::string& what);

}  // namespace rumor::net
