#include "comm/window_progress.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>

#include "comm/window.h"
#include "core/log.h"
#include "net/tls_stream.h"

namespace rumor {

using namespace window_wire;  // NOLINT: the frame kinds and statuses read as in the protocol

namespace {

// Window links are TCP streams tagged with this communicator id (groups use small ids,
// hierarchical sub-communicators ids above 2^48).
constexpr uint64_t kWindowCommId = 1ull << 62;
constexpr size_t kMaxMutexWaitersPerPeer = 1024;
// Payload of a frame nobody will use (see window_wire::Payload::kDrain) is read in pieces this big.
constexpr size_t kDrainPiece = 64 << 10;

bool would_block() { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

}  // namespace

struct WindowProgress::OutMsg {
  WinFrame hdr{};
  bool reply = false;                             // counted against the link's reply budget
  const std::byte* data = nullptr;                // payload not owned (a put's tensor: alive until acked)
  std::shared_ptr<std::vector<std::byte>> owned;  // or owned (a get's reply)
};

struct WindowProgress::Link {
  uint32_t peer = 0;
  net::Fd fd;
  // With TLS on (Context::tls_session) every byte of the link goes through it; null when off.
  std::unique_ptr<net::TlsStream> tls;
  bool dead = false;
  bool abort_requested = false;
  std::string why;
  // Incoming frame being read.
  WinFrame in{};
  size_t in_hdr = 0;
  std::vector<std::byte> payload;
  size_t in_got = 0;
  bool draining = false;  // payload read into `payload` and discarded (see window_wire::Payload)
  // Replies queued for this peer and their payload bytes: bounded (reply limits), so a peer that
  // sends requests without reading the answers cannot grow this process's memory.
  size_t replies_queued = 0;
  size_t reply_bytes_queued = 0;
  // Outgoing frames; the front one is being written (out_off bytes of frame + payload done).
  std::deque<OutMsg> out;
  size_t out_off = 0;
};

// A remote part of an operation, waiting for the target's reply (the reply echoes the request's
// weight and p flag, so nothing else needs keeping here).
struct WindowProgress::Inflight {
  std::shared_ptr<WinOp> op;
  uint32_t peer = 0;
};

WindowProgress::WindowProgress(std::shared_ptr<Context> ctx, WindowTarget& target)
    : ctx_(std::move(ctx)), target_(target), rank_(ctx_->rank()) {
  links_.resize(ctx_->size());
  int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) throw Error(ErrorKind::kSystem, "window hub: eventfd: " + net::errno_string(errno));
  wake_fd_ = net::Fd(fd);
}

WindowProgress::~WindowProgress() { stop(); }

void WindowProgress::stop() {
  stop_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
}

void WindowProgress::wake() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
}

void WindowProgress::connect(const std::vector<uint32_t>& remote, const Deadline& deadline) {
  if (links_built_) return;
  for (uint32_t r : remote) {
    if (links_[r]) continue;
    auto fds = ctx_->tcp_streams(kWindowCommId, r, 1, deadline);
    auto l = std::make_unique<Link>();
    l->peer = r;
    l->fd = std::move(fds.at(0));
    net::set_nonblocking(l->fd.get(), true);
    net::tune_stream_socket(l->fd.get());
    if (auto session = ctx_->tls_session(r, "window link"))
      l->tls = std::make_unique<net::TlsStream>(l->fd.get(), std::move(session));
    std::lock_guard lk(mu_);
    links_[r] = std::move(l);
  }
  links_built_ = true;
  bool any = false;
  for (const auto& l : links_) any = any || l != nullptr;
  if (any && !thread_.joinable()) thread_ = std::thread([this] { loop(); });
}

WindowProgress::Link& WindowProgress::link(uint32_t peer) {
  Link* l = links_.at(peer).get();
  if (l == nullptr)
    throw Error(ErrorKind::kInvalidArgument, "window hub: no link to rank " + std::to_string(peer));
  return *l;
}

