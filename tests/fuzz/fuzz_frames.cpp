// sources: csrc/netplugin/wire.cpp
// The NCCL net plugin's handling of peer bytes (netplugin/wire.h): handshake messages and chunk
// headers as a hostile peer could send them. A stream of 40-byte chunk headers is run through the
// receiver's checks (check_chunk, then admit_chunk on the message the header names, as RecvComm
// does) with a model of the messages in flight; hellos are checked against a listener id.
// Invariants: an admitted chunk lies inside its message, a message never takes more bytes than its
// size, and completes exactly once.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "netplugin/wire.h"

namespace wire = rumor::netplugin::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  ++data;
  --size;
  if (mode & 1) {
    // Handshake messages: a hello for a fixed listener, and the MACs over it.
    if (size < sizeof(wire::Hello) + sizeof(wire::Challenge)) return 0;
    wire::Hello h;
    std::memcpy(&h, data, sizeof(h));
    wire::Challenge c;
    std::memcpy(&c, data + sizeof(h), sizeof(c));
    wire::Id id{};
    id.fill(0x5a);
    std::string bad = wire::check_hello(h, id);
    if (bad.empty() && (h.stream >= h.nstreams || h.nstreams == 0 || h.nstreams > wire::kMaxStreams ||
                        std::memcmp(h.listen_id.data(), id.data(), id.size()) != 0))
      std::abort();
    static const wire::Key key = wire::derive_key("fuzzing-secret-0123456789");
    wire::Mac a = wire::hello_mac(key, 'A', h, c.nonce);
    wire::Mac b = wire::hello_mac(key, 'C', h, c.nonce);
    if (wire::mac_equal(a, b)) std::abort();  // roles are bound: one side's MAC never passes as the other's
    if (wire::mac_equal(c.mac, a) && std::memcmp(c.mac.data(), a.data(), a.size()) != 0) std::abort();
    return 0;
  }
  // Chunk headers. Messages are matched in order: the first chunk of message `next` creates its
  // book (the receiver matched a buffer to it); chunks of completed messages are refused.
  std::map<uint64_t, wire::MessageBook> inflight;
  uint64_t next = 0;
  while (size >= sizeof(wire::ChunkHeader)) {
    wire::ChunkHeader h;
    std::memcpy(&h, data, sizeof(h));
    data += sizeof(h);
    size -= sizeof(h);
    h.seq %= 4;                                   // keep sequence numbers close, so messages get completed
    if (!wire::check_chunk(h).empty()) return 0;  // the comm fails: done
    if (h.offset + h.len > h.total || h.total > wire::kMaxMessageBytes) std::abort();
    if (h.seq == next && inflight.find(h.seq) == inflight.end()) {
      inflight[h.seq] = wire::MessageBook{h.total, h.tag, 0, 0};
      ++next;
    }
    auto it = inflight.find(h.seq);
    if (it == inflight.end()) return 0;  // not in flight: the comm fails
    uint64_t before = it->second.reserved;
    if (!wire::admit_chunk(it->second, h).empty()) return 0;
    if (it->second.reserved != before + h.len || it->second.reserved > it->second.total) std::abort();
    it->second.received += h.len;  // the payload arrived
    if (it->second.received > it->second.total) std::abort();
    if (it->second.received == it->second.total) inflight.erase(it);
  }
  return 0;
}
