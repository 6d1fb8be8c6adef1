// Pins each thread of the OpenMP team (the pool torch's intra-op parallelism runs on) to
// one CPU: thread i of a team of n runs on cpus[i]. libgomp keeps the same pool threads in
// the same team positions for later parallel regions of the same size, so the pinning holds
// for every torch op and compiled kernel that runs with n threads. The calling thread is
// thread 0 of the team, so it is pinned to cpus[0].
//
// Returns how many threads could not be pinned (sched_setaffinity failed: a CPU outside the
// process's allowed set, or a system without the call).

#include <omp.h>
#include <sched.h>

extern "C" int tandem_omp_affinity_abi_version() { return 1; }

extern "C" int tandem_pin_omp_threads(const int* cpus, int n) {
  int failures = 0;
#pragma omp parallel num_threads(n) reduction(+ : failures)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[omp_get_thread_num()], &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) failures += 1;
  }
  return failures;
}

// The CPU each thread of a team of n runs on now (sched_getcpu), for checks and logs.
extern "C" void tandem_omp_thread_cpus(int* out, int n) {
#pragma omp parallel num_threads(n)
  out[omp_get_thread_num()] = sched_getcpu();
}
