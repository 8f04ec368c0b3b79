// The automatic fallback, for real: a forked child forbids io_uring_setup with a seccomp filter
// (as container runtimes do), then asks for an automatic engine and must get the threads engine,
// one warning, a counted fallback, and working I/O.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "io/aligned_buffer.h"
#include "io/engine.h"
#include "tests/io/io_test_util.h"

using namespace strata::io;

namespace {

#if defined(__x86_64__)
bool forbid_io_uring() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

// Runs in the child; the return value becomes its exit status (0 = pass).
int child_body(const std::string& dir) {
  if (!forbid_io_uring()) return 10;
  std::string why;
  if (uring_available(&why)) return 11;
  if (why.find("not permitted") == std::string::npos) return 12;
  const uint64_t before = fallback_count();  // inherited from the parent (0 where io_uring works)
  auto e = make_engine({});                  // automatic
  if (e->kind() != EngineKind::threads || fallback_count() != before + 1) return 13;
  auto e2 = make_engine({});  // warned once per process, counted every time
  if (fallback_count() != before + 2) return 14;
  EngineOptions want_uring;
  want_uring.kind = EngineKind::uring;
  try {
    make_engine(want_uring);
    return 15;  // an explicit uring request must fail loudly, not fall back
  } catch (const std::runtime_error&) {
  }
  std::string path = dir + "/f";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) return 16;
  FileId f = e->add_file(fd, path);
  AlignedBuffer a(256 << 10), b(256 << 10);
  strata::io::testing::fill_random(a.data(), a.size(), 3);
  e->write(f, 0, a.size(), a.data()).wait();
  e->read(f, 0, b.size(), b.data()).wait();
  if (std::memcmp(a.data(), b.data(), a.size()) != 0) return 17;
  e->remove_file(f);
  ::close(fd);
  return 0;
}
#endif

TEST(EngineFallback, SeccompForbiddenUringFallsBackToThreads) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "seccomp filter written for x86_64";
#else
  strata::io::testing::ScratchDir dir;
  pid_t pid = fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) _exit(child_body(dir.path()));
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died";
  if (WEXITSTATUS(status) == 10) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child failed at step " << WEXITSTATUS(status);
#endif
}

}  // namespace
