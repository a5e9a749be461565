// CPU runtime for Metal kernel bodies: a shim of the Metal standard library plus a
// scheduler that runs every GPU thread of a threadgroup as a fiber, with real barrier
// and SIMD-group semantics. Included first by every translation unit the simulator
// generates (see mlxkv/attention/simulator.py); kernels are compiled unmodified against it.
#pragma once
// A system header: the kernels it is included by are checked with -pedantic -Werror, the
// runtime itself (which uses newer C++ than Metal's dialect) is not.
#pragma GCC system_header

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

// ---- Metal scalar and vector types -------------------------------------------------
using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using half = _Float16;
using float16_t = _Float16;

struct uint3 {
  uint x, y, z;
};

#ifdef SIM_ADDRESS_SPACES
using bfloat16_t = __bf16;  // the type check wants a built-in arithmetic type, as Metal's is
#else
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // round to nearest even, as Metal converts
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) {
      bits = uint16_t((u >> 16) | 0x40);
    } else {
      bits = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
#endif

// Address spaces. For the type check (SIM_ADDRESS_SPACES, a clang -fsyntax-only pass) they
// are distinct pointer types, as in Metal: a `constant` pointer converts neither to a
// `device` one nor back, and threadgroup memory is its own space. `thread` is the default
// space of locals. For the run they mean nothing. `threadgroup` declarations are rewritten
// into the arena by the front end (see tg_alloc).
#ifdef SIM_ADDRESS_SPACES
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#endif
#define thread

// ---- cost counters ------------------------------------------------------------------
// Built with -DSIM_COUNT and clang's -fsanitize-coverage=trace-loads,trace-stores, every load
// and store the kernel makes reaches the hooks below; those on device buffers are counted.
// Without SIM_COUNT the counting calls compile to nothing.
namespace sim {
struct Counters {
  unsigned long long read_bytes, written_bytes;  // distinct device bytes per threadgroup, summed
  unsigned long long loads, load_bytes, vector_loads, vector_load_bytes, stores, store_bytes;
  unsigned long long reductions, shuffles, transcendentals, barriers, threadgroups;
  unsigned long long threadgroup_memory, threads;  // per threadgroup (the largest)
};
inline Counters g_counters{};
inline bool g_counting = false;  // only while kernel threads run
inline void note_access(const void* address, unsigned long bytes, bool store, bool vector);
inline void note_transcendental() {
#ifdef SIM_COUNT
  if (g_counting) g_counters.transcendentals++;
#endif
}
}  // namespace sim

// Metal's vec<T, N> (N = 2, 3, 4) and its named aliases. Copying one out of device memory is
// one vector load, as on the GPU; elements are read with [].
template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec {
  static_assert(N >= 2 && N <= 4, "Metal vectors have 2, 3 or 4 elements");
  T e[N];
  vec() = default;
  vec(T s) {
    for (int i = 0; i < N; i++) e[i] = s;
  }
  template <class... A, class = std::enable_if_t<sizeof...(A) == N && (N > 1)>>
  vec(A... a) : e{T(a)...} {}
  template <class U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; i++) e[i] = T(o.e[i]);
  }
  vec(const vec& o) { copy(&o); }
#ifdef SIM_ADDRESS_SPACES
  vec(const device vec& o) { copy((const vec*)&o); }
  vec(const constant vec& o) { copy((const vec*)&o); }
  vec(const threadgroup vec& o) { copy((const vec*)&o); }
#endif
  vec& operator=(const vec& o) = default;
  T& operator[](int i) { return e[i]; }
  const T& operator[](int i) const { return e[i]; }

 private:
  __attribute__((noinline, no_sanitize("coverage"))) void copy(const vec* o) {  // counted once: one vector load
    sim::note_access(o, sizeof(vec), false, true);
    std::memcpy(e, o->e, sizeof(e));
  }
};
#define SIM_VECTORS(T) using T##2 = vec<T, 2>; using T##3 = vec<T, 3>; using T##4 = vec<T, 4>;
SIM_VECTORS(float)
SIM_VECTORS(half)
SIM_VECTORS(int)
using uint2 = vec<uint, 2>;  // uint3 is the struct of thread ids above
using uint4 = vec<uint, 4>;
SIM_VECTORS(short)
SIM_VECTORS(ushort)
SIM_VECTORS(uchar)
#undef SIM_VECTORS

