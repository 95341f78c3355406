// Placing the calling thread's OpenMP team on CPUs of its own (issue 37, item 3), registered by
// addon.cc's Init. A device that is a worker thread shares its process, and so the environment
// that OMP_PLACES / OMP_PROC_BIND would bind teams through, with every other device: each of its
// team members binds itself with sched_setaffinity instead (Linux; elsewhere both functions do
// nothing and return []).
//
//   pinTeam(cpus: number[]) -> number[][]: member i of this thread's team (threads() members,
//     this thread member 0) runs on cpus[i % cpus.length] from now on; returns each member's
//     CPUs as sched_getaffinity reads them back. RangeError for an empty list, a CPU that is not
//     an integer in [0, CPU_SETSIZE), or one the process may not run on.
//   teamAffinity() -> number[][]: each member's CPUs (sched_getaffinity), member 0 first.
//
// libgomp gives member i the same pool thread in every region the calling thread starts (with
// the same team size), so a member bound here stays bound in the kernels that follow.
#include <napi.h>
#include <omp.h>

#include <string>
#include <vector>

#ifdef __linux__
#include <sched.h>

#include <cerrno>
#include <cstring>
#endif

namespace layerwise {

namespace {

#ifdef __linux__
std::vector<int> cpusOf(const cpu_set_t& set) {
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

// the CPUs the process may run on: the affinity of the first thread that loaded the addon (the
// main thread, before any team was pinned: taskset, cgroup cpusets and containers set it)
const cpu_set_t& processCpus() {
  static const cpu_set_t set = [] {
    cpu_set_t s;
    CPU_ZERO(&s);
    if (sched_getaffinity(0, sizeof s, &s) != 0)
      for (int c = 0; c < CPU_SETSIZE; c++) CPU_SET(c, &s);
    return s;
  }();
  return set;
}

// "0-3,8": a CPU list as Linux writes it, for messages
std::string listOf(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size(); i++) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) j++;
    if (!s.empty()) s += ",";
    s += std::to_string(cpus[i]);
    if (j > i) s += "-" + std::to_string(cpus[j]);
    i = j;
  }
  return s;
}
#endif

// each member's CPUs, read in one region of the team
std::vector<std::vector<int>> readTeam() {
  std::vector<std::vector<int>> out(static_cast<size_t>(omp_get_max_threads()));
#ifdef __linux__
#pragma omp parallel
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) out[static_cast<size_t>(omp_get_thread_num())] = cpusOf(set);
  }
#endif
  return out;
}

Napi::Value ToJs(Napi::Env env, const std::vector<std::vector<int>>& team) {
  Napi::Array a = Napi::Array::New(env, team.size());
  for (uint32_t i = 0; i < team.size(); i++) {
    Napi::Array m = Napi::Array::New(env, team[i].size());
    for (uint32_t j = 0; j < team[i].size(); j++) m.Set(j, team[i][j]);
    a.Set(i, m);
  }
  return a;
}

// the CPU numbers of argument 0, checked against what the process may run on (processCpus);
// throws RangeError naming the CPU
std::vector<int> RequestedCpus(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() != 1 || !info[0].IsArray()) throw Napi::TypeError::New(env, "pinTeam takes one array of CPU numbers");
  Napi::Array a = info[0].As<Napi::Array>();
  if (a.Length() == 0) throw Napi::RangeError::New(env, "pinTeam needs at least one CPU");
  std::vector<int> cpus;
  for (uint32_t i = 0; i < a.Length(); i++) {
    const Napi::Value v = a.Get(i);
    const double c = v.IsNumber() ? v.As<Napi::Number>().DoubleValue() : -1;
#ifdef __linux__
    const double top = CPU_SETSIZE;
#else
    const double top = 1 << 20;
#endif
    if (!(c >= 0 && c < top && c == static_cast<double>(static_cast<int>(c))))
      throw Napi::RangeError::New(env, "pinTeam: CPU " + v.ToString().Utf8Value() + " is not an integer from 0 to " + std::to_string(static_cast<int>(top) - 1));
    cpus.push_back(static_cast<int>(c));
  }
#ifdef __linux__
  const cpu_set_t& allowed = processCpus();
  for (int c : cpus)
    if (!CPU_ISSET(c, &allowed))
      throw Napi::RangeError::New(env, "pinTeam: CPU " + std::to_string(c) + " is not one this process may run on (" + listOf(cpusOf(allowed)) +
                                           "; taskset, a cgroup cpuset or the container limit it): pin to CPUs of Cpus_allowed_list in /proc/self/status");
#endif
  return cpus;
}

Napi::Value PinTeam(const Napi::CallbackInfo& info) {
  const std::vector<int> cpus = RequestedCpus(info);
#ifdef __linux__
  std::vector<int> failed(static_cast<size_t>(omp_get_max_threads()), 0);
#pragma omp parallel
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[static_cast<size_t>(i) % cpus.size()], &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) failed[static_cast<size_t>(i)] = errno;
  }
  for (size_t i = 0; i < failed.size(); i++)
    if (failed[i] != 0)
      throw Napi::Error::New(info.Env(), "pinTeam: sched_setaffinity of team member " + std::to_string(i) + " to CPU " +
                                             std::to_string(cpus[i % cpus.size()]) + " failed: " + std::strerror(failed[i]));
  return ToJs(info.Env(), readTeam());
#else
  return Napi::Array::New(info.Env(), 0);
#endif
}

Napi::Value TeamAffinity(const Napi::CallbackInfo& info) {
#ifdef __linux__
  return ToJs(info.Env(), readTeam());
#else
  return Napi::Array::New(info.Env(), 0);
#endif
}

}  // namespace

void registerAffinity(Napi::Env env, Napi::Object exports) {
#ifdef __linux__
  (void)processCpus();  // read before this or any later thread pins its team
#endif
  exports.Set("pinTeam", Napi::Function::New(env, PinTeam));
  exports.Set("teamAffinity", Napi::Function::New(env, TeamAffinity));
}

}  // namespace layerwise
