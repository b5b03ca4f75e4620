#include "net/tcp_channel.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/log.h"
#include "core/reduce.h"
#include "net/link.h"
#include "net/stall.h"

namespace rumor::net {

namespace {
// Big enough to amortize a recv() call, small enough to stay in L2 while it is reduced.
constexpr size_t kStageBytes = 256 * 1024;
// Stripe boundaries stay multiples of this so that no element straddles two streams.
constexpr size_t kStripeAlign = 64;
// Striped pieces: small enough that a slow stream holds back little of a message, big enough
// that a header per piece and the switch between streams cost nothing measurable.
constexpr size_t kPieceMin = 256 * 1024, kPieceMax = 4 * 1024 * 1024;
constexpr size_t kMaxPieces = 65535;  // FrameHeader::piece
// TLS: plaintext sealed per step (64 records of 16 KiB at most), and ciphertext read per recv().
constexpr size_t kSealBytes = 1024 * 1024;
constexpr size_t kTlsReadBytes = 256 * 1024;

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

TcpChannel::TcpChannel(std::vector<Fd> streams, std::string peer_desc, size_t stripe_min,
                       std::vector<std::unique_ptr<TlsSession>> tls, bool steal, size_t min_width,
                       std::shared_ptr<PathMemory> path)
    : streams_(std::move(streams)),
      peer_desc_(std::move(peer_desc)),
      stripe_min_(stripe_min),
      steal_(steal),
      adapt_(min_width > 0 && min_width < streams_.size()),
      width_rule_(min_width, streams_.size()),
      width_(streams_.size()),
      path_(adapt_ ? std::move(path) : nullptr),
      width_base_(streams_.size()),
      width_now_(streams_.size()),
      tls_(std::move(tls)) {
  if (!tls_.empty() && tls_.size() != streams_.size())
    throw Error(ErrorKind::kInvalidArgument, "TcpChannel to " + peer_desc_ + ": " +
                                                 std::to_string(tls_.size()) + " TLS sessions for " +
                                                 std::to_string(streams_.size()) + " streams");
  for (auto& s : streams_) set_nonblocking(s.get(), true);
  stage_.resize(streams_.size());
  staged_.assign(streams_.size(), 0);
  sealed_hdr_.assign(streams_.size(), 0);
  sealed_len_.assign(streams_.size(), 0);
  // The handshake (TCP's and the authentication's round trips) has just given the kernel its
  // first samples.
  connect_rtt_s_ = rtt_s();
  if (path_) {
    if (const auto learned = path_->stripe_width()) {
      width_rule_.resume(*learned);
      width_ = width_rule_.width();
      RUMOR_LOG(kDebug, "stripe width to " << peer_desc_ << ": starts at " << width_ << " of "
                                           << streams_.size()
                                           << " streams, as the other channels to it decided last");
    }
  }
}

double TcpChannel::rtt_s() const {
  double rtt = 0;
  for (const auto& s : streams_) rtt = std::max(rtt, measured_rtt_s(s.get()));
  return rtt > 0 ? rtt : connect_rtt_s_;
}

double TcpChannel::min_rtt_s() const {
  double rtt = 0;
  for (const auto& s : streams_) {
    const double r = measured_min_rtt_s(s.get());
    if (r > 0 && (rtt == 0 || r < rtt)) rtt = r;
  }
  return rtt;
}

void TcpChannel::note_moved(Transfer& t) {
  const auto now = Clock::now();
  if (t.first_moved == Clock::time_point{}) t.first_moved = now;
  t.last_moved = now;
  if (!t.send) rx_moved_ = now;
  // A whole message's receive rate, first byte to last, refreshes the estimate: it leaves out
  // the wait for the sender to start, and a message that found its bytes already buffered
  // reads too fast only above the rate that matters (stall_limit_s is at its floor there).
  if (!t.send && t.len >= kStallPieceBytes && t.finished()) {
    const double d = seconds(now - t.first_moved);
    if (d > 0) {
      const double sample = static_cast<double>(t.len) / d;
      rx_rate_Bps_ = rx_rate_Bps_ > 0 ? 0.5 * (rx_rate_Bps_ + sample) : sample;
    }
  }
}

std::string TcpChannel::link_desc() const { return describe_link(rx_rate_Bps_, " received", rtt_s()); }

std::string TcpChannel::describe_link(double rate, const char* how, double rtt) const {
  return "link to " + peer_desc_ + ": " +
         (rate > 0 ? fmt("%.3g MB/s", rate * 1e-6) + how : std::string("rate not measured yet")) + ", RTT " +
         fmt("%.3g ms", rtt * 1e3);
}

void TcpChannel::check_stall(const Transfer& t, const OpInfo& op, Clock::time_point now) {
  // Only a receive whose sender has begun it: see net/stall.h for why the other waits keep
  // the ceiling.
  if (op.stall_floor_s <= 0 || t.send || t.first_moved == Clock::time_point{} || t.finished()) return;
  const double idle = seconds(now - std::max(t.last_moved, rx_moved_));
  if (idle < op.stall_floor_s) return;  // the limit is never below the floor: no syscall here
  const size_t left = t.len - t.bytes_done();
  const double rtt = rtt_s();
  // No whole message measured yet (the first big one is this one): its own rate so far.
  double rate = rx_rate_Bps_;
  const char* how = " received";
  const double flowing = seconds(t.last_moved - t.first_moved);
  if (rate <= 0 && flowing > 0 && t.bytes_done() >= kStallPieceBytes) {
    rate = static_cast<double>(t.bytes_done()) / flowing;
    how = " received in this message before it stopped";
  }
  const std::string rate_desc = describe_link(rate, how, rtt);
  const double limit = stall_limit_s(left, rate, rtt, op.stall_floor_s, op.timeout_s);
  if (idle < limit) return;
  throw Error(ErrorKind::kTimeout,
              op.where() + ": " + peer_desc_ + " stopped in the middle of a message: no byte for " +
                  fmt("%.1f", idle) + " s while this rank was receiving " + std::to_string(t.len) +
                  " bytes (" + std::to_string(t.bytes_done()) + " done, " + std::to_string(left) +
                  " outstanding); " + rate_desc + ", so the progress deadline was " + fmt("%.3g", limit) +
                  " s (floor " + fmt("%g", op.stall_floor_s) + " s RUMOR_DEADLINE_FLOOR, ceiling " +
                  fmt("%g", op.timeout_s) +
                  " s RUMOR_TIMEOUT; RUMOR_ADAPTIVE_DEADLINE=0 restores fixed deadlines)");
}

size_t TcpChannel::piece_bytes(size_t len, size_t streams) {
  // About 8 pieces per stream, within [kPieceMin, kPieceMax], and never more than the header
  // can number.
  auto align = [](size_t b) { return (b + kStripeAlign - 1) / kStripeAlign * kStripeAlign; };
  size_t piece = std::clamp(align(len / (8 * std::max<size_t>(streams, 1))), kPieceMin, kPieceMax);
  return std::max(piece, align((len + kMaxPieces - 1) / kMaxPieces));
}

void TcpChannel::adapt_width() {
  if (!adapt_) return;
  std::vector<SendCounters>& now = width_now_;
  SendCounters since;
  uint64_t busiest_us = 0;
  for (size_t i = 0; i < streams_.size(); ++i) {
    now[i] = send_counters(streams_[i].get());
    const SendCounters d = now[i] - width_base_[i];
    since += d;
    busiest_us = std::max(busiest_us, d.busy_us);
  }
  if (since.sent < kWidthSampleBytes) return;
  const size_t before = width_;
  width_ = width_rule_.next(since, busiest_us);
  std::swap(width_base_, width_now_);
  if (path_) path_->remember(width_rule_);
  if (width_ != before)
    RUMOR_LOG(kDebug, "stripe width to "
                          << peer_desc_ << ": " << before << " -> " << width_ << " of " << streams_.size()
                          << " streams (of " << since.sent << " bytes sent, " << since.resent << " in vain, "
                          << width_rule_.last_rate() / 1e6 << " MB/s delivered in " << busiest_us / 1000
                          << " busy ms; recent means " << width_rule_.floor_rate() / 1e6
                          << " MB/s at the floor, " << width_rule_.below_rate() / 1e6
                          << " below; window-limited " << since.window_limited_us / 1000 << " of "
                          << since.busy_us / 1000 << " busy ms)");
}

void TcpChannel::take_piece(Part& p, Transfer& t, const OpInfo& op) {
  const size_t piece = piece_bytes(t.len, t.nparts), count = (t.len + piece - 1) / piece;
  p.hdr_done = p.done = 0;
  if (t.next_piece < count && p.stream < t.width) {
    const size_t i = t.next_piece++;
    p.offset = i * piece;
    p.len = std::min(piece, t.len - p.offset);
    p.hdr = make_header(p, t, op);
    p.hdr.flags = kFramePiece;
    p.hdr.piece = static_cast<uint16_t>(i);
    p.more = true;
  } else {
    p.offset = p.len = 0;
    p.hdr = make_header(p, t, op);
    p.hdr.flags = kFrameEnd;
    p.more = false;
  }
}

void TcpChannel::on_header(Part& p, Transfer& t, const OpInfo& op) {
  if (!striped(t)) {
    check_header(p.hdr, p, t, op, peer_desc_);
    return;
  }
  // The header's own piece length first: check_header reports a corrupt or foreign frame, a
  // different op or a different total size, whichever it is, before the piece fields are read.
  Part probe = p;
  probe.len = p.hdr.part_len;
  check_header(p.hdr, probe, t, op, peer_desc_);
  const size_t piece = piece_bytes(t.len, t.nparts), count = (t.len + piece - 1) / piece;
  auto fail = [&](const std::string& why) {
    throw Error(ErrorKind::kProtocol, op.where() + ": message from " + peer_desc_ + " on stream " +
                                          std::to_string(p.stream) + " " + why);
  };
  if (p.hdr.flags == kFrameEnd && p.hdr.part_len == 0) {
    p.offset = p.len = 0;
    p.more = false;
    if (++t.streams_ended == t.nparts && t.bytes_done() != t.len)
      fail("ended the striped message after " + std::to_string(t.bytes_done()) + " of " +
           std::to_string(t.len) + " bytes");
    return;
  }
  const size_t i = p.hdr.piece;
  if (p.hdr.flags != kFramePiece || i >= count)
    fail("is not a piece of a striped message (flags " + std::to_string(p.hdr.flags) + ", piece " +
         std::to_string(i) + " of " + std::to_string(count) + "): ranks run different versions of rumor?");
  const size_t offset = i * piece, len = std::min(piece, t.len - offset);
  if (p.hdr.part_len != len || t.got[i])
    fail("carries piece " + std::to_string(i) + (t.got[i] ? " a second time" : " with a wrong length"));
  t.got[i] = true;
  p.offset = offset;
  p.len = len;
}

void TcpChannel::next_header(Part& p, Transfer& t) {
  t.pieces_bytes += p.len;
  p.offset = p.len = p.hdr_done = p.done = 0;
}

void TcpChannel::begin_beside(Transfer& t, const OpInfo& op, StreamSet busy) {
  const size_t k = streams_.size();
  // A message sent whole, on stream 0 alone, could finish before the earlier one still on others.
  if (busy != 0 && !(t.len >= stripe_min_ && k > 1)) return;
  if (t.len >= stripe_min_ && k > 1 && steal_) {
    t.nparts = k;
    t.next_piece = t.pieces_bytes = t.streams_ended = 0;
    if (t.send) {
      adapt_width();
      t.width = width_;
    } else {
      const size_t piece = piece_bytes(t.len, k);
      t.got.assign((t.len + piece - 1) / piece, false);
    }
    for (size_t i = 0; i < k; ++i) {
      Part& p = t.parts[i];
      p = Part{};
      p.stream = static_cast<uint32_t>(i);
      if (t.send && (busy >> i & 1u) == 0) {
        take_piece(p, t, op);
      } else if (t.send) {
        p.hdr_done = sizeof(FrameHeader);  // an empty piece, done: the stream takes a real one when free
        p.more = true;
      } else {
        p.more = true;  // until its end marker arrives
      }
    }
    t.begun = true;
    return;
  }
  if (t.len >= stripe_min_ && k > 1) {
    size_t per = (t.len / k) / kStripeAlign * kStripeAlign;
    size_t off = 0;
    t.nparts = k;
    for (size_t i = 0; i < k; ++i) {
      Part& p = t.parts[i];
      p = Part{};
      p.stream = static_cast<uint32_t>(i);
      p.offset = off;
      p.len = i + 1 == k ? t.len - off : per;
      off += p.len;
    }
  } else {
    // Whole messages all take stream 0: messages to one peer in one direction go one at a time
    // anyway, and a stream left idle between messages restarts TCP slow start (a measured 4 MiB
    // ring allreduce through a 100 Mbit link took 0.62-0.72 s instead of 0.53 s when whole
    // messages alternated between two streams).
    t.nparts = 1;
    t.parts[0] = Part{};
    t.parts[0].stream = 0;
    t.parts[0].len = t.len;
  }
  if (t.send)
    for (size_t i = 0; i < t.nparts; ++i) t.parts[i].hdr = make_header(t.parts[i], t, op);
  t.begun = true;
}

void TcpChannel::fail_io(const Transfer& t, const OpInfo& op, int err, bool closed) {
  std::string what = op.where() + ": " + peer_desc_ +
                     (closed ? " closed the connection" : " connection failed (" + errno_string(err) + ")") +
                     " while this rank was " + (t.send ? "sending " : "receiving ") + std::to_string(t.len) +
                     " bytes (" + std::to_string(t.bytes_done()) + " done)";
  // TLS 1.3 lets a client finish its handshake before the server has checked its certificate:
  // a refusal can reach this end as a reset rather than as the server's alert.
  if (!tls_.empty())
    what += "; over TLS, so the peer may have refused this rank's certificate (see its error)";
  throw Error(ErrorKind::kPeerGone, what);
}

bool TcpChannel::progress_send(Part& p, Transfer& t, const OpInfo& op) {
  int fd = streams_[p.stream].get();
  bool moved = false;
  while (!p.finished()) {
    if (p.piece_done()) {  // striped: this stream is free for the next piece
      t.pieces_bytes += p.len;
      take_piece(p, t, op);
      continue;
    }
    iovec iov[2];
    int n_iov = 0;
    if (p.hdr_done < sizeof(FrameHeader)) {
      iov[n_iov++] = {reinterpret_cast<char*>(&p.hdr) + p.hdr_done, sizeof(FrameHeader) - p.hdr_done};
    }
    if (p.done < p.len) iov[n_iov++] = {t.data + p.offset + p.done, p.len - p.done};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n_iov);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
      if (errno == EINTR) continue;
      fail_io(t, op, errno, errno == EPIPE || errno == ECONNRESET);
    }
    size_t left = static_cast<size_t>(n);
    size_t h = std::min(left, sizeof(FrameHeader) - p.hdr_done);
    p.hdr_done += h;
    left -= h;
    p.done += left;
    moved = true;
  }
  return moved;
}

