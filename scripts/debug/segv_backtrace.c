// LD_PRELOAD helper for chasing a crash on a machine without gdb (the lent GPU machines): on
// SIGSEGV, writes the native backtrace and /proc/self/maps to /tmp/segv-<pid>.txt, for
// scripts/debug/segv_report.py to turn into function names. Python's faulthandler (which the
// test harness enables) dumps the Python stack first and then re-raises the signal, which lands
// here; si_addr is then the sender's pid, not the faulting address, and the registers are those
// of the re-raise: scripts/debug/peer_exit.py runs the case without faulthandler, so the first
// line's rip is the faulting instruction.
//   cc -shared -fPIC -O1 -o /tmp/segv.so scripts/debug/segv_backtrace.c
//   LD_PRELOAD=/tmp/segv.so python -m pytest ...; python scripts/debug/segv_report.py
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static void on_segv(int sig, siginfo_t* si, void* ctx) {
  const ucontext_t* uc = (const ucontext_t*)ctx;
  char path[64];
  snprintf(path, sizeof(path), "/tmp/segv-%d.txt", (int)getpid());
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    char line[256];
    int n = snprintf(line, sizeof(line),
                     "signal %d at address %p\nrip [%#llx] rsp %#llx rdi %#llx rsi %#llx rax %#llx\n", sig,
                     si ? si->si_addr : 0, uc ? (unsigned long long)uc->uc_mcontext.gregs[REG_RIP] : 0ULL,
                     uc ? (unsigned long long)uc->uc_mcontext.gregs[REG_RSP] : 0ULL,
                     uc ? (unsigned long long)uc->uc_mcontext.gregs[REG_RDI] : 0ULL,
                     uc ? (unsigned long long)uc->uc_mcontext.gregs[REG_RSI] : 0ULL,
                     uc ? (unsigned long long)uc->uc_mcontext.gregs[REG_RAX] : 0ULL);
    if (write(fd, line, n) < 0) _exit(139);
    void* frames[64];
    int k = backtrace(frames, 64);
    backtrace_symbols_fd(frames, k, fd);
    int maps = open("/proc/self/maps", O_RDONLY);
    if (maps >= 0) {
      char buf[4096];
      ssize_t r;
      if (write(fd, "--- maps\n", 9) < 0) _exit(139);
      while ((r = read(maps, buf, sizeof(buf))) > 0)
        if (write(fd, buf, (size_t)r) < 0) break;
      close(maps);
    }
    close(fd);
  }
  _exit(139);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, 0);
}