// as_type<T>(x): the bits of x read as a T of the same size.
template <class T, class U>
T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T out;
  std::memcpy(&out, &x, sizeof(T));
  return out;
}

namespace metal {
// Transcendental functions are counted (one per thread per call) when SIM_COUNT is set.
#define SIM_TRANSCENDENTAL(name) \
  inline float name(float x) { sim::note_transcendental(); return std::name(x); } \
  inline half name(half x) { sim::note_transcendental(); return half(std::name(float(x))); }
SIM_TRANSCENDENTAL(exp)
SIM_TRANSCENDENTAL(exp2)
SIM_TRANSCENDENTAL(log)
SIM_TRANSCENDENTAL(log2)
SIM_TRANSCENDENTAL(tanh)
#undef SIM_TRANSCENDENTAL
using std::fabs;
using std::sqrt;
template <class T>
T max(T a, T b) { return a > b ? a : b; }
template <class T>
T min(T a, T b) { return a < b ? a : b; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
// Metal documents fast:: functions for finite inputs only: here any other input gives NaN,
// the worst a GPU could return, so a kernel whose result depends on one fails its tests.
namespace fast {
#define SIM_FAST(name) \
  inline float name(float x) { return std::isfinite(x) ? metal::name(x) : NAN; } \
  inline half name(half x) { return half(name(float(x))); }
SIM_FAST(exp)
SIM_FAST(exp2)
SIM_FAST(log)
SIM_FAST(log2)
#undef SIM_FAST
using metal::max;
using metal::min;
}  // namespace fast
namespace precise { using metal::exp; using metal::exp2; using metal::log; using metal::log2; }
template <class T>
using numeric_limits = std::numeric_limits<T>;
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
}  // namespace metal
using namespace metal;

// ---- the scheduler -----------------------------------------------------------------
namespace sim {

constexpr int kSimdWidth = 32;
constexpr size_t kStack = 256 * 1024;

enum class Wait { Running, Barrier, Simd, Done };

struct Site {
  const char* file;
  int line;
  bool operator==(const Site& o) const { return line == o.line && std::strcmp(file, o.file) == 0; }
};

struct Fiber;
using Collective = void (*)(Fiber** lanes, int n);

struct Fiber {
  jmp_buf jb;
  ucontext_t start;
  char* stack = nullptr;
  Wait wait = Wait::Running;
  Site site{"", 0};
  Collective op = nullptr;
  alignas(16) unsigned char in[16];
  alignas(16) unsigned char out[16];
  int arg = 0;
  int kind = 0;    // of the collective it waits at: 0 reduction, 1 shuffle, 2 SIMD-group barrier
  uint index = 0;  // linear index in the threadgroup
  uint3 tid{};     // thread_position_in_threadgroup
};

struct TgArray {
  const char* name;
  size_t bytes;
};

struct State {
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  jmp_buf scheduler;
  uint3 group{};
  std::vector<unsigned char> arena;
  std::vector<long> array_offsets;  // each threadgroup array's offset in the arena, -1 until declared
  std::vector<TgArray> arrays;  // this threadgroup's arrays, in declaration order
  size_t arena_used = 0;
};

inline State& state() {
  static State s;
  return s;
}

[[noreturn]] inline void fail(const std::string& msg) {
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  _exit(3);
}

inline std::string where(const Site& s) { return std::string(s.file) + " line " + std::to_string(s.line); }

inline std::string thread_name(const Fiber& f) {
  const auto& g = state().group;
  return "thread (" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) + "," + std::to_string(f.tid.z) +
         ") of threadgroup (" + std::to_string(g.x) + "," + std::to_string(g.y) + "," + std::to_string(g.z) + ")";
}

// Give control back to the scheduler until this thread's wait is resolved.
inline void yield(Wait wait, Site site) {
  Fiber* f = state().current;
  f->wait = wait;
  f->site = site;
  if (!_setjmp(f->jb)) _longjmp(state().scheduler, 1);
}

inline void barrier(const char* file, int line) { yield(Wait::Barrier, Site{file, line}); }

template <class T>
T collective(T value, int arg, Collective op, int kind, const char* file, int line) {
  Fiber* f = state().current;
  static_assert(sizeof(T) <= 16, "SIMD values up to 16 bytes");
  std::memcpy(f->in, &value, sizeof(T));
  f->arg = arg;
  f->op = op;
  f->kind = kind;
  yield(Wait::Simd, Site{file, line});
  T out;
  std::memcpy(&out, state().current->out, sizeof(T));
  return out;
}

template <class T>
T lane_value(const Fiber* f) {
  T v;
  std::memcpy(&v, f->in, sizeof(T));
  return v;
}

template <class T>
void put(Fiber* f, T v) { std::memcpy(f->out, &v, sizeof(T)); }

template <class T>
void reduce_sum(Fiber** lanes, int n) {
  T acc = lane_value<T>(lanes[0]);
  for (int i = 1; i < n; i++) acc = T(acc + lane_value<T>(lanes[i]));
  for (int i = 0; i < n; i++) put(lanes[i], acc);
}
template <class T>
void reduce_max(Fiber** lanes, int n) {
  T acc = lane_value<T>(lanes[0]);
  for (int i = 1; i < n; i++) acc = metal::max<T>(acc, lane_value<T>(lanes[i]));
  for (int i = 0; i < n; i++) put(lanes[i], acc);
}
template <class T>
void reduce_min(Fiber** lanes, int n) {
  T acc = lane_value<T>(lanes[0]);
  for (int i = 1; i < n; i++) acc = metal::min<T>(acc, lane_value<T>(lanes[i]));
  for (int i = 0; i < n; i++) put(lanes[i], acc);
}
// Lane i gets the value of lane `source(i)`; a lane outside the group keeps its own.
template <class T, int Kind>
void exchange(Fiber** lanes, int n) {
  T values[kSimdWidth];
  bool present[kSimdWidth] = {};
  for (int i = 0; i < n; i++) {
    int lane = lanes[i]->index % kSimdWidth;
    values[lane] = lane_value<T>(lanes[i]);
    present[lane] = true;
  }
  for (int i = 0; i < n; i++) {
    int lane = lanes[i]->index % kSimdWidth, arg = lanes[i]->arg;
    int src = Kind == 0 ? arg : Kind == 1 ? lane + arg : Kind == 2 ? lane - arg : lane ^ arg;
    put(lanes[i], src >= 0 && src < kSimdWidth && present[src] ? values[src] : values[lane]);
  }
}

// Threadgroup memory: one arena per threadgroup of the 32 KiB an Apple GPU gives a
// threadgroup, filled with 0xff bytes (NaN) so that a read before any write shows up.
constexpr size_t kThreadgroupMemory = 32 * 1024;

[[noreturn]] inline void too_much_threadgroup_memory(size_t total) {
  std::string list;
  for (const TgArray& a : state().arrays) {
    list += std::string(list.empty() ? "" : ", ") + a.name + " (" + std::to_string(a.bytes) + " B)";
  }
  fail("launch refused: the kernel declares " + std::to_string(total) + " bytes of threadgroup memory, more than the " +
       std::to_string(kThreadgroupMemory) + " an Apple GPU allows a threadgroup: " + list);
}

template <class A>
A& tg_alloc(int index, const char* name) {
  State& s = state();
  if (index >= int(s.array_offsets.size())) s.array_offsets.resize(index + 1, -1);
  if (s.array_offsets[index] < 0) {
    size_t offset = (s.arena_used + alignof(A) - 1) / alignof(A) * alignof(A);
    s.arrays.push_back({name, sizeof(A)});
    if (offset + sizeof(A) > s.arena.size()) too_much_threadgroup_memory(offset + sizeof(A));
    s.array_offsets[index] = long(offset);
    s.arena_used = offset + sizeof(A);
  }
  return *(A*)(s.arena.data() + s.array_offsets[index]);
}

// ---- buffers between guard pages -----------------------------------------------------
struct Buffer {
  std::string name;
  unsigned char* data = nullptr;  // the end of the data touches a guard page
  size_t bytes = 0;
  unsigned char* guard_before = nullptr;
  unsigned char* guard_after = nullptr;
  size_t item = 1;
};

inline std::vector<Buffer>& buffers() {
  static std::vector<Buffer> b;
  return b;
}

inline Buffer& make_buffer(const std::string& name, size_t bytes, size_t item) {
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t data_pages = (bytes + page - 1) / page + 1;
  size_t total = (data_pages + 2) * page;
  auto* base = static_cast<unsigned char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  Buffer b;
  b.name = name;
  b.bytes = bytes;
  b.item = item;
  b.guard_before = base;
  b.guard_after = base + (data_pages + 1) * page;
  b.data = b.guard_after - bytes;
  mprotect(b.guard_before, page, PROT_NONE);
  mprotect(b.guard_after, page, PROT_NONE);
  buffers().push_back(b);
  return buffers().back();
}

inline void on_segv(int, siginfo_t* info, void*) {
  auto* addr = static_cast<unsigned char*>(info->si_addr);
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::string who = state().current ? thread_name(*state().current) : "the runtime";
  for (const Buffer& b : buffers()) {
    if (addr >= b.guard_after && addr < b.guard_after + page) {
      long element = long((addr - b.data) / long(b.item));
      fail("out-of-bounds access to buffer '" + b.name + "': element " + std::to_string(element) +
           " of " + std::to_string(b.bytes / b.item) + ", by " + who);
    }
    if (addr >= b.guard_before && addr < b.guard_before + page) {
      long element = -long((b.data - addr + long(b.item) - 1) / long(b.item));
      fail("out-of-bounds access to buffer '" + b.name + "': element " + std::to_string(element) +
           " (before its start), by " + who);
    }
  }
  fail("segmentation fault outside every buffer, by " + who);
}

inline void install_handlers() {
  static char altstack[1 << 16];
  stack_t ss{};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof(altstack);
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

// ---- counting device accesses (SIM_COUNT) ---------------------------------------------------
// A byte counts once per threadgroup however often it is read: the model of a core's cache
// that serves repeated reads of one threadgroup, and of nothing across threadgroups.
struct Region {
  const unsigned char* begin;
  const unsigned char* end;
  unsigned* read_stamp;   // the threadgroup that last read each byte
  unsigned* write_stamp;
};
inline Region g_regions[64];
inline int g_region_count = 0;
inline unsigned g_epoch = 0;

inline void count_buffer(const Buffer& b) {
  if (g_region_count == 64) fail("too many buffers to count");
  g_regions[g_region_count++] = {b.data, b.data + b.bytes, static_cast<unsigned*>(std::calloc(b.bytes + 1, 4)),
                                 static_cast<unsigned*>(std::calloc(b.bytes + 1, 4))};
}

#ifdef SIM_COUNT
__attribute__((no_sanitize("coverage"))) inline void note_access(const void* address, unsigned long bytes, bool store,
                                                                 bool vector) {
  if (!g_counting) return;
  const unsigned char* a = static_cast<const unsigned char*>(address);
  for (int r = 0; r < g_region_count; r++) {
    Region& region = g_regions[r];
    if (a < region.begin || a >= region.end) continue;
    unsigned* stamp = store ? region.write_stamp : region.read_stamp;
    unsigned long long fresh = 0;
    for (unsigned long i = 0, o = a - region.begin; i < bytes; i++, o++) {
      if (stamp[o] != g_epoch) {
        stamp[o] = g_epoch;
        fresh++;
      }
    }
    if (store) {
      g_counters.stores++;
      g_counters.store_bytes += bytes;
      g_counters.written_bytes += fresh;
    } else {
      g_counters.loads++;
      g_counters.load_bytes += bytes;
      g_counters.vector_loads += vector;
      g_counters.vector_load_bytes += vector ? bytes : 0;
      g_counters.read_bytes += fresh;
    }
    return;
  }
}
}  // namespace sim
#define SIM_HOOKS(n, T)                                                                            \
  extern "C" __attribute__((no_sanitize("coverage"))) void __sanitizer_cov_load##n(T* a) {          \
    sim::note_access(a, n, false, false);                                                          \
  }                                                                                                \
  extern "C" __attribute__((no_sanitize("coverage"))) void __sanitizer_cov_store##n(T* a) {         \
    sim::note_access(a, n, true, false);                                                           \
  }