bool TcpChannel::progress_recv(Part& p, Transfer& t, const OpInfo& op) {
  int fd = streams_[p.stream].get();
  bool moved = false;
  while (!p.finished()) {
    if (p.piece_done()) {
      next_header(p, t);
      continue;
    }
    ssize_t n;
    if (p.hdr_done < sizeof(FrameHeader)) {
      // Header alone first: the payload must not touch the destination before it is checked.
      n = ::recv(fd, reinterpret_cast<char*>(&p.hdr) + p.hdr_done, sizeof(FrameHeader) - p.hdr_done,
                 MSG_DONTWAIT);
    } else if (!t.reduce) {
      n = ::recv(fd, t.data + p.offset + p.done, p.len - p.done, MSG_DONTWAIT);
    } else {
      auto& stage = stage_[p.stream];
      if (stage.empty()) stage.resize(kStageBytes);
      const size_t staged = staged_[p.stream];
      size_t want = std::min(kStageBytes - staged, p.len - p.done - staged);
      n = ::recv(fd, stage.data() + staged, want, MSG_DONTWAIT);
      if (n > 0) {
        fold_staged(p, t, static_cast<size_t>(n));
        moved = true;
        continue;
      }
    }
    if (n == 0) fail_io(t, op, 0, true);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
      if (errno == EINTR) continue;
      fail_io(t, op, errno, errno == ECONNRESET);
    }
    moved = true;
    if (p.hdr_done < sizeof(FrameHeader)) {
      p.hdr_done += static_cast<size_t>(n);
      if (p.hdr_done == sizeof(FrameHeader)) on_header(p, t, op);
    } else {
      p.done += static_cast<size_t>(n);
    }
  }
  return moved;
}