void WindowProgress::submit(const std::shared_ptr<WinOp>& part, uint32_t peer, WinFrame frame,
                            const std::byte* payload) {
  {
    std::lock_guard lk(mu_);
    const uint64_t op_id = next_op_++;
    inflight_[op_id] = Inflight{part, peer};
    part->add_pending(peer);
    try {
      Link& l = link(peer);
      if (l.dead)
        throw Error(ErrorKind::kPeerGone,
                    "window link to rank " + std::to_string(peer) + " failed: " + l.why);
      OutMsg m;
      m.hdr = frame;
      m.hdr.op_id = op_id;
      m.data = payload;
      l.out.push_back(std::move(m));
    } catch (...) {
      inflight_.erase(op_id);
      part->complete(peer, std::current_exception());
      throw;
    }
  }
  wake();
}

void WindowProgress::abort(const std::vector<uint32_t>& peers) {
  {
    std::lock_guard lk(mu_);
    for (uint32_t peer : peers)
      if (peer < links_.size() && links_[peer]) links_[peer]->abort_requested = true;
  }
  wake();
}

bool WindowProgress::wait_idle(uint64_t id, const Deadline& deadline) {
  std::unique_lock lk(mu_);
  auto busy = [&] {
    for (const auto& [op_id, f] : inflight_)
      if (f.op->window() == id) return true;
    return false;
  };
  return idle_cv_.wait_until(lk, deadline.at(), [&] { return !busy(); });
}

void WindowProgress::finish_inflight(uint64_t op_id, uint32_t peer, std::exception_ptr err) {
  std::shared_ptr<WinOp> op;
  {
    std::lock_guard lk(mu_);
    auto it = inflight_.find(op_id);
    if (it == inflight_.end() || it->second.peer != peer) return;  // already failed
    op = it->second.op;
    inflight_.erase(it);
    idle_cv_.notify_all();
  }
  op->complete(peer, std::move(err));
}

void WindowProgress::fail_link(Link& l, const std::string& why, bool news) {
  std::vector<std::pair<std::shared_ptr<WinOp>, uint32_t>> failed;
  {
    std::lock_guard lk(mu_);
    if (l.dead) return;
    l.dead = true;
    l.why = why;
    l.out.clear();  // drops references to callers' tensors before their ops complete
    l.out_off = 0;
    l.replies_queued = 0;
    l.reply_bytes_queued = 0;
    ::shutdown(l.fd.get(), SHUT_RDWR);
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (it->second.peer == l.peer) {
        failed.emplace_back(it->second.op, l.peer);
        it = inflight_.erase(it);
      } else {
        ++it;
      }
    }
    idle_cv_.notify_all();
  }
  std::erase_if(mutex_waiters_, [&](const auto& t) { return std::get<0>(t) == l.peer; });
  // A peer that shut down cleanly closes its link too; only a link that still had work is news.
  if (!failed.empty() || news) RUMOR_LOG(kWarn, "window link to rank " << l.peer << " failed: " << why);
  // One exception per operation: see WinOp::complete.
  for (auto& [op, peer] : failed)
    op->complete(peer, std::make_exception_ptr(
                           Error(ErrorKind::kPeerGone,
                                 "window link to rank " + std::to_string(l.peer) + " failed: " + why)));
}

void WindowProgress::reply(Link& l, const WinFrame& req, uint8_t kind, uint32_t status, double p,
                           std::shared_ptr<std::vector<std::byte>> payload) {
  OutMsg m;
  m.hdr = WinFrame{
      kFrameMagic, kind, req.with_p, 0, rank_, status, req.window, req.op_id, payload ? payload->size() : 0,
      req.weight,  p,    0};
  m.owned = std::move(payload);
  m.reply = true;
  const size_t bytes = m.hdr.bytes;
  std::lock_guard lk(mu_);
  if (l.dead) return;
  // Every reply answers a request the peer sent; a peer that keeps sending without reading the
  // answers would otherwise make this queue (and its snapshots) grow without bound. The first
  // queued reply is always allowed, whatever its size.
  if (l.replies_queued > 0 && (l.replies_queued >= reply_limit_count_.load() ||
                               l.reply_bytes_queued + bytes > reply_limit_bytes_.load()))
    throw Error(ErrorKind::kProtocol,
                "rank " + std::to_string(l.peer) + " sends requests faster than it reads the replies (" +
                    std::to_string(l.replies_queued) + " replies, " + std::to_string(l.reply_bytes_queued) +
                    " bytes queued unread; limits " + std::to_string(reply_limit_count_.load()) + " and " +
                    std::to_string(reply_limit_bytes_.load()) + ")");
  ++l.replies_queued;
  l.reply_bytes_queued += bytes;
  l.out.push_back(std::move(m));
}