SIM_HOOKS(1, uint8_t)
SIM_HOOKS(2, uint16_t)
SIM_HOOKS(4, uint32_t)
SIM_HOOKS(8, uint64_t)
SIM_HOOKS(16, __int128)
#undef SIM_HOOKS
namespace sim {
#else
inline void note_access(const void*, unsigned long, bool, bool) {}
#endif

inline void write_counters(const char* path) {
  FILE* f = std::fopen(path, "w");
  if (!f) fail(std::string("cannot write ") + path);
  const Counters& c = g_counters;
  std::fprintf(f, "read_bytes %llu\nwritten_bytes %llu\nloads %llu\nload_bytes %llu\nvector_loads %llu\n"
               "vector_load_bytes %llu\nstores %llu\nstore_bytes %llu\nreductions %llu\nshuffles %llu\n"
               "transcendentals %llu\nbarriers %llu\nthreadgroups %llu\nthreadgroup_memory %llu\nthreads %llu\n",
               c.read_bytes, c.written_bytes, c.loads, c.load_bytes, c.vector_loads, c.vector_load_bytes, c.stores,
               c.store_bytes, c.reductions, c.shuffles, c.transcendentals, c.barriers, c.threadgroups,
               c.threadgroup_memory, c.threads);
  std::fclose(f);
}

// ---- running a grid --------------------------------------------------------------------
struct ThreadIds {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup;
};

using Body = void (*)(const ThreadIds&);
inline Body g_body = nullptr;
inline uint3 g_grid{}, g_tg{};

inline void fiber_main() {
  State& s = state();
  Fiber* f = s.current;
  ThreadIds t{};
  t.thread_position_in_threadgroup = f->tid;
  t.threadgroup_position_in_grid = s.group;
  t.threads_per_threadgroup = g_tg;
  t.threadgroups_per_grid = {(g_grid.x + g_tg.x - 1) / g_tg.x, (g_grid.y + g_tg.y - 1) / g_tg.y,
                             (g_grid.z + g_tg.z - 1) / g_tg.z};
  t.threads_per_grid = g_grid;
  t.thread_position_in_grid = {s.group.x * g_tg.x + f->tid.x, s.group.y * g_tg.y + f->tid.y,
                               s.group.z * g_tg.z + f->tid.z};
  t.thread_index_in_threadgroup = f->index;
  t.simdgroup_index_in_threadgroup = f->index / kSimdWidth;
  t.thread_index_in_simdgroup = f->index % kSimdWidth;
  t.simdgroups_per_threadgroup = (g_tg.x * g_tg.y * g_tg.z + kSimdWidth - 1) / kSimdWidth;
  t.threads_per_simdgroup = kSimdWidth;
  g_body(t);
  s.current->wait = Wait::Done;
  _longjmp(s.scheduler, 1);
}

inline void resume(Fiber& f, bool first) {
  State& s = state();
  s.current = &f;
  f.wait = Wait::Running;
  if (!_setjmp(s.scheduler)) {
    if (first) {
      setcontext(&f.start);
    } else {
      _longjmp(f.jb, 1);
    }
  }
  s.current = nullptr;
}

// Resolve SIMD collectives group by group; true if any thread can run again.
inline bool resolve_simd(std::vector<Fiber>& fibers) {
  bool progressed = false;
  for (size_t base = 0; base < fibers.size(); base += kSimdWidth) {
    Fiber* lanes[kSimdWidth];
    int n = 0, live = 0;
    size_t end = std::min(fibers.size(), base + kSimdWidth);
    for (size_t i = base; i < end; i++) {
      if (fibers[i].wait == Wait::Done) continue;
      live++;
      if (fibers[i].wait == Wait::Simd) lanes[n++] = &fibers[i];
    }
    if (n == 0) continue;
    for (int i = 1; i < n; i++) {
      if (!(lanes[i]->site == lanes[0]->site)) {
        fail("SIMD-group operation in divergent control flow: " + thread_name(*lanes[0]) + " is at " +
             where(lanes[0]->site) + " but " + thread_name(*lanes[i]) + " is at " + where(lanes[i]->site));
      }
    }
    if (n != live) continue;  // the other lanes have not arrived yet
    lanes[0]->op(lanes, n);
    if (g_counting) {
      if (lanes[0]->kind == 0) g_counters.reductions++;
      if (lanes[0]->kind == 1) g_counters.shuffles++;
    }
    for (int i = 0; i < n; i++) lanes[i]->wait = Wait::Running;
    progressed = true;
  }
  return progressed;
}

inline void run_threadgroup(uint3 group, bool reverse) {
  State& s = state();
  s.group = group;
  std::fill(s.arena.begin(), s.arena.end(), 0xff);
  s.array_offsets.assign(s.array_offsets.size(), -1);
  s.arrays.clear();
  s.arena_used = 0;
  g_epoch++;
  g_counters.threadgroups++;
  uint count = 0;
  for (uint z = 0; z < g_tg.z; z++)
    for (uint y = 0; y < g_tg.y; y++)
      for (uint x = 0; x < g_tg.x; x++) {
        Fiber& f = s.fibers[count];
        f.index = count++;
        f.tid = {x, y, z};
        f.wait = Wait::Running;
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = f.stack;
        f.start.uc_stack.ss_size = kStack;
        f.start.uc_link = nullptr;
        makecontext(&f.start, fiber_main, 0);
      }
  std::vector<bool> started(count, false);
  while (true) {
    bool ran = false;
    for (uint k = 0; k < count; k++) {
      Fiber& f = s.fibers[reverse ? count - 1 - k : k];
      if (f.wait != Wait::Running) continue;
      resume(f, !started[f.index]);
      started[f.index] = true;
      ran = true;
    }
    if (ran) continue;
    if (resolve_simd(s.fibers)) continue;
    std::vector<Fiber*> at_barrier, done;
    for (uint k = 0; k < count; k++) {
      Fiber& f = s.fibers[k];
      if (f.wait == Wait::Barrier) at_barrier.push_back(&f);
      if (f.wait == Wait::Done) done.push_back(&f);
    }
    if (done.size() == count) {
      g_counters.threadgroup_memory = std::max<unsigned long long>(g_counters.threadgroup_memory, s.arena_used);
      return;
    }
    if (!at_barrier.empty() && at_barrier.size() + done.size() == count && done.empty()) {
      for (Fiber* f : at_barrier) {
        if (!(f->site == at_barrier[0]->site)) {
          fail("threadgroup barriers at different places: " + thread_name(*at_barrier[0]) + " waits at " +
               where(at_barrier[0]->site) + ", " + thread_name(*f) + " at " + where(f->site));
        }
      }
      for (Fiber* f : at_barrier) f->wait = Wait::Running;
      if (g_counting) g_counters.barriers++;
      continue;
    }
    if (!at_barrier.empty() && !done.empty()) {
      fail("barrier at " + where(at_barrier[0]->site) + " reached by " + std::to_string(at_barrier.size()) +
           " of " + std::to_string(count) + " threads (" + thread_name(*at_barrier[0]) + " waits; " +
           thread_name(*done[0]) + " has returned): a barrier inside divergent control flow");
    }
    for (uint k = 0; k < count; k++) {
      Fiber& f = s.fibers[k];
      if (f.wait == Wait::Simd) {
        fail("deadlock: " + thread_name(f) + " waits at a SIMD-group operation at " + where(f.site) +
             " that the rest of its SIMD group never reaches");
      }
    }
    fail("deadlock in threadgroup");
  }
}

inline void run_grid(uint3 grid, uint3 tg, Body body, bool reverse) {
  State& s = state();
  g_body = body;
  g_grid = grid;
  g_tg = tg;
  uint threads = tg.x * tg.y * tg.z;
  s.fibers.assign(threads, Fiber{});
  for (auto& f : s.fibers) f.stack = static_cast<char*>(std::malloc(kStack));
  s.arena.assign(kThreadgroupMemory, 0xff);
  uint3 groups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  std::vector<uint3> order;
  for (uint z = 0; z < groups.z; z++)
    for (uint y = 0; y < groups.y; y++)
      for (uint x = 0; x < groups.x; x++) order.push_back({x, y, z});
  if (reverse) std::reverse(order.begin(), order.end());
  g_counters.threads = threads;
  g_counting = true;
  for (const uint3& g : order) run_threadgroup(g, reverse);
  g_counting = false;
}

}  // namespace sim

