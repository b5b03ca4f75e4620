#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "net/channel.h"
#include "net/link.h"
#include "net/socket.h"
#include "net/tls.h"

namespace rumor::net {

// Messages of at least stripe_min bytes are striped over every stream; smaller ones go whole on
// stream 0. A striped message is cut into pieces (piece_bytes(): both ends derive the cut from
// the length alone), and a stream that has finished sending its piece takes the next one not yet
// taken: a stream slowed by loss, or by a smaller congestion window, carries fewer pieces instead
// of holding the whole message back (the message used to wait for its slowest fixed 1/k stripe).
// Each piece carries its index; once no piece is left a stream sends an end marker, so a receiver
// never reads into the next message on a stream that carried nothing more of this one.
// RUMOR_STRIPE_STEAL=0 restores fixed stripes (one per stream), for comparison.
//
// With min_width > 0 (a long link's pair that opened more streams than that minimum) the sender
// adapts how many streams take pieces, the stripe width: StripeWidth (net/link.h) reads the
// streams' TCP counters when a striped send begins, narrowing where they send much in vain
// (below min_width only on trial, kept while it delivers about as much) and widening where
// their windows limit them. Streams past the width send their end marker at
// once, so the receiver needs no word of it and the protocol is unchanged. RUMOR_STRIPE_ADAPT=0
// keeps every stream in use, for comparison. A channel starts at the width the other channels to
// the same peer (other communicators') last decided (PathMemory), not at all its streams.
//
// With TLS (issue 46) every stream has a TlsSession, one per stream in `tls`, not yet shaken
// hands: the handshake runs inside progress(), nonblocking, like any other bytes. A blocking
// handshake in Context::connect() would make the dialer (higher rank) wait for the acceptor's
// thread to reach the same connect(), a wait from a higher to a lower rank, and channels are
// connected lazily in whatever order the ops need them: three ranks could wait in a cycle.
// Sends are sealed a chunk at a time and a part counts its bytes only once their ciphertext is
// on the wire, so a finished transfer never leaves bytes behind in a session. Receives read
// plaintext straight into the destination (or the reduce stage) and no byte of a record that
// fails authentication reaches it. Without sessions the zero-copy path is unchanged.
class TcpChannel final : public Channel {
 public:
  // path: what the other channels to this peer learned (stripe width), shared with them; none
  // for a channel on its own.
  TcpChannel(std::vector<Fd> streams, std::string peer_desc, size_t stripe_min,
             std::vector<std::unique_ptr<TlsSession>> tls = {}, bool steal = true, size_t min_width = 0,
             std::shared_ptr<PathMemory> path = nullptr);
  // The piece size of a striped message of `len` bytes over `streams` streams (stealing on).
  static size_t piece_bytes(size_t len, size_t streams);
  bool is_shm() const override { return false; }
  void begin(Transfer& t, const OpInfo& op) override { begin_beside(t, op, 0); }
  void begin_beside(Transfer& t, const OpInfo& op, StreamSet busy) override;
  bool progress(Transfer& t, const OpInfo& op) override { return progress_beside(t, op, 0); }
  bool progress_beside(Transfer& t, const OpInfo& op, StreamSet busy) override;
  StreamSet streams_in_use(const Transfer& t, StreamSet busy) const override;
  void want(const Transfer& t, std::vector<pollfd>& fds) const override;
  void check_alive(const OpInfo&) override {}
  void check_stall(const Transfer& t, const OpInfo& op, Clock::time_point now) override;
  std::string link_desc() const override;
  void abort() override;
  double min_rtt_s() const override;
  // The streams striped sends use now; set_stripe_width() pins it until the next decision (tests).
  size_t stripe_width() const { return width_; }
  void set_stripe_width(size_t w) {
    width_rule_.pin(w);
    width_ = width_rule_.width();
  }

 private:
  bool striped(const Transfer& t) const { return t.nparts > 1 && steal_; }
  // Send, striped: the stream's next piece, or its end marker once every piece is taken.
  void take_piece(Part& p, Transfer& t, const OpInfo& op);
  // Receive: checks a header that has fully arrived, and for a striped message learns from it
  // where the piece goes, or that the stream is done.
  void on_header(Part& p, Transfer& t, const OpInfo& op);
  // Receive, striped: a finished piece is counted and the stream reads its next header.
  void next_header(Part& p, Transfer& t);
  bool progress_send(Part& p, Transfer& t, const OpInfo& op);
  bool progress_recv(Part& p, Transfer& t, const OpInfo& op);
  // Adds n bytes received into the stream's reduce stage and folds the whole elements.
  void fold_staged(Part& p, Transfer& t, size_t n);
  // TLS: the handshake of stream i, advanced as far as the socket allows; true once it is done
  // and this end's last handshake bytes are on the wire.
  bool tls_ready(size_t i, const Transfer& t, const OpInfo& op, bool& moved);
  // Sends what the socket takes of stream i's ciphertext; true once none is pending.
  bool tls_flush_some(size_t i, const Transfer& t, const OpInfo& op, bool& moved);
  // Reads the ciphertext the socket holds for stream i into its session; false if none.
  bool tls_fill(size_t i, const Transfer& t, const OpInfo& op);
  bool progress_send_tls(Part& p, Transfer& t, const OpInfo& op);
  bool progress_recv_tls(Part& p, Transfer& t, const OpInfo& op);
  // A session's error (refused certificate, failed integrity check) with the op in front.
  [[noreturn]] void fail_tls(const Error& e, const OpInfo& op, size_t i);
  [[noreturn]] void fail_io(const Transfer& t, const OpInfo& op, int err, bool closed);
  // "link to rank 3: 12.5 MB/s received, RTT 101 ms" for error messages; `how` follows the rate.
  std::string describe_link(double rate, const char* how, double rtt) const;
  // The kernel's smoothed round trip over the streams (the largest: the stall rule must not be
  // tighter than the slowest stream), or what was measured at connect time if it reports none.
  double rtt_s() const;
  void note_moved(Transfer& t);
  // Before a striped send: the stripe width from what the streams sent since the last decision.
  void adapt_width();

  std::vector<Fd> streams_;
  std::string peer_desc_;
  size_t stripe_min_;
  bool steal_;
  bool adapt_;  // a long link's pair, adapting its stripe width
  StripeWidth width_rule_;
  size_t width_;
  std::shared_ptr<PathMemory> path_;
  std::vector<SendCounters> width_base_;  // per stream: its counters at the last width decision
  std::vector<SendCounters> width_now_;   // scratch, so a striped send allocates nothing
  // Per stream: where reduce-receives land before being folded into the destination.
  std::vector<std::vector<std::byte>> stage_;
  std::vector<size_t> staged_;
  // TLS (empty when off): a session per stream; per stream, the header and payload bytes of the
  // current send part sealed into the session and not yet on the wire; scratch for ciphertext.
  std::vector<std::unique_ptr<TlsSession>> tls_;
  std::vector<size_t> sealed_hdr_;
  std::vector<size_t> sealed_len_;
  std::vector<uint8_t> rx_;
  // The link as measured (net/stall.h): round trip at connect time, and the receive rate of
  // recent messages (a moving average; 0 until one big enough has arrived).
  double connect_rtt_s_ = 0;
  double rx_rate_Bps_ = 0;
  // When the latest byte of any receive arrived: a message waiting for streams an earlier one
  // still holds is not stalled while that one's bytes flow.
  Clock::time_point rx_moved_{};
};

}  // namespace rumor::net