void WindowProgress::retry_remote_mutexes() {
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> granted;
  for (auto it = mutex_waiters_.begin(); it != mutex_waiters_.end();) {
    auto [requester, win_id, op_id] = *it;
    const MutexGrant g = target_.try_grant_mutex(win_id, requester);
    if (g == MutexGrant::kGranted) granted.push_back(*it);
    it = g != MutexGrant::kHeld ? mutex_waiters_.erase(it) : it + 1;
  }
  for (auto [requester, win_id, op_id] : granted) {
    WinFrame req{kFrameMagic, kMutexAcquire, 0, 0, requester, 0, win_id, op_id, 0, 0, 0, 0};
    try {
      reply(*links_[requester], req, kAck, kOk, 0, nullptr);
    } catch (const Error& e) {
      fail_link(*links_[requester], e.what());
    }
  }
}

void WindowProgress::handle_frame(Link& l) {
  const WinFrame& f = l.in;
  // A drained payload was thrown away: the frame is answered as for a window that does not
  // exist, even if one with that id appeared in the meantime.
  const bool drained = l.draining;
  const Deadline dl = Deadline::after(ctx_->timeout_s());
  switch (f.kind) {
    case kPut:
    case kAccumulate: {
      uint32_t st = kUnknownWindow;
      if (!drained) {
        try {
          st = target_.write_slot(f.window, l.peer, l.payload.data(), f.bytes, f.kind == kAccumulate,
                                  f.weight, f.with_p != 0, f.p, dl);
        } catch (const Error&) {
          st = kFailed;
        }
      }
      frames_applied_.fetch_add(1);
      reply(l, f, kAck, st, 0, nullptr);
      break;
    }
    case kGetRequest: {
      auto snap = std::make_shared<std::vector<std::byte>>();
      double p = 0;
      uint32_t st;
      try {
        st = drained ? kUnknownWindow : target_.read_published(f.window, snap.get(), &p, dl);
      } catch (const Error&) {
        st = kFailed;
      }
      if (st != kOk) {
        reply(l, f, kGetReply, st, 0, nullptr);
        break;
      }
      reply(l, f, kGetReply, kOk, p, std::move(snap));
      break;
    }
    case kGetReply: {
      std::exception_ptr err;
      uint32_t st = f.status;
      if (st == kOk && drained) st = kUnknownWindow;
      if (st == kOk) {
        // A slot that stays locked fails this operation only, with the slot's own error.
        try {
          st = target_.write_slot(f.window, l.peer, l.payload.data(), f.bytes, false, f.weight, f.with_p != 0,
                                  f.p, dl);
        } catch (...) {
          err = std::current_exception();
        }
        if (st == kOk) frames_applied_.fetch_add(1);
      }
      if (st != kOk)
        err = std::make_exception_ptr(
            Error(ErrorKind::kInvalidArgument,
                  "win_get: rank " + std::to_string(l.peer) + " refused: " + status_text(st)));
      finish_inflight(f.op_id, l.peer, std::move(err));
      break;
    }
    case kAck: {
      std::exception_ptr err;
      if (f.status != kOk)
        err = std::make_exception_ptr(Error(
            f.status == kFailed ? ErrorKind::kTimeout : ErrorKind::kInvalidArgument,
            "window operation refused by rank " + std::to_string(l.peer) + ": " + status_text(f.status)));
      finish_inflight(f.op_id, l.peer, std::move(err));
      break;
    }
    case kMutexAcquire: {
      if (!target_.window_bytes(f.window)) {
        reply(l, f, kAck, kUnknownWindow, 0, nullptr);
        break;
      }
      // A peer waits for at most a few mutexes at a time (one per thread that asks): a stream of
      // acquire requests it never waits for is refused instead of queued without bound.
      size_t mine = 0;
      for (const auto& t : mutex_waiters_) mine += std::get<0>(t) == l.peer ? 1 : 0;
      if (mine >= kMaxMutexWaitersPerPeer)
        throw Error(ErrorKind::kProtocol, "rank " + std::to_string(l.peer) + " has " + std::to_string(mine) +
                                              " window mutex requests waiting already");
      mutex_waiters_.emplace_back(l.peer, f.window, f.op_id);
      break;
    }
    case kMutexRelease:
      reply(l, f, kAck, target_.release_mutex(f.window, l.peer), 0, nullptr);
      break;
    default:
      throw Error(ErrorKind::kProtocol, "unknown window frame kind " + std::to_string(f.kind));
  }
}

