#include "net/channel.h"

namespace rumor::net {

std::string OpInfo::where() const { return name + " (op #" + std::to_string(tag) + ", " + comm + ")"; }

size_t Transfer::bytes_done() const {
  size_t d = pieces_bytes;
  for (size_t i = 0; i < nparts; ++i) d += parts[i].done;
  return d;
}

bool Transfer::finished() const {
  if (!begun) return false;
  for (size_t i = 0; i < nparts; ++i)
    if (!parts[i].finished()) return false;
  return true;
}

Transfer make_send(uint32_t peer, const void* data, size_t len) {
  Transfer t;
  t.send = true;
  t.peer = peer;
  t.data = const_cast<std::byte*>(static_cast<const std::byte*>(data));
  t.len = len;
  return t;
}

Transfer make_recv(uint32_t peer, void* data, size_t len) {
  Transfer t;
  t.peer = peer;
  t.data = static_cast<std::byte*>(data);
  t.len = len;
  return t;
}

Transfer make_recv_reduce(uint32_t peer, void* data, size_t len, DType dtype, ReduceOp op) {
  Transfer t = make_recv(peer, data, len);
  t.reduce = true;
  t.dtype = dtype;
  t.op = op;
  return t;
}

FrameHeader make_header(const Part& p, const Transfer& t, const OpInfo& op) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.opcode = op.opcode;
  h.tag = op.tag;
  h.total_len = t.len;
  h.part_len = p.len;
  return h;
}

void check_header(const FrameHeader& h, const Part& p, const Transfer& t, const OpInfo& op,
                  const std::string& peer_desc) {
  auto fail = [&](const std::string& why) {
    throw Error(ErrorKind::kProtocol, op.where() + ": message from " + peer_desc + " " + why);
  };
  if (h.magic != kFrameMagic) {
    // A TLS record starts with its type (handshake 22, alert 21, data 23) and version 3.x.
    const auto* b = reinterpret_cast<const uint8_t*>(&h);
    if (b[0] >= 21 && b[0] <= 23 && b[1] == 3)
      fail(
          "is a TLS record: that rank has TLS on and this one off (RUMOR_TLS_* must be set on every rank or "
          "none)");
    fail("has a corrupt frame header");
  }
  if (h.tag != op.tag || h.opcode != op.opcode)
    fail("belongs to op #" + std::to_string(h.tag) + " (opcode " + std::to_string(h.opcode) +
         "), but this rank is at op #" + std::to_string(op.tag) + " (opcode " + std::to_string(op.opcode) +
         "): ranks called collectives in different orders");
  if (h.total_len != t.len || h.part_len != p.len)
    fail("carries " + std::to_string(h.total_len) + " bytes, but this rank expected " +
         std::to_string(t.len) + ": sizes differ across ranks");
}

}  // namespace rumor::net
