// A Channel moves framed messages to and from one peer of a communicator. Two kinds exist:
// TCP (several striped streams) and shared memory (a ring per direction). Both are driven the
// same way: comm/exchange.cpp calls progress() on non-blocking transfers until they finish,
// and waits on the channel's file descriptors or on the process doorbell in between.
#pragma once

#include <poll.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/types.h"

namespace rumor::net {

constexpr uint32_t kFrameMagic = 0x524d5246;  // "FRMR"
constexpr size_t kMaxStreams = 16;
// A set of a channel's streams, bit i for stream i; all bits: the whole channel.
using StreamSet = uint32_t;
inline constexpr StreamSet kAllStreams = ~StreamSet{0};
static_assert(kMaxStreams <= 32);

// Precedes every message part on the wire. The receiver checks it against what it posted, so
// ranks that run different collectives, or the same one with different sizes, fail loudly.
struct FrameHeader {
  uint32_t magic;
  uint8_t opcode;
  // TCP, a message striped over several streams: each stream carries pieces (kFramePiece, the
  // piece's index below) taken by whichever stream is free, then an end marker (kFrameEnd).
  uint8_t flags;
  uint16_t piece;
  uint64_t tag;
  uint64_t total_len;
  uint64_t part_len;
};
static_assert(sizeof(FrameHeader) == 32);
inline constexpr uint8_t kFramePiece = 1, kFrameEnd = 2;

// What the running collective is; used for frame checks and error messages.
struct OpInfo {
  std::string name;  // e.g. "allreduce"
  std::string comm;  // e.g. "world" or "group 3"
  uint8_t opcode = 0;
  uint64_t tag = 0;  // op sequence number within the communicator
  // From the op's start: the whole op with the adaptive rule off, and the waits that have no
  // progress to measure (shared-memory setup, the host's direct paths) either way.
  Deadline deadline{Clock::now()};
  double timeout_s = 0;  // RUMOR_TIMEOUT when the op began
  // > 0: the adaptive rule (net/stall.h) with this floor; 0: deadline bounds the whole op.
  double stall_floor_s = 0;
  // For the timeline and flight recorder only: payload bytes, the one peer of a point-to-point
  // operation (world rank), the algorithm (a static string).
  int64_t bytes = -1;
  int32_t peer = -1;
  const char* algo = nullptr;
  std::string where() const;  // "allreduce (op #12, world)"
};

struct Part {
  uint32_t stream = 0;
  size_t offset = 0;  // into Transfer::data
  size_t len = 0;
  size_t hdr_done = 0;
  size_t done = 0;
  size_t pad_left = 0;  // shm only: alignment bytes after the payload
  FrameHeader hdr{};
  // TCP, striped: the stream goes on after this piece, with another piece or its end marker.
  bool more = false;
  bool piece_done() const { return hdr_done == sizeof(FrameHeader) && done == len && pad_left == 0; }
  bool finished() const { return !more && piece_done(); }
};

struct Transfer {
  bool send = false;
  uint32_t peer = 0;  // rank within the communicator
  std::byte* data = nullptr;
  size_t len = 0;
  // Receive only: reduce incoming elements into data instead of overwriting it.
  bool reduce = false;
  DType dtype = DType::U8;
  ReduceOp op = ReduceOp::SUM;
  // Send only: its data is still being produced (Communicator::exchange with a work function);
  // it and every later transfer to the same peer wait until the producer clears this.
  bool held = false;

  // Owned by the channel once begun.
  bool begun = false;
  // TCP: when the first and the latest byte (header included) of this transfer moved; zero
  // before any did. What the progress deadline and the link's rate estimate are measured from.
  Clock::time_point first_moved{};
  Clock::time_point last_moved{};
  size_t nparts = 0;
  std::array<Part, kMaxStreams> parts{};
  // TCP, striped: the next piece to hand out (send), the bytes of the pieces already finished,
  // the streams whose end marker arrived and which pieces have (recv).
  size_t next_piece = 0;
  size_t pieces_bytes = 0;
  // Send, striped: streams from this one on carry no piece, only their end marker (the channel's
  // stripe width when the transfer began).
  size_t width = 0;
  size_t streams_ended = 0;
  std::vector<bool> got;
  size_t bytes_done() const;
  bool finished() const;
};

Transfer make_send(uint32_t peer, const void* data, size_t len);
Transfer make_recv(uint32_t peer, void* data, size_t len);
Transfer make_recv_reduce(uint32_t peer, void* data, size_t len, DType dtype, ReduceOp op);

class Channel {
 public:
  virtual ~Channel() = default;
  virtual bool is_shm() const = 0;
  // Splits the transfer into parts; called once, in the order transfers reach this channel.
  virtual void begin(Transfer& t, const OpInfo& op) = 0;
  // Moves what it can without blocking; true if any byte moved. Throws Error on failure.
  virtual bool progress(Transfer& t, const OpInfo& op) = 0;
  // progress() on the streams outside `busy`, those an earlier transfer to the same peer in the
  // same direction still needs. Where a channel cannot tell its streams apart, nothing moves
  // until `busy` is empty.
  virtual bool progress_beside(Transfer& t, const OpInfo& op, StreamSet busy) {
    return busy == 0 ? progress(t, op) : false;
  }
  // begin() beside earlier transfers that still hold the streams in `busy`: a striped send
  // leaves a busy stream's first piece to be taken once the stream is free, so that a free
  // stream is not left waiting for a piece reserved on one still busy. It declines (t stays
  // unbegun, to wait for the earlier ones) unless t uses every stream, so transfers to one peer
  // in one direction still finish in order: callers count on that.
  virtual void begin_beside(Transfer& t, const OpInfo& op, StreamSet busy) {
    if (busy == 0) begin(t, op);
  }
  // `busy` and the streams an unfinished t still needs; kAllStreams once that is all of them,
  // or where the next transfer must wait for the whole of t.
  virtual StreamSet streams_in_use(const Transfer& t, StreamSet busy) const {
    return t.finished() ? busy : kAllStreams;
  }
  // TCP: the descriptors and events that would let t progress.
  virtual void want(const Transfer& t, std::vector<pollfd>& fds) const = 0;
  // Shared memory: throws if the peer process is gone.
  virtual void check_alive(const OpInfo& op) = 0;
  // TCP: throws kTimeout if t is a receive its peer started sending and then went silent for
  // longer than the progress deadline (net/stall.h). Called while nothing moves.
  virtual void check_stall(const Transfer&, const OpInfo&, Clock::time_point) {}
  // For error messages: the link's measured figures ("" where none are kept).
  virtual std::string link_desc() const { return {}; }
  // The smallest round trip in seconds the kernel has seen on the link (TCP_INFO); 0 where there
  // is none (shared memory).
  virtual double min_rtt_s() const { return 0; }
  // Makes the peer's pending and future operations on this channel fail promptly.
  virtual void abort() = 0;
};

// Checks a received header against the posted part; throws a descriptive kProtocol error.
void check_header(const FrameHeader& h, const Part& p, const Transfer& t, const OpInfo& op,
                  const std::string& peer_desc);
FrameHeader make_header(const Part& p, const Transfer& t, const OpInfo& op);

}  // namespace rumor::net