size_t WindowProgress::receive(Link& l, std::byte* into, size_t n) {
  if (l.tls) return l.tls->recv({into, n});
  while (true) {
    const ssize_t got = ::recv(l.fd.get(), into, n, 0);
    if (got > 0) return static_cast<size_t>(got);
    if (got == 0) throw Error(ErrorKind::kPeerGone, "connection closed by the peer");
    if (errno == EINTR) continue;
    if (would_block()) return 0;
    throw Error(ErrorKind::kPeerGone, "recv: " + net::errno_string(errno));
  }
}

void WindowProgress::read_frames(Link& l) {
  // Read as much as is there: frames, and their payloads.
  for (;;) {
    if (l.in_hdr < sizeof(WinFrame)) {
      const size_t n =
          receive(l, reinterpret_cast<std::byte*>(&l.in) + l.in_hdr, sizeof(WinFrame) - l.in_hdr);
      if (n == 0) return;
      l.in_hdr += n;
      if (l.in_hdr < sizeof(WinFrame)) continue;
      // Every size in the frame is checked against the named window before a byte is allocated
      // for it.
      Payload what = Payload::kNone;
      if (std::string bad =
              check_frame(l.in, l.peer, target_.window_bytes(l.in.window), target_.max_window_bytes(), &what);
          !bad.empty())
        throw Error(ErrorKind::kProtocol, bad);
      l.draining = what == Payload::kDrain;
      l.payload.resize(l.draining ? std::min<size_t>(l.in.bytes, kDrainPiece) : l.in.bytes);
      l.in_got = 0;
    }
    if (l.in_got < l.in.bytes) {
      const size_t want =
          l.draining ? std::min<size_t>(l.in.bytes - l.in_got, l.payload.size()) : l.in.bytes - l.in_got;
      std::byte* into = l.draining ? l.payload.data() : l.payload.data() + l.in_got;
      const size_t n = receive(l, into, want);
      if (n == 0) return;
      l.in_got += n;
      if (l.in_got < l.in.bytes) continue;
    }
    handle_frame(l);
    l.in_hdr = 0;
    l.in_got = 0;
  }
}

