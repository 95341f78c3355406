// Asynchronous signals are held off while oneDNN's JIT GEMM kernels run. Those kernels (in the
// oneDNN 2.x that Debian ships, up to 3.11.1) point rsp at a heap workspace: a signal delivered
// meanwhile pushes its frame onto the heap and corrupts it ("corrupted size vs. prev_size",
// "free(): invalid pointer" later). Reproduced here with dnnl_sgemm and a SIGPROF timer alone,
// and in Node with `--cpu-prof`, whose sampler signals the JS thread; a terminal resize
// (SIGWINCH) or a child's exit (SIGCHLD) reaches some thread of the process likewise.
// oneDNN issue uxlfoundation/oneDNN#4845, fixed by PR #4855 (oneDNN 3.11.2).
#pragma once
#include <pthread.h>
#include <signal.h>

namespace layerwise {

// Every signal except those a fault raises synchronously in the faulting thread.
inline sigset_t asyncSignals() {
  sigset_t s;
  sigfillset(&s);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS}) sigdelset(&s, sig);
  return s;
}

// Blocks asynchronous signals in this thread for its lifetime; they arrive when it ends.
class SignalGuard {
 public:
  SignalGuard() {
    const sigset_t s = asyncSignals();
    pthread_sigmask(SIG_BLOCK, &s, &old_);
  }
  ~SignalGuard() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  sigset_t old_;
};

// For OpenMP worker threads (never the thread that called into the addon): they only run
// kernels, so they block asynchronous signals for good; the process's signals go to the JS threads.
inline void blockAsyncSignalsForever() {
  const sigset_t s = asyncSignals();
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
}

}  // namespace layerwise
