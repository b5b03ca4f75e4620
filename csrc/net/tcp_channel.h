#pragma once

#include <memory>
#include <vector>

#include "net/channel.h"
#include "net/socket.h"

namespace rumor::net {

// Messages of at least stripe_min bytes are split into one part per stream; smaller ones go
// whole on stream 0. Both ends derive the split from the length alone, so no extra negotiation
// travels.
class TcpChannel final : public Channel {
 public:
  TcpChannel(std::vector<Fd> streams, std::string peer_desc, size_t stripe_min);
  bool is_shm() const override { return false; }
  void begin(Transfer& t, const OpInfo& op) override;
  bool progress(Transfer& t, const OpInfo& op) override;
  void want(const Transfer& t, std::vector<pollfd>& fds) const override;
  void check_alive(const OpInfo&) override {}
  void check_stall(const Transfer& t, const OpInfo& op, Clock::time_point now) override;
  std::string link_desc() const override;
  void abort() override;

 private:
  bool progress_send(Part& p, Transfer& t, const OpInfo& op);
  bool progress_recv(Part& p, Transfer& t, const OpInfo& op);
  [[noreturn]] void fail_io(const Transfer& t, const OpInfo& op, int err, bool closed);
  // "link to rank 3: 12.5 MB/s received, RTT 101 ms" for error messages; `how` follows the rate.
  std::string describe_link(double rate, const char* how, double rtt) const;
  // The kernel's smoothed round trip over the streams (the largest: the stall rule must not be
  // tighter than the slowest stream), or what was measured at connect time if it reports none.
  double rtt_s() const;
  void note_moved(Transfer& t);

  std::vector<Fd> streams_;
  std::string peer_desc_;
  size_t stripe_min_;
  // Per stream: where reduce-receives land before being folded into the destination.
  std::vector<std::vector<std::byte>> stage_;
  std::vector<size_t> staged_;
  // The link as measured (net/stall.h): round trip at connect time, and the receive rate of
  // recent messages (a moving average; 0 until one big enough has arrived).
  double connect_rtt_s_ = 0;
  double rx_rate_Bps_ = 0;
};

}  // namespace rumor::net
