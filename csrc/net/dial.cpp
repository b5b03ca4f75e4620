#include "net/dial.h"

#include <chrono>
#include <thread>

namespace rumor::net {

namespace {
// Reads exactly `len` bytes; false if the peer closed the connection first.
bool read_reply(int fd, uint8_t* p, size_t len, const Deadline& deadline, const std::string& what) {
  try {
    read_all(fd, p, len, deadline, what);
    return true;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kPeerGone) return false;
    throw;
  }
}
}  // namespace

DialOutcome client_handshake(int fd, const Key& key, const DialRequest& req, const Deadline& deadline,
                             const std::string& what) {
  Hello h;
  h.rank = req.rank;
  h.comm_id = req.comm_id;
  h.stream = req.stream;
  h.nonce = random_nonce();
  const auto hello = encode_hello(h);
  write_all(fd, hello.data(), hello.size(), deadline, what + ": sending the handshake");

  std::array<uint8_t, kChallengeBytes> reply{};
  if (!read_reply(fd, reply.data(), kReplyBytes, deadline, what + ": waiting for the peer's challenge"))
    throw Error(ErrorKind::kProtocol,
                what +
                    ": the peer closed the connection after our hello: it refused it (a rumor of another "
                    "protocol version than " +
                    std::to_string(kProtocolVersion) +
                    ", a world of another size, or not this job's listener); see the peer's log");
  size_t got = kReplyBytes;
  if (std::memcmp(reply.data(), kBusy, kReplyBytes) != 0) {
    if (!read_reply(fd, reply.data() + got, kChallengeBytes - got, deadline,
                    what + ": waiting for the peer's challenge"))
      throw Error(ErrorKind::kProtocol,
                  what + ": the peer closed the connection in the middle of its challenge");
    got = kChallengeBytes;
  }
  Nonce server_nonce{};
  uint32_t server_rank = 0;
  std::string why;
  switch (check_challenge(key, h, {reply.data(), got}, req.peer_rank, &server_nonce, &server_rank, &why)) {
    case ChallengeResult::kBusy:
      return DialOutcome::kBusy;
    case ChallengeResult::kRefused:
      throw Error(ErrorKind::kProtocol, what + ": " + why);
    case ChallengeResult::kOk:
      break;
  }
  const auto proof = encode_proof(handshake_proof(key, false, h, server_nonce, server_rank));
  write_all(fd, proof.data(), proof.size(), deadline, what + ": sending our proof");
  std::array<uint8_t, kReplyBytes> ack{};
  if (!read_reply(fd, ack.data(), ack.size(), deadline, what + ": waiting for the peer to accept our proof"))
    // The peer proved the same key, so it did not refuse our proof for the key.
    throw Error(ErrorKind::kProtocol,
                what + ": the peer refused the stream after both sides proved the key: comm " +
                    std::to_string(req.comm_id) + " rank " + std::to_string(req.rank) + " stream " +
                    std::to_string(req.stream) + " is already connected there (another process claims rank " +
                    std::to_string(req.rank) +
                    "?), or the handshake took longer than the peer allows; see the peer's log");
  if (std::memcmp(ack.data(), kBusy, kReplyBytes) == 0) return DialOutcome::kBusy;
  if (std::memcmp(ack.data(), kAccept, kReplyBytes) != 0)
    throw Error(ErrorKind::kProtocol, what + ": unexpected handshake reply after our proof");
  return DialOutcome::kAccepted;
}

Fd dial(const HostPort& to, const Key& key, const DialRequest& req, const Deadline& deadline,
        const std::string& what) {
  auto pause = std::chrono::milliseconds(5);
  while (true) {
    Fd fd = connect_tcp(to, deadline, what);
    if (client_handshake(fd.get(), key, req, deadline, what) == DialOutcome::kAccepted) return fd;
    if (deadline.expired())
      throw Error(ErrorKind::kTimeout, what +
                                           ": the listener stayed busy (too many unauthenticated "
                                           "connections: a flood?) until the deadline");
    // Backs off so that many dialers do not all return into the same full listener at once.
    std::this_thread::sleep_for(
        std::min(pause, std::chrono::duration_cast<std::chrono::milliseconds>(deadline.at() - Clock::now())));
    pause = std::min(pause * 2, std::chrono::milliseconds(200));
  }
}

}  // namespace rumor::net
