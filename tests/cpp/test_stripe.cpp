// Striped messages over several TCP streams: pieces go to whichever stream is free (work
// stealing), each stream closes its share with an end marker, and a receiver refuses pieces that
// are out of range, repeated, or missing when every stream has ended.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "loopback.h"
#include "net/socket.h"
#include "net/tcp_channel.h"

namespace {
using rumor::Clock;
using rumor::Deadline;
using rumor::Error;
using rumor::ErrorKind;
using namespace rumor::net;

using Pair = rumor::testing::LoopbackPair;
using rumor::testing::loopback_pair;

OpInfo test_op() {
  OpInfo op;
  op.name = "allgather";
  op.comm = "world";
  op.opcode = 2;
  op.tag = 5;
  op.timeout_s = 30;
  op.deadline = Deadline::after(30);
  return op;
}

std::vector<std::byte> pattern(size_t len) {
  std::vector<std::byte> v(len);
  for (size_t i = 0; i < len; ++i) v[i] = static_cast<std::byte>((i * 131 + i / 4096) & 0xff);
  return v;
}

// A channel over two loopback connections, as their first ends.
TcpChannel two_streams(Pair& a, Pair& b, const char* peer) {
  std::vector<Fd> streams;
  streams.push_back(std::move(a.ours));
  streams.push_back(std::move(b.ours));
  return TcpChannel(std::move(streams), peer, 1 << 20);
}

// Reads one frame (header and payload) from a blocking socket as a receiver would.
FrameHeader read_frame(int fd, std::vector<std::byte>& payload) {
  FrameHeader h{};
  read_all(fd, &h, sizeof(h), Deadline::after(20), "test header");
  payload.resize(h.part_len);
  if (h.part_len > 0) read_all(fd, payload.data(), h.part_len, Deadline::after(20), "test payload");
  return h;
}

// A stream that is not read (standing for one slowed by loss) does not hold the message back:
// the free stream takes every piece after the first one the stuck stream took.
TEST(Stripe, AFreeStreamTakesThePiecesAStuckStreamCannot) {
  Pair a = loopback_pair(), b = loopback_pair();
  // Small buffers on stream 1, so that what its kernel takes is far less than one piece.
  const int small = 16 * 1024;
  ASSERT_EQ(::setsockopt(b.ours.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  ASSERT_EQ(::setsockopt(b.theirs.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  TcpChannel ch = two_streams(a, b, "rank 1");
  const OpInfo op = test_op();
  constexpr size_t kLen = 24 << 20;
  const size_t piece = TcpChannel::piece_bytes(kLen, 2), count = (kLen + piece - 1) / piece;
  ASSERT_GE(count, 8u);
  const auto data = pattern(kLen);
  Transfer t = make_send(1, data.data(), kLen);
  ch.begin(t, op);
  // Stream 0's reader runs on a thread; stream 1 is read only once stream 0 has ended.
  std::vector<std::byte> got(kLen);
  std::vector<size_t> on_stream0;
  std::string reader_error;
  std::thread reader([&] {
    try {
      std::vector<std::byte> payload;
      while (true) {
        FrameHeader h = read_frame(a.theirs.get(), payload);
        if (h.flags == kFrameEnd) break;
        on_stream0.push_back(h.piece);
        std::memcpy(got.data() + h.piece * piece, payload.data(), payload.size());
      }
    } catch (const std::exception& e) {
      reader_error = e.what();
    }
  });
  const auto guard = Clock::now() + std::chrono::seconds(20);
  // Stream 0 is finished once every piece has been taken and its own and its end marker are out.
  while (!t.parts[0].finished() && Clock::now() < guard) {
    ch.progress(t, op);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  reader.join();
  ASSERT_EQ(reader_error, "");
  ASSERT_TRUE(t.parts[0].finished()) << "stream 0 never finished while stream 1 was not read";
  // Stream 1 took one piece at the start and could never finish it: every other went on stream 0.
  EXPECT_EQ(on_stream0.size(), count - 1);
  EXPECT_EQ(std::find(on_stream0.begin(), on_stream0.end(), size_t{1}), on_stream0.end());
  std::vector<std::byte> payload;
  FrameHeader first{}, last{};
  std::thread reader1([&] {
    try {
      first = read_frame(b.theirs.get(), payload);
      std::memcpy(got.data() + first.piece * piece, payload.data(), payload.size());
      std::vector<std::byte> end;
      last = read_frame(b.theirs.get(), end);
    } catch (const std::exception& e) {
      reader_error = e.what();
    }
  });
  while (!t.finished() && Clock::now() < guard) {
    ch.progress(t, op);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  reader1.join();
  ASSERT_EQ(reader_error, "");
  EXPECT_EQ(first.flags, kFramePiece);
  EXPECT_EQ(first.piece, 1);
  EXPECT_EQ(last.flags, kFrameEnd);
  ASSERT_TRUE(t.finished());
  EXPECT_EQ(t.bytes_done(), kLen);
  EXPECT_TRUE(got == data);
}

// A receiving channel fed by hand: pieces in any order over either stream land in place.
struct Receiver {
  Pair a = loopback_pair(), b = loopback_pair();
  std::unique_ptr<TcpChannel> ch;
  OpInfo op = test_op();
  Receiver() {
    std::vector<Fd> streams;
    streams.push_back(std::move(a.ours));
    streams.push_back(std::move(b.ours));
    ch = std::make_unique<TcpChannel>(std::move(streams), "rank 2", 1 << 20);
  }
  int peer_fd(size_t stream) { return (stream == 0 ? a.theirs : b.theirs).get(); }
  void send_piece(size_t stream, const Transfer& like, size_t index, size_t len, const std::byte* payload) {
    Part p;
    p.len = len;
    FrameHeader h = make_header(p, like, op);
    h.flags = kFramePiece;
    h.piece = static_cast<uint16_t>(index);
    write_all(peer_fd(stream), &h, sizeof(h), Deadline::after(10), "test header");
    if (len > 0) write_all(peer_fd(stream), payload, len, Deadline::after(10), "test payload");
  }
  void send_end(size_t stream, const Transfer& like) {
    Part p;
    FrameHeader h = make_header(p, like, op);
    h.flags = kFrameEnd;
    write_all(peer_fd(stream), &h, sizeof(h), Deadline::after(10), "test end");
  }
  // Sends on a thread of their own (a socket takes only so much unread) while the transfer is
  // driven here; returns drive()'s text.
  std::string drive_while(Transfer& t, const std::function<void()>& sends) {
    std::string send_error;
    std::thread sender([&] {
      try {
        sends();
      } catch (const std::exception& e) {
        send_error = e.what();
      }
    });
    std::string err = drive(t);
    if (!err.empty()) ch->abort();  // a sender blocked on a full socket sees the reset
    sender.join();
    return err;
  }
  // Progresses until the transfer finishes or fails; returns the error text ("" if it finished).
  std::string drive(Transfer& t) {
    const auto guard = Clock::now() + std::chrono::seconds(20);
    try {
      while (!t.finished() && Clock::now() < guard) {
        ch->progress(t, op);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
      return e.what();
    }
    return t.finished() ? "" : "not finished";
  }
};

TEST(Stripe, PiecesInAnyOrderOnAnyStreamLandInPlace) {
  Receiver r;
  constexpr size_t kLen = (8 << 20) + 4096;  // the last piece is short
  const size_t piece = TcpChannel::piece_bytes(kLen, 2), count = (kLen + piece - 1) / piece;
  const auto data = pattern(kLen);
  std::vector<std::byte> out(kLen);
  Transfer t = make_recv(2, out.data(), kLen);
  r.ch->begin(t, r.op);
  std::string sender_error;
  std::thread sender([&] {
    try {
      for (size_t k = 0; k < count; ++k) {
        const size_t i = count - 1 - k;  // backwards, alternating streams
        r.send_piece(k % 2, t, i, std::min(piece, kLen - i * piece), data.data() + i * piece);
      }
      r.send_end(0, t);
      r.send_end(1, t);
    } catch (const std::exception& e) {
      sender_error = e.what();
    }
  });
  const std::string err = r.drive(t);
  sender.join();
  EXPECT_EQ(sender_error, "");
  EXPECT_EQ(err, "");
  EXPECT_TRUE(out == data);
}

TEST(Stripe, ARepeatedPieceIsRefused) {
  Receiver r;
  constexpr size_t kLen = 8 << 20;
  const size_t piece = TcpChannel::piece_bytes(kLen, 2);
  const auto data = pattern(kLen);
  std::vector<std::byte> out(kLen);
  Transfer t = make_recv(2, out.data(), kLen);
  r.ch->begin(t, r.op);
  const std::string err = r.drive_while(t, [&] {
    r.send_piece(0, t, 0, piece, data.data());
    r.send_piece(1, t, 0, piece, data.data());
  });
  EXPECT_NE(err.find("carries piece 0 a second time"), std::string::npos) << err;
  EXPECT_NE(err.find("allgather (op #5, world): message from rank 2"), std::string::npos) << err;
}

TEST(Stripe, StreamsEndingWithAPieceMissingAreRefused) {
  Receiver r;
  constexpr size_t kLen = 8 << 20;
  const size_t piece = TcpChannel::piece_bytes(kLen, 2), count = (kLen + piece - 1) / piece;
  const auto data = pattern(kLen);
  std::vector<std::byte> out(kLen);
  Transfer t = make_recv(2, out.data(), kLen);
  r.ch->begin(t, r.op);
  const std::string err = r.drive_while(t, [&] {
    for (size_t i = 0; i + 1 < count; ++i) r.send_piece(i % 2, t, i, piece, data.data() + i * piece);
    r.send_end(0, t);
    r.send_end(1, t);
  });
  EXPECT_NE(err.find("ended the striped message after " + std::to_string(kLen - piece) + " of " +
                     std::to_string(kLen) + " bytes"),
            std::string::npos)
      << err;
}

TEST(Stripe, APieceOutOfRangeOrOfTheWrongLengthIsRefused) {
  for (bool out_of_range : {true, false}) {
    Receiver r;
    constexpr size_t kLen = 8 << 20;
    const size_t piece = TcpChannel::piece_bytes(kLen, 2), count = (kLen + piece - 1) / piece;
    const auto data = pattern(kLen);
    std::vector<std::byte> out(kLen, std::byte{0x5a});
    Transfer t = make_recv(2, out.data(), kLen);
    r.ch->begin(t, r.op);
    const std::string err = r.drive_while(t, [&] {
      if (out_of_range)
        r.send_piece(0, t, count, 64, data.data());
      else
        r.send_piece(0, t, 0, piece - 64, data.data());
    });
    EXPECT_NE(err.find(out_of_range ? "is not a piece of a striped message"
                                    : "carries piece 0 with a wrong length"),
              std::string::npos)
        << err;
    // Nothing of a refused piece reached the destination.
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](std::byte b) { return b == std::byte{0x5a}; }));
  }
}

// A sender whose stripe width is narrower than its streams: the streams past the width carry only
// their end marker, every piece goes on the others, and a receiving channel (which knows nothing
// of the width) reassembles the message.
TEST(Stripe, StreamsPastTheWidthSendOnlyTheirEndMarker) {
  constexpr size_t kLen = (12 << 20) + 4096;
  const auto data = pattern(kLen);
  std::vector<std::byte> out(kLen);
  std::vector<Pair> pairs;
  for (int i = 0; i < 3; ++i) pairs.push_back(loopback_pair());
  std::vector<Fd> ours, theirs;
  for (auto& p : pairs) {
    ours.push_back(std::move(p.ours));
    theirs.push_back(std::move(p.theirs));
  }
  // Adaptation on (minimum 1 of 3), the width pinned to 1 before the first decision could move it.
  TcpChannel sender(std::move(ours), "rank 1", 1 << 20, {}, true, 1);
  ASSERT_EQ(sender.stripe_width(), 3u);
  sender.set_stripe_width(1);
  TcpChannel receiver(std::move(theirs), "rank 0", 1 << 20);
  const OpInfo op = test_op();
  Transfer s = make_send(1, data.data(), kLen), r = make_recv(0, out.data(), kLen);
  sender.begin(s, op);
  receiver.begin(r, op);
  EXPECT_EQ(s.width, 1u);
  // Streams 1 and 2 start with their end marker, stream 0 with piece 0.
  EXPECT_EQ(s.parts[0].hdr.flags, kFramePiece);
  EXPECT_EQ(s.parts[1].hdr.flags, kFrameEnd);
  EXPECT_EQ(s.parts[2].hdr.flags, kFrameEnd);
  const auto guard = Clock::now() + std::chrono::seconds(20);
  while (!(s.finished() && r.finished()) && Clock::now() < guard) {
    sender.progress(s, op);
    receiver.progress(r, op);
  }
  ASSERT_TRUE(s.finished() && r.finished());
  EXPECT_EQ(r.streams_ended, 3u);
  EXPECT_TRUE(out == data);
  // A clean loopback retransmits nothing: past the sample size, the width never narrows below
  // where it stands (it widens only where windows limited the streams).
  sender.set_stripe_width(2);
  Transfer s2 = make_send(1, data.data(), kLen), r2 = make_recv(0, out.data(), kLen);
  std::fill(out.begin(), out.end(), std::byte{0});
  sender.begin(s2, op);
  receiver.begin(r2, op);
  EXPECT_GE(s2.width, 2u);
  while (!(s2.finished() && r2.finished()) && Clock::now() < guard) {
    sender.progress(s2, op);
    receiver.progress(r2, op);
  }
  ASSERT_TRUE(s2.finished() && r2.finished());
  EXPECT_TRUE(out == data);
}

// Channels to one peer share what they learn of the path: one made later starts at the width
// the others last decided, and a channel's own decision (after a full sample) is remembered.
TEST(Stripe, ChannelsToOnePeerShareTheirStripeWidth) {
  auto streams = [](std::vector<Pair>& pairs, std::vector<Fd>& theirs) {
    std::vector<Fd> ours;
    for (int i = 0; i < 3; ++i) pairs.push_back(loopback_pair());
    for (auto& p : pairs) {
      ours.push_back(std::move(p.ours));
      theirs.push_back(std::move(p.theirs));
    }
    return ours;
  };
  auto path = std::make_shared<PathMemory>();
  StripeWidth learned(1, 3);
  learned.pin(1);
  path->remember(learned);
  std::vector<Pair> p1, p2, p3;
  std::vector<Fd> t1, t2, t3;
  TcpChannel later(streams(p1, t1), "rank 1", 1 << 20, {}, true, 1, path);
  EXPECT_EQ(later.stripe_width(), 1u);
  TcpChannel alone(streams(p2, t2), "rank 1", 1 << 20, {}, true, 1);
  EXPECT_EQ(alone.stripe_width(), 3u);
  // Not adapting (as many streams as the floor, or adaptation off): the memory plays no part.
  TcpChannel fixed(streams(p3, t3), "rank 1", 1 << 20, {}, true, 3, path);
  EXPECT_EQ(fixed.stripe_width(), 3u);

  // A channel's decision reaches the memory: two striped messages of 12 MiB over loopback, the
  // second begun past a full sample of the first.
  auto fresh = std::make_shared<PathMemory>();
  std::vector<Pair> p4;
  std::vector<Fd> t4;
  TcpChannel sender(streams(p4, t4), "rank 1", 1 << 20, {}, true, 1, fresh);
  TcpChannel receiver(std::move(t4), "rank 0", 1 << 20);
  constexpr size_t kLen = 12 << 20;
  const auto data = pattern(kLen);
  std::vector<std::byte> out(kLen);
  const OpInfo op = test_op();
  const auto guard = Clock::now() + std::chrono::seconds(20);
  for (int m = 0; m < 2; ++m) {
    Transfer s = make_send(1, data.data(), kLen), r = make_recv(0, out.data(), kLen);
    sender.begin(s, op);
    receiver.begin(r, op);
    while (!(s.finished() && r.finished()) && Clock::now() < guard) {
      sender.progress(s, op);
      receiver.progress(r, op);
    }
    ASSERT_TRUE(s.finished() && r.finished());
    EXPECT_TRUE(out == data);
    EXPECT_EQ(fresh->stripe_width().has_value(), m == 1) << "message " << m;
  }
  EXPECT_EQ(fresh->stripe_width()->width(), sender.stripe_width());
}

// Drives the transfers of one lane (one peer, one direction) as Communicator::exchange does
// with `beside`: each goes on the streams the earlier ones have finished with. `held` stands for
// streams that something before the lane still needs.
bool drive_lane(TcpChannel& ch, const std::vector<Transfer*>& lane, const OpInfo& op, StreamSet held = 0) {
  StreamSet busy = held;
  bool moved = false;
  for (Transfer* t : lane) {
    if (t->finished()) continue;
    if (busy == kAllStreams) break;
    if (!t->begun) ch.begin_beside(*t, op, busy);
    if (!t->begun) break;  // declined: it waits for the earlier ones
    moved |= ch.progress_beside(*t, op, busy);
    busy = ch.streams_in_use(*t, busy);
  }
  return moved;
}

bool all_finished(const std::vector<Transfer*>& lane) {
  return std::all_of(lane.begin(), lane.end(), [](const Transfer* t) { return t->finished(); });
}

// Three messages to one peer (striped, striped and reduced, whole) with stream 1 stuck inside
// the first: stream 0 carries its share of the first and then the whole of the second, which the
// receiver reduces beside the first's unfinished piece; the third, sent whole, waits, so the
// messages still finish in order. Once stream 1 moves, everything lands where it belongs.
TEST(Stripe, LaterMessagesGoBesideOneStuckOnAStream) {
  Pair a = loopback_pair(), b = loopback_pair();
  const int small = 16 * 1024;
  ASSERT_EQ(::setsockopt(b.ours.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  ASSERT_EQ(::setsockopt(b.theirs.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  std::vector<Fd> ours, theirs;
  ours.push_back(std::move(a.ours));
  ours.push_back(std::move(b.ours));
  theirs.push_back(std::move(a.theirs));
  theirs.push_back(std::move(b.theirs));
  TcpChannel sender(std::move(ours), "rank 1", 1 << 20), receiver(std::move(theirs), "rank 0", 1 << 20);
  const OpInfo op = test_op();
  constexpr size_t kLen1 = 12 << 20, kFloats2 = 2 << 20, kLen3 = 64 << 10;
  const auto data1 = pattern(kLen1), data3 = pattern(kLen3);
  std::vector<float> data2(kFloats2), out2(kFloats2);
  for (size_t i = 0; i < kFloats2; ++i) {
    data2[i] = static_cast<float>(i % 1000) * 0.25f;
    out2[i] = static_cast<float>(i % 7);
  }
  std::vector<std::byte> out1(kLen1), out3(kLen3);
  Transfer s1 = make_send(1, data1.data(), kLen1), s2 = make_send(1, data2.data(), kFloats2 * 4),
           s3 = make_send(1, data3.data(), kLen3);
  Transfer r1 = make_recv(0, out1.data(), kLen1),
           r2 = make_recv_reduce(0, out2.data(), kFloats2 * 4, rumor::DType::F32, rumor::ReduceOp::SUM),
           r3 = make_recv(0, out3.data(), kLen3);
  const std::vector<Transfer*> sends{&s1, &s2, &s3}, recvs{&r1, &r2, &r3};
  // The receiver leaves stream 1 unread, so the sender's stream 1 cannot get past the piece it
  // took first; everything else moves.
  const auto guard = Clock::now() + std::chrono::seconds(20);
  while (!(s2.parts[0].finished() && r2.bytes_done() == r2.len) && Clock::now() < guard) {
    drive_lane(sender, sends, op);
    drive_lane(receiver, recvs, op, StreamSet{1} << 1);
  }
  ASSERT_TRUE(s2.parts[0].finished()) << "stream 0 never carried the second message";
  ASSERT_EQ(r2.bytes_done(), r2.len);
  EXPECT_FALSE(s1.finished());
  EXPECT_FALSE(r1.finished());
  EXPECT_EQ(s2.parts[1].len, 0u);  // stream 1 took none of the second message's pieces
  EXPECT_FALSE(r2.finished());     // its end marker on stream 1 is still behind the first message
  EXPECT_FALSE(s3.begun);          // a message sent whole waits for the striped ones before it
  EXPECT_FALSE(r3.begun);
  while (!(all_finished(sends) && all_finished(recvs)) && Clock::now() < guard) {
    drive_lane(sender, sends, op);
    drive_lane(receiver, recvs, op);
  }
  ASSERT_TRUE(all_finished(sends) && all_finished(recvs));
  EXPECT_TRUE(out1 == data1);
  EXPECT_TRUE(out3 == data3);
  for (size_t i = 0; i < kFloats2; ++i)
    ASSERT_EQ(out2[i], static_cast<float>(i % 7) + static_cast<float>(i % 1000) * 0.25f) << i;
}

// A stream begun busy takes its first piece only once free, in order with the others.
TEST(Stripe, ABusyStreamTakesItsFirstPieceWhenFree) {
  Pair a = loopback_pair(), b = loopback_pair();
  TcpChannel ch = two_streams(a, b, "rank 1");
  const OpInfo op = test_op();
  constexpr size_t kLen = 4 << 20;
  const auto data = pattern(kLen);
  Transfer t = make_send(1, data.data(), kLen);
  ch.begin_beside(t, op, StreamSet{1} << 1);
  EXPECT_EQ(t.parts[0].hdr.piece, 0u);
  EXPECT_EQ(t.parts[0].hdr.flags, kFramePiece);
  EXPECT_EQ(t.next_piece, 1u);
  EXPECT_EQ(ch.streams_in_use(t, 0), kAllStreams);
  // Nothing goes on the busy stream.
  ch.progress_beside(t, op, StreamSet{1} << 1);
  EXPECT_EQ(t.parts[1].len, 0u);
  EXPECT_FALSE(t.parts[1].finished());
  // A message too small to stripe is not begun beside a busy stream.
  Transfer whole = make_send(1, data.data(), 64 << 10);
  ch.begin_beside(whole, op, StreamSet{1} << 1);
  EXPECT_FALSE(whole.begun);
}

TEST(Stripe, PieceSizeStaysWithinItsBoundsAndTheHeadersNumbering) {
  EXPECT_EQ(TcpChannel::piece_bytes(4 << 20, 2), 256u * 1024);
  EXPECT_EQ(TcpChannel::piece_bytes(64 << 20, 2), 4u << 20);
  EXPECT_EQ(TcpChannel::piece_bytes(16 << 20, 4), 512u * 1024);
  const size_t huge = size_t{1} << 40;  // 1 TiB: pieces grow so that at most 65535 are numbered
  const size_t piece = TcpChannel::piece_bytes(huge, 2);
  EXPECT_LE((huge + piece - 1) / piece, 65535u);
  EXPECT_EQ(piece % 64, 0u);
}

}  // namespace