void WindowProgress::write_frames(Link& l) {
  // Write queued frames until the socket is full. Over TLS, the handshake and ciphertext sealed
  // earlier go first, whether or not a frame waits.
  if (l.tls && !l.tls->pump()) return;
  for (;;) {
    OutMsg* m = nullptr;
    {
      std::lock_guard lk(mu_);
      if (l.dead || l.out.empty()) return;
      m = &l.out.front();
    }
    const std::byte* payload = m->owned ? m->owned->data() : m->data;
    const size_t total = sizeof(WinFrame) + m->hdr.bytes;
    iovec iov[2];
    int niov = 0;
    if (l.out_off < sizeof(WinFrame))
      iov[niov++] = {reinterpret_cast<char*>(&m->hdr) + l.out_off, sizeof(WinFrame) - l.out_off};
    size_t pay_off = l.out_off > sizeof(WinFrame) ? l.out_off - sizeof(WinFrame) : 0;
    if (m->hdr.bytes > pay_off)
      iov[niov++] = {const_cast<std::byte*>(payload) + pay_off, m->hdr.bytes - pay_off};
    size_t n = 0;
    if (l.tls) {
      // Sealed bytes are copied into the session: the frame's buffers are free once taken.
      std::span<const std::byte> parts[2];
      for (int i = 0; i < niov; ++i)
        parts[i] = {static_cast<const std::byte*>(iov[i].iov_base), iov[i].iov_len};
      n = l.tls->send({parts, static_cast<size_t>(niov)});
      if (n == 0) return;
    } else {
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = static_cast<size_t>(niov);
      const ssize_t sent = ::sendmsg(l.fd.get(), &mh, MSG_NOSIGNAL);
      if (sent < 0) {
        if (would_block()) return;
        throw Error(ErrorKind::kPeerGone, "send: " + net::errno_string(errno));
      }
      n = static_cast<size_t>(sent);
    }
    l.out_off += n;
    if (l.out_off == total) {
      std::lock_guard lk(mu_);
      if (!l.out.empty()) {
        if (l.out.front().reply) {
          --l.replies_queued;
          l.reply_bytes_queued -= l.out.front().hdr.bytes;
        }
        l.out.pop_front();
      }
      l.out_off = 0;
    }
  }
}

void WindowProgress::loop() {
  std::vector<pollfd> fds;
  std::vector<Link*> order;
  while (!stop_.load()) {
    fds.clear();
    order.clear();
    fds.push_back(pollfd{wake_fd_.get(), POLLIN, 0});
    {
      std::lock_guard lk(mu_);
      for (auto& lp : links_) {
        if (!lp || lp->dead) continue;
        if (lp->abort_requested) continue;
        short ev = POLLIN;
        // Over TLS frames wait for the handshake (which needs POLLIN): asking for POLLOUT before
        // it is done would spin.
        const bool can_send = !lp->out.empty() && (!lp->tls || lp->tls->handshake_done());
        if (can_send || (lp->tls && lp->tls->wants_write())) ev |= POLLOUT;
        fds.push_back(pollfd{lp->fd.get(), ev, 0});
        order.push_back(lp.get());
      }
    }
    // A remote mutex request waits for a holder on this host, which releases without telling
    // this thread: poll for it every millisecond while any request waits.
    int rc = ::poll(fds.data(), fds.size(), mutex_waiters_.empty() ? 200 : 1);
    if (rc < 0 && errno != EINTR) {
      RUMOR_LOG(kError, "window progress thread: poll: " << net::errno_string(errno));
      continue;
    }
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_.get(), &v, sizeof(v));
    }
    {
      std::vector<Link*> aborts;
      {
        std::lock_guard lk(mu_);
        for (auto& lp : links_)
          if (lp && lp->abort_requested && !lp->dead) aborts.push_back(lp.get());
      }
      for (Link* l : aborts)
        fail_link(*l, "a window operation's deadline passed while waiting for this peer");
    }
    for (size_t i = 0; i < order.size(); ++i) {
      Link& l = *order[i];
      short re = fds[i + 1].revents;
      try {
        // Over TLS every pass reads: a handshake step may have taken the peer's first frames off
        // the socket along with its last handshake bytes, and poll() would not say so.
        if (l.tls || (re & (POLLIN | POLLHUP | POLLERR))) read_frames(l);
        write_frames(l);
      } catch (const Error& e) {
        // A TLS failure (a refused certificate, an altered record) is news even on a link with
        // no operation waiting: the peer's next operation will fail with it too.
        fail_link(l, e.what(), l.tls && e.kind() == ErrorKind::kProtocol);
      } catch (const std::exception& e) {
        fail_link(l, e.what());
      }
    }
    retry_remote_mutexes();
  }
}

}  // namespace rumor
