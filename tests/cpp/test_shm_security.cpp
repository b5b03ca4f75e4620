// Shared memory another local user could reach (net/shm.h): segments not made by this user are
// refused before they are mapped, and ring indices read from a segment are checked before use.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "net/shm.h"

namespace rumor::net {
namespace {

std::string unique_name(const char* what) {
  return "/rumor-test-" + std::to_string(::getpid()) + "-" + what + "@0.0";
}

// Makes `name` as a stranger would: another owner (if we may chown) or group/other access.
void precreate(const std::string& name, uid_t uid, mode_t mode) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd, 1 << 16), 0);
  ASSERT_EQ(::fchmod(fd, mode), 0);
  if (uid != ::geteuid()) {
    ASSERT_EQ(::fchown(fd, uid, uid), 0) << std::strerror(errno);
  }
  ::close(fd);
}

struct Unlink {
  std::string name;
  ~Unlink() { ::shm_unlink(name.c_str()); }
};

void expect_refused(const std::string& name, const std::string& expect) {
  try {
    ShmSegment s = ShmSegment::open(name, 4096, Deadline::after(5), "doorbell of rank 1");
    ADD_FAILURE() << "a segment that is not private to this user was mapped";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << what;
    EXPECT_NE(what.find("refusing shared memory " + name), std::string::npos) << what;
    EXPECT_NE(what.find(expect), std::string::npos) << what;
  }
  // And creating it (what the owner of the name does) never adopts it.
  try {
    ShmSegment s = ShmSegment::create(name, 4096);
    ADD_FAILURE() << "an existing name was adopted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("File exists"), std::string::npos) << e.what();
  }
}

TEST(ShmSecurity, SegmentOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a segment owned by another uid";
  Unlink u{unique_name("foreign")};
  precreate(u.name, 65534, 0600);
  expect_refused(u.name, "owned by uid 65534");
}

TEST(ShmSecurity, SegmentOthersCanOpenIsRefused) {
  Unlink u{unique_name("open")};
  precreate(u.name, ::geteuid(), 0666);
  expect_refused(u.name, "with mode 0666");
}

TEST(ShmSecurity, CreatedSegmentIsPrivateWhateverTheUmask) {
  Unlink u{unique_name("umask")};
  mode_t old = ::umask(0);
  ShmSegment s = ShmSegment::create(u.name, 4096);
  ::umask(old);
  s.keep_name();
  struct stat st{};
  ASSERT_EQ(::stat(("/dev/shm" + u.name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
}

// A channel whose ring index was overwritten (as a buggy or hostile peer could): the receiver
// reports it instead of copying from far outside the ring.
TEST(ShmSecurity, CorruptRingIndexIsAnError) {
  const std::string name = unique_name("ring");
  Unlink u{name};
  Doorbell bells[2]{};
  Deadline dl = Deadline::after(10);
  ShmChannel creator(name, true, 4096, &bells[0], &bells[1], "rank 1", dl);
  // A third mapping, taken before the opener removes the name: the "peer's" view of the rings.
  ShmSegment view = ShmSegment::open(name, 64 + 2 * sizeof(RingCtl), dl, "test view");
  ShmChannel opener(name, false, 4096, &bells[1], &bells[0], "rank 0", dl);
  OpInfo op;
  op.name = "test";
  op.comm = "test";
  // A real message first, so the ring holds a valid frame header where the reader looks.
  std::vector<std::byte> out(1024, std::byte{7});
  Transfer s;
  s.send = true;
  s.data = out.data();
  s.len = out.size();
  creator.begin(s, op);
  for (int i = 0; i < 100 && !s.parts[0].finished(); ++i) creator.progress(s, op);
  ASSERT_TRUE(s.parts[0].finished());
  // Ring 0 carries creator -> opener; its head is what the opener reads. The old reader took
  // any head as "that many bytes are ready".
  auto* rings = reinterpret_cast<RingCtl*>(static_cast<std::byte*>(view.data()) + 64);
  rings[0].head.store(uint64_t{1} << 40);
  std::vector<std::byte> buf(1024);
  Transfer t;
  t.send = false;
  t.data = buf.data();
  t.len = buf.size();
  opener.begin(t, op);
  try {
    opener.progress(t, op);
    ADD_FAILURE() << "a corrupt ring head was trusted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
    EXPECT_NE(std::string(e.what()).find("corrupt ring head 1099511627776"), std::string::npos) << e.what();
  }
  // The sender checks the tail the reader publishes the same way.
  rings[0].tail.store(uint64_t{1} << 40);
  Transfer s2;
  s2.send = true;
  s2.data = out.data();
  s2.len = out.size();
  creator.begin(s2, op);
  try {
    creator.progress(s2, op);
    ADD_FAILURE() << "a corrupt ring tail was trusted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt ring tail"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rumor::net