// ---- Metal synchronisation and SIMD functions, routed through the scheduler -----------------
namespace sim {
// The value type of an expression, without reference, const or address space: what a SIMD
// function exchanges.
template <class T>
struct strip_space { using type = T; };
#ifdef SIM_ADDRESS_SPACES
template <class T>
struct strip_space<device T> { using type = T; };
template <class T>
struct strip_space<constant T> { using type = T; };
template <class T>
struct strip_space<threadgroup T> { using type = T; };
#endif
template <class T>
using value_t = typename strip_space<std::remove_cv_t<std::remove_reference_t<T>>>::type;
}  // namespace sim

#define threadgroup_barrier(...) sim::barrier(__FILE__, __LINE__)
#define simdgroup_barrier(...) sim::collective<int>(0, 0, sim::reduce_sum<int>, 2, __FILE__, __LINE__)
#define simd_sum(v) sim::collective<sim::value_t<decltype(v)>>((v), 0, sim::reduce_sum<sim::value_t<decltype(v)>>, 0, __FILE__, __LINE__)
#define simd_max(v) sim::collective<sim::value_t<decltype(v)>>((v), 0, sim::reduce_max<sim::value_t<decltype(v)>>, 0, __FILE__, __LINE__)
#define simd_min(v) sim::collective<sim::value_t<decltype(v)>>((v), 0, sim::reduce_min<sim::value_t<decltype(v)>>, 0, __FILE__, __LINE__)
#define simd_broadcast(v, l) sim::collective<sim::value_t<decltype(v)>>((v), int(l), sim::exchange<sim::value_t<decltype(v)>, 0>, 1, __FILE__, __LINE__)
#define simd_shuffle(v, l) sim::collective<sim::value_t<decltype(v)>>((v), int(l), sim::exchange<sim::value_t<decltype(v)>, 0>, 1, __FILE__, __LINE__)
#define simd_shuffle_down(v, d) sim::collective<sim::value_t<decltype(v)>>((v), int(d), sim::exchange<sim::value_t<decltype(v)>, 1>, 1, __FILE__, __LINE__)
#define simd_shuffle_up(v, d) sim::collective<sim::value_t<decltype(v)>>((v), int(d), sim::exchange<sim::value_t<decltype(v)>, 2>, 1, __FILE__, __LINE__)
#define simd_shuffle_xor(v, m) sim::collective<sim::value_t<decltype(v)>>((v), int(m), sim::exchange<sim::value_t<decltype(v)>, 3>, 1, __FILE__, __LINE__)