void TcpChannel::fold_staged(Part& p, Transfer& t, size_t n) {
  auto& stage = stage_[p.stream];
  size_t& staged = staged_[p.stream];
  staged += n;
  const size_t es = dtype_size(t.dtype);
  size_t whole = staged / es * es;
  reduce_into(t.data + p.offset + p.done, stage.data(), whole / es, t.dtype, t.op);
  p.done += whole;
  if (staged > whole) std::memmove(stage.data(), stage.data() + whole, staged - whole);
  staged -= whole;
}

void TcpChannel::fail_tls(const Error& e, const OpInfo& op, size_t i) {
  // A failed session may hold an alert that tells the peer why; it goes if the socket takes it now.
  if (tls_[i]->pending_out() > 0) {
    auto out = tls_[i]->peek_out();
    [[maybe_unused]] ssize_t n =
        ::send(streams_[i].get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  throw Error(e.kind(), op.where() + ": " + e.what());
}

bool TcpChannel::tls_flush_some(size_t i, const Transfer& t, const OpInfo& op, bool& moved) {
  TlsSession& s = *tls_[i];
  while (s.pending_out() > 0) {
    auto out = s.peek_out();
    ssize_t n = ::send(streams_[i].get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      if (errno == EINTR) continue;
      fail_io(t, op, errno, errno == EPIPE || errno == ECONNRESET);
    }
    s.consume_out(static_cast<size_t>(n));
    moved = true;
  }
  return true;
}

bool TcpChannel::tls_fill(size_t i, const Transfer& t, const OpInfo& op) {
  if (rx_.empty()) rx_.resize(kTlsReadBytes);
  while (true) {
    ssize_t n = ::recv(streams_[i].get(), rx_.data(), rx_.size(), MSG_DONTWAIT);
    if (n > 0) {
      tls_[i]->feed(std::span<const uint8_t>(rx_.data(), static_cast<size_t>(n)));
      return true;
    }
    if (n == 0) {
      if (!tls_[i]->handshake_done())
        throw Error(ErrorKind::kPeerGone,
                    op.where() + ": " + peer_desc_ + ": " + closed_during_handshake(*tls_[i]));
      fail_io(t, op, 0, true);
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
    if (errno == EINTR) continue;
    fail_io(t, op, errno, errno == ECONNRESET);
  }
}

bool TcpChannel::tls_ready(size_t i, const Transfer& t, const OpInfo& op, bool& moved) {
  TlsSession& s = *tls_[i];
  try {
    while (true) {
      if (!s.handshake_done()) s.handshake_step();
      const bool flushed = tls_flush_some(i, t, op, moved);
      // After the handshake, ciphertext still waiting is a send's, which flushes it itself: a
      // receive on the same stream must go on reading, or two ranks sending to each other at
      // once, their sockets full, each wait for the other to read (a deadlock).
      if (s.handshake_done()) return true;
      if (!flushed) return false;
      if (!tls_fill(i, t, op)) return false;
      moved = true;
    }
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kProtocol) fail_tls(e, op, i);
    throw;
  }
}

bool TcpChannel::progress_send_tls(Part& p, Transfer& t, const OpInfo& op) {
  const size_t i = p.stream;
  TlsSession& s = *tls_[i];
  bool moved = false;
  if (!tls_ready(i, t, op, moved)) return moved;
  while (!p.finished()) {
    if (!tls_flush_some(i, t, op, moved)) return moved;
    if (sealed_hdr_[i] + sealed_len_[i] > 0) {
      // Their ciphertext has left: only now do these bytes count as sent.
      p.hdr_done += sealed_hdr_[i];
      p.done += sealed_len_[i];
      sealed_hdr_[i] = sealed_len_[i] = 0;
      continue;
    }
    if (p.piece_done()) {
      t.pieces_bytes += p.len;
      take_piece(p, t, op);
      continue;
    }
    try {
      if (p.hdr_done < sizeof(FrameHeader)) {
        sealed_hdr_[i] = sizeof(FrameHeader) - p.hdr_done;
        s.write({reinterpret_cast<const uint8_t*>(&p.hdr) + p.hdr_done, sealed_hdr_[i]});
      }
      sealed_len_[i] = std::min(kSealBytes, p.len - p.done);
      if (sealed_len_[i] > 0)
        s.write({reinterpret_cast<const uint8_t*>(t.data + p.offset + p.done), sealed_len_[i]});
    } catch (const Error& e) {
      fail_tls(e, op, i);
    }
  }
  return moved;
}

bool TcpChannel::progress_recv_tls(Part& p, Transfer& t, const OpInfo& op) {
  const size_t i = p.stream;
  TlsSession& s = *tls_[i];
  bool moved = false;
  if (!tls_ready(i, t, op, moved)) return moved;
  // Nothing is due after the handshake, but a session may still answer a peer's message.
  tls_flush_some(i, t, op, moved);
  while (!p.finished()) {
    if (p.piece_done()) {
      next_header(p, t);
      continue;
    }
    const bool hdr = p.hdr_done < sizeof(FrameHeader);
    uint8_t* dst = nullptr;
    size_t room = 0;
    if (hdr) {
      dst = reinterpret_cast<uint8_t*>(&p.hdr) + p.hdr_done;
      room = sizeof(FrameHeader) - p.hdr_done;
    } else if (!t.reduce) {
      dst = reinterpret_cast<uint8_t*>(t.data + p.offset + p.done);
      room = p.len - p.done;
    } else {
      auto& stage = stage_[i];
      if (stage.empty()) stage.resize(kStageBytes);
      dst = reinterpret_cast<uint8_t*>(stage.data() + staged_[i]);
      room = std::min(kStageBytes - staged_[i], p.len - p.done - staged_[i]);
    }
    size_t n = 0;
    try {
      n = s.read({dst, room});
    } catch (const Error& e) {
      fail_tls(e, op, i);
    }
    if (hdr) {
      p.hdr_done += n;
      if (n > 0 && p.hdr_done == sizeof(FrameHeader)) on_header(p, t, op);
    } else if (!t.reduce) {
      p.done += n;
    } else if (n > 0) {
      fold_staged(p, t, n);
    }
    if (n > 0) {
      moved = true;
      continue;
    }
    if (s.peer_closed()) fail_io(t, op, 0, true);
    if (!tls_fill(i, t, op)) return moved;
    moved = true;
  }
  return moved;
}

bool TcpChannel::progress_beside(Transfer& t, const OpInfo& op, StreamSet busy) {
  bool moved = false;
  const size_t done_before = t.bytes_done();
  for (size_t i = 0; i < t.nparts; ++i) {
    Part& p = t.parts[i];
    if (p.finished() || (busy >> p.stream & 1u) != 0) continue;
    if (!tls_.empty())
      moved |= t.send ? progress_send_tls(p, t, op) : progress_recv_tls(p, t, op);
    else
      moved |= t.send ? progress_send(p, t, op) : progress_recv(p, t, op);
  }
  // Over TLS, handshake bytes and ciphertext not yet opened move too: they keep the op alive,
  // but only bytes of the message say the peer has begun it (the progress deadline's start).
  if (moved && (tls_.empty() || t.bytes_done() != done_before)) note_moved(t);
  return moved;
}

StreamSet TcpChannel::streams_in_use(const Transfer& t, StreamSet busy) const {
  if (!t.begun) return kAllStreams;
  StreamSet in_use = busy;
  for (size_t i = 0; i < t.nparts; ++i)
    if (!t.parts[i].finished()) in_use |= StreamSet{1} << t.parts[i].stream;
  const StreamSet every = streams_.size() >= 32 ? kAllStreams : (StreamSet{1} << streams_.size()) - 1;
  return (in_use & every) == every ? kAllStreams : in_use;
}

void TcpChannel::want(const Transfer& t, std::vector<pollfd>& fds) const {
  for (size_t i = 0; i < t.nparts; ++i) {
    const Part& p = t.parts[i];
    if (p.finished()) continue;
    short ev = t.send ? POLLOUT : POLLIN;
    if (!tls_.empty()) {
      const TlsSession& s = *tls_[p.stream];
      // A handshake waits for the peer's flight whichever way the part goes, and ciphertext
      // waiting to leave needs POLLOUT.
      if (!s.handshake_done()) ev = POLLIN;
      if (s.pending_out() > 0) ev |= POLLOUT;
    }
    fds.push_back({streams_[p.stream].get(), ev, 0});
  }
}

void TcpChannel::abort() {
  // shutdown() rather than close(): the peer sees EOF at once, and our fds stay valid until
  // the channel is destroyed, so no other thread can be handed a recycled descriptor.
  for (auto& s : streams_) ::shutdown(s.get(), SHUT_RDWR);
}

}  // namespace rumor::net