// ---- the launcher's entry point ------------------------------------------------------------
// The manifest: `grid X Y Z`, `threadgroup X Y Z`, `reverse 0|1`, then one
// `buffer NAME BYTES ITEMSIZE IS_OUTPUT PATH` line per buffer parameter, in signature order.
namespace sim {

inline std::vector<unsigned char> read_file(const std::string& path, size_t bytes) {
  std::vector<unsigned char> data(bytes);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(data.data(), 1, bytes, f) != bytes) fail("cannot read " + path);
  std::fclose(f);
  return data;
}

inline int launch(int argc, char** argv, void** buffer_data, Body body) {
  if (argc != 2 && argc != 3) fail("usage: kernel MANIFEST [COUNTERS]");
  FILE* manifest = std::fopen(argv[1], "r");
  if (!manifest) fail(std::string("cannot open ") + argv[1]);
  uint3 grid{}, tg{};
  int reverse = 0;
  if (std::fscanf(manifest, " grid %u %u %u threadgroup %u %u %u reverse %d", &grid.x, &grid.y, &grid.z, &tg.x,
                  &tg.y, &tg.z, &reverse) != 7) {
    fail("malformed manifest");
  }
  struct Out { Buffer* buffer; std::string path; };
  std::vector<Out> outputs;
  char name[256], path[4096];
  size_t bytes, item;
  int is_output;
  buffers().reserve(64);
  for (int i = 0; std::fscanf(manifest, " buffer %255s %zu %zu %d %4095s", name, &bytes, &item, &is_output, path) == 5; i++) {
    Buffer& b = make_buffer(name, bytes, item);
    auto data = read_file(path, bytes);
    std::memcpy(b.data, data.data(), bytes);
    buffer_data[i] = b.data;
    if (argc == 3) count_buffer(b);
    if (is_output) outputs.push_back({&b, path});
  }
  std::fclose(manifest);
  if (tg.x * tg.y * tg.z == 0 || tg.x * tg.y * tg.z > 1024) fail("threadgroup size must be 1..1024 threads");
  install_handlers();
  run_grid(grid, tg, body, reverse != 0);
  if (argc == 3) write_counters(argv[2]);
  for (const Out& o : outputs) {
    FILE* f = std::fopen(o.path.c_str(), "wb");
    std::fwrite(o.buffer->data, 1, o.buffer->bytes, f);
    std::fclose(f);
  }
  return 0;
}

}  // namespace sim
