// cuflash CUDA simulator: the C++ runtime that lets kernels_cu/ sources run on the CPU.
//
// The launcher (launcher.py) compiles one module per kernel source with g++, force-including this
// header (-include cusim.h) and defining __CUDA_ARCH__ as the emulated device's. Execution model:
//
// * Every CUDA thread of a block is a fiber (its own stack, cooperative switches). x86-64 uses
//   the assembly switch of cusim_switch_x86_64.S; other CPUs (or CUSIM_FIBERS_UCONTEXT) use
//   ucontext. A fiber runs until it reaches a barrier or a warp collective, then yields to the
//   block's scheduler. Within a barrier phase the fibers run in a seeded random order (reshuffled
//   at every __syncthreads), so a missing barrier produces a wrong result deterministically.
// * Blocks are independent: OS worker threads take block indices from an atomic counter, and a
//   block runs entirely on one worker, so fibers never migrate between OS threads.
// * Shared memory is a per-block arena: the launcher's lowering pass turns each `__shared__`
//   declaration into a reference into the arena (static ones: one slot per declaration site,
//   allocated at first execution; `extern __shared__`: the dynamic area at the arena's start).
//   The arena is filled with 0xFF bytes (NaN for every float type) before each block, never
//   zeroed, and the top of each fiber stack is poisoned the same way, so reads of unwritten
//   memory show. Stacks are generous and sit above a PROT_NONE guard page.
// * Warp collectives (__shfl*_sync, __ballot_sync, __any/__all_sync, __syncwarp and the PTX
//   emulations of ptx.cuh) deposit each lane's operands in a per-warp slot array, wait until every
//   lane of the mask (that has not exited) arrived, and let the last arriving lane compute the
//   result for the whole warp once. Lanes meeting at different collectives with the same mask,
//   a lane outside its own mask, and deadlocks are reported as launch errors.
// * Errors inside a kernel (cusim::fail, __trap) stop the launch; the message, with the block and
//   thread, is returned to Python, which raises.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <sys/mman.h>
#ifdef CUSIM_GPU_NUMERICS
#include <xmmintrin.h>
#endif
#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(CUSIM_FIBERS_UCONTEXT)
#define CUSIM_FIBERS_UCONTEXT 1
#endif
#ifdef CUSIM_FIBERS_UCONTEXT
#include <ucontext.h>
#endif

#define CUFLASH_SIM 1

// The runtime's own functions are not instrumented (checked mode's thread-sanitizer hooks, the
// alignment check of every mode): what they touch is the simulator's state, not the kernel's.
// Accesses they make on the kernel's behalf are checked explicitly (check_access).
#define CUSIM_NOSAN __attribute__((no_sanitize_thread, no_sanitize("alignment")))

// ------------------------------------------------------------------ CUDA keywords
// The kernel's own functions go to one section, so checked mode's hooks can tell an access of
// kernel code (held to arguments, shared memory, its stack and the module's image) from one of
// the C++ library's inline code that the runtime uses (its own state). `__device__` variables
// are not supported (none of kernels_cu/ has one).
#if defined(CUSIM_CHECKED) || defined(CUSIM_POLL_HOOKS)
#define CUSIM_KERNEL_CODE __attribute__((section("cusim_kernel_text")))
#else
#define CUSIM_KERNEL_CODE
#endif
#define __global__ CUSIM_KERNEL_CODE
#define __device__ CUSIM_KERNEL_CODE
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define __managed__
#define __grid_constant__
// `__shared__` declarations are rewritten by the launcher before compilation; one that escaped
// the rewrite is a compile error naming the problem.
#define __shared__ CUSIM_ERROR_unlowered_shared_declaration

#include "cusim_half.h"

// ------------------------------------------------------------------ vector types
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3() = default;
    dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
#define CUSIM_VEC2(N, T, A) struct __align__(A) N { T x, y; }; inline N make_##N(T x, T y) { return {x, y}; }
#define CUSIM_VEC4(N, T, A) struct __align__(A) N { T x, y, z, w; }; \
    inline N make_##N(T x, T y, T z, T w) { return {x, y, z, w}; }
CUSIM_VEC2(int2, int, 8)
CUSIM_VEC2(uint2, unsigned, 8)
CUSIM_VEC2(float2, float, 8)
CUSIM_VEC2(double2, double, 16)
CUSIM_VEC2(longlong2, long long, 16)
CUSIM_VEC4(int4, int, 16)
CUSIM_VEC4(uint4, unsigned, 16)
CUSIM_VEC4(float4, float, 16)
#undef CUSIM_VEC2
#undef CUSIM_VEC4
struct int3 { int x, y, z; };
struct float3 { float x, y, z; };
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
inline int3 make_int3(int x, int y, int z) { return {x, y, z}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }

extern "C" void cusim_switch(void** save_sp, void* new_sp);

namespace cusim {

// ------------------------------------------------------------------ launch interface (C layout; mirrored by ctypes)
// Checked mode (CUSIM_CHECKED, see "checked mode" below): one registered global-memory region per
// pointer argument, and the structured report of the first fault.
struct Region {
    uint64_t start, size;   // registered bytes (the argument's copy plus slack on both sides)
    const uint8_t* valid;   // per byte of [start, start + size): 1 inside the argument's view
    uint32_t writable;      // the plan says the kernel writes through this argument
    uint32_t index;         // argument index in the plan
};

struct CheckReport {
    uint32_t kind;           // CheckKind
    uint32_t region;         // global faults: index into the region table
    int64_t offset;          // byte offset of the access from the region start / the shared variable
    uint32_t size, is_write;
    uint32_t block[3], thread[3];
    uint32_t other_thread[3], other_write;   // races: the earlier conflicting access
    uint32_t elem_size, rank;                // shared variable: element size, rank, extents
    uint64_t dims[4];
    char name[64];                           // shared variable name
    uint32_t other_block[3], other_valid;    // global races: the other access's block (valid: 1)
    uint64_t address;                        // wild and misaligned accesses: the address
    uint32_t align, pad;                     // misaligned accesses: the alignment the type needs
};

struct LaunchConfig {
    uint32_t grid[3];
    uint32_t block[3];
    uint64_t dynamic_smem;        // bytes of extern __shared__
    uint64_t smem_limit;          // static + dynamic bytes allowed for this launch
    uint64_t static_smem_limit;   // static bytes allowed (48 KB on every arch)
    uint32_t max_threads;         // threads per block allowed
    uint32_t workers;             // OS threads
    uint64_t seed;                // fiber order seed
    uint64_t stack_size;          // bytes per fiber stack (guard page not included)
    uint64_t stack_poison;        // bytes at the top of each stack poisoned before each block
    char* error;                  // message buffer (first error wins)
    uint64_t error_cap;
    // outputs
    uint64_t static_smem_used;    // largest static shared memory footprint of a block
    uint64_t context_switches;    // scheduler -> fiber switches, all blocks
    uint64_t blocks_run;
    // checked mode only (ignored otherwise)
    const Region* regions;
    uint64_t nregions;
    CheckReport* report;
    // the process's fiber-stack pool (cusim_new_stack_pool of any module; null: this module's own)
    void* stack_pool;
};

enum CheckKind : uint32_t {
    kCheckNone = 0,
    kGlobalOobRead = 1,
    kGlobalOobWrite = 2,
    kReadOnlyWrite = 3,
    kSharedUninitRead = 4,
    kSharedRace = 5,
    kSharedOob = 6,
    kAsyncInFlight = 7,   // an access to shared bytes a cp.async is still filling
    kWild = 8,            // outside every argument, the shared memory and the thread's stack
    kGlobalRace = 9,      // two threads (of one block or two) on one global byte, unordered
    kMisaligned = 10,     // an access below its type's natural alignment
};

// Name and layout of a __shared__ declaration (from the lowering), for reports.
struct SiteInfo {
    const char* name;
    uint32_t elem, rank;
    uint64_t dims[4];
};
template <class T>
constexpr SiteInfo site_info(const char* name) {
    return SiteInfo{name, uint32_t(sizeof(std::remove_all_extents_t<T>)), uint32_t(std::rank<T>::value),
                    {std::extent<T, 0>::value, std::extent<T, 1>::value, std::extent<T, 2>::value,
                     std::extent<T, 3>::value}};
}

constexpr unsigned kMaxGroupsPerWarp = 8;
constexpr unsigned kMaxAsync = 256;           // cp.async copies in flight per thread
constexpr uint64_t kPollLimit = 1ull << 20;   // polls in a block without progress before the watchdog fires
constexpr uint64_t kDynamicAlign = 128;
constexpr unsigned char kPoison = 0xFF;

// One lane's deposit in a warp collective: operands in, per-lane results out.
struct Slot {
    uint64_t in[6];
    uint32_t out[4];
};
using CollectiveFn = void (*)(Slot* slots, unsigned lanes);

// The lanes of one warp that meet at collectives with one mask. Slots are double-buffered by the
// parity of `gen`: a lane that was released from collective k may read its slot while faster lanes
// already deposit for collective k+1 in the other buffer; collective k+2 cannot complete before
// every lane of the mask arrived at k+1, hence after the slow lane finished reading.
struct Group {
    unsigned mask = 0, arrived = 0, gen = 0;
    CollectiveFn fn = nullptr;
    const char* what = nullptr;
    unsigned took_part[2] = {0, 0};   // lanes that deposited in each buffer's last collective
    Slot slots[2][32];
};

struct Warp {
    unsigned alive = 0;   // lanes that exist and have not exited
    unsigned ngroups = 0;
    Group groups[kMaxGroupsPerWarp];
};

struct AsyncCopy {
    void* dst;
    uint32_t bytes, group;
    unsigned char data[16];
};

enum class FiberState : uint8_t { Ready, AtBarrier, AtCollective, Done };

struct Fiber {
#ifdef CUSIM_FIBERS_UCONTEXT
    ucontext_t uc;
#endif
    void* sp = nullptr;
    uint3 tid{};
    unsigned linear = 0, lane = 0, warp = 0;
    FiberState state = FiberState::Ready;
    unsigned wait_gen = 0;
    Group* wait_group = nullptr;
    AsyncCopy* async = nullptr;      // cp.async copies not yet landed (async[0..nasync)), kMaxAsync slots
    uint32_t nasync = 0;
    uint32_t async_committed = 0;    // commit_group count
    const void* poll_addr = nullptr; // the last address this thread polled (volatile or atomic read)
    char* stack = nullptr;           // lowest usable byte (guard page below)
};

struct Launch;

struct SharedSite {
    const void* key;
    uint64_t offset, size;
    SiteInfo info;
};

struct CheckState;   // checked mode: shadow of shared memory (below)
struct Worker;
struct Sm90State;    // sm_90a machinery (cusim_sm90.h), made at its first use in a worker
CUSIM_NOSAN inline void sm90_block_start(Worker* w);
CUSIM_NOSAN inline void sm90_free(Worker* w);
CUSIM_NOSAN inline void sm90_thread_exit(Worker* w, unsigned me);
CUSIM_NOSAN inline void check_wgmma_regs(Worker* w, uintptr_t a, uint64_t n, bool write);
CUSIM_NOSAN inline void check_own_pending_read(Worker* w, uint64_t byte, bool tma);
CUSIM_NOSAN inline void check_reduce_in_flight(Worker* w, uint64_t region, int64_t off, uintptr_t a, uint64_t n,
                                              bool write);

struct Worker {
    Launch* launch = nullptr;
    const LaunchConfig* cfg = nullptr;
    unsigned nthreads = 0, nwarps = 0;
    std::vector<Fiber> fibers;
    std::vector<AsyncCopy> async_pool;   // kMaxAsync per fiber (outside Fiber: keeps fibers small)
    std::vector<Warp> warps;
    std::vector<unsigned> order;
    uint3 block_idx{};
    dim3 block_dim, grid_dim;
    unsigned bar_arrived = 0, bar_alive = 0, bar_gen = 0;
    const char* bar_site = nullptr;   // the __syncthreads call site of the threads waiting now
    int bar_or_acc = 0;               // __syncthreads_or: the OR of this phase's predicates so far
    int bar_or_done[2] = {0, 0};      // ... and of the last two released phases (by generation parity)
    // shared memory arena
    unsigned char* arena = nullptr;
    uint64_t arena_cap = 0, arena_used = 0, arena_dirty = 0, dyn_end = 0;
    std::vector<SharedSite> sites;
    Fiber* cur = nullptr;
    void* sched_sp = nullptr;
#ifdef CUSIM_FIBERS_UCONTEXT
    ucontext_t sched_uc;
#endif
    uint64_t rng = 0;
    uint64_t block_linear = 0;
    uint64_t idle_polls = 0;   // polls since the last sign of progress (see poll())
    uint64_t switches = 0;
    uint64_t static_smem_max = 0;
    SiteInfo dyn_info{"<dynamic shared memory>", 1, 1, {0, 0, 0, 0}};
    CheckState* chk = nullptr;   // checked mode only
    Sm90State* sm90 = nullptr;   // wgmma, mbarrier, TMA, named-barrier state (cusim_sm90.h)
};

struct Launch {
    const LaunchConfig* cfg = nullptr;
    void (*thunk)(void*) = nullptr;
    void* ctx = nullptr;
    std::atomic<uint64_t> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    uint64_t nblocks = 0;
    std::vector<void*> gshadow;   // checked mode: per region, the race shadow of a written argument
};

inline thread_local Worker* t_worker = nullptr;

CUSIM_NOSAN inline Worker* worker() { return t_worker; }
CUSIM_NOSAN inline Fiber* fiber() { return t_worker->cur; }

// ------------------------------------------------------------------ errors
CUSIM_NOSAN inline void record_error(Launch* L, const char* prefix, const char* fmt, va_list ap) {
    std::lock_guard<std::mutex> lock(L->mu);
    bool first = !L->failed.exchange(true);
    if (!first || !L->cfg->error || L->cfg->error_cap == 0) return;
    int n = std::snprintf(L->cfg->error, L->cfg->error_cap, "%s", prefix);
    if (n < 0) n = 0;
    if (uint64_t(n) < L->cfg->error_cap) std::vsnprintf(L->cfg->error + n, L->cfg->error_cap - n, fmt, ap);
}

CUSIM_NOSAN inline void switch_to_scheduler(Worker* w, Fiber* f) {
#ifdef CUSIM_FIBERS_UCONTEXT
    swapcontext(&f->uc, &w->sched_uc);
#else
    cusim_switch(&f->sp, w->sched_sp);
#endif
}

// Report an error from inside a kernel and abandon the launch: the fiber never resumes.
[[noreturn]] __attribute__((format(printf, 1, 2))) CUSIM_NOSAN inline void fail(const char* fmt, ...) {
    Worker* w = t_worker;
    char prefix[160];
    Fiber* f = w ? w->cur : nullptr;
    if (f)
        std::snprintf(prefix, sizeof prefix, "block (%u,%u,%u) thread (%u,%u,%u): ", w->block_idx.x, w->block_idx.y,
                      w->block_idx.z, f->tid.x, f->tid.y, f->tid.z);
    else
        prefix[0] = 0;
    va_list ap;
    va_start(ap, fmt);
    if (w && w->launch) record_error(w->launch, prefix, fmt, ap);
    va_end(ap);
    if (!f) std::abort();
    f->state = FiberState::Done;
    for (;;) switch_to_scheduler(w, f);
}

// Error found by the scheduler itself (not inside a fiber).
__attribute__((format(printf, 2, 3))) CUSIM_NOSAN inline void fail_block(Worker* w, const char* fmt, ...) {
    char prefix[96];
    std::snprintf(prefix, sizeof prefix, "block (%u,%u,%u): ", w->block_idx.x, w->block_idx.y, w->block_idx.z);
    va_list ap;
    va_start(ap, fmt);
    record_error(w->launch, prefix, fmt, ap);
    va_end(ap);
}

// ------------------------------------------------------------------ scheduling primitives
CUSIM_NOSAN inline void yield_current() {
    Worker* w = t_worker;
    switch_to_scheduler(w, w->cur);
}

CUSIM_NOSAN inline void check_barrier(Worker* w);
CUSIM_NOSAN inline void check_syncwarp(Worker* w, unsigned warp, unsigned lanes);
CUSIM_NOSAN inline void check_declare(Worker* w, uint64_t off, uint64_t size);

CUSIM_NOSAN inline void release_barrier(Worker* w) {
    w->bar_arrived = 0;
    w->bar_or_done[w->bar_gen & 1u] = w->bar_or_acc;
    w->bar_or_acc = 0;
    ++w->bar_gen;
    if (w->chk) check_barrier(w);
}

// `site` names the __syncthreads call ("file:line", from the kernel text's #line markers). All
// threads of a barrier phase must wait at one call site: CUDA allows __syncthreads in
// conditional code only where the condition is the same for the whole block, so threads meeting
// at two sites (a branch some threads skip, per-warp trip counts) are an error, not a merge.
CUSIM_NOSAN inline void syncthreads(const char* site = nullptr) {
    Worker* w = t_worker;
    Fiber* f = w->cur;
    if (site) {
        if (w->bar_arrived == 0) {
            w->bar_site = site;
        } else if (w->bar_site && std::strcmp(w->bar_site, site) != 0) {
            fail("divergent __syncthreads: thread (%u,%u,%u) waits at %s while %u thread(s) of the block wait at %s",
                 f->tid.x, f->tid.y, f->tid.z, site, w->bar_arrived, w->bar_site);
        }
    }
    w->idle_polls = 0;
    f->poll_addr = nullptr;
    if (++w->bar_arrived >= w->bar_alive) {
        release_barrier(w);
        return;
    }
    f->state = FiberState::AtBarrier;
    f->wait_gen = w->bar_gen;
    yield_current();
}

// __syncthreads_or: a barrier that also returns whether any thread's predicate was nonzero. The
// phase's OR is saved when the barrier releases, under its generation's parity; a thread reads
// it after waking, before it can reach the next-but-one barrier that would overwrite it.
CUSIM_NOSAN inline int syncthreads_or(int pred, const char* site = nullptr) {
    Worker* w = t_worker;
    const unsigned gen = w->bar_gen;
    w->bar_or_acc |= pred != 0;
    syncthreads(site);
    return w->bar_or_done[gen & 1u];
}

CUSIM_NOSAN inline void complete_group(Worker* w, Warp& wp, Group& g, unsigned lanes) {
    if (w->chk && g.what && std::strcmp(g.what, "__syncwarp") == 0)
        check_syncwarp(w, unsigned(&wp - w->warps.data()), lanes);
    if (g.fn) g.fn(g.slots[g.gen & 1u], lanes);
    g.took_part[g.gen & 1u] = lanes;
    g.arrived = 0;
    ++g.gen;
}

CUSIM_NOSAN inline Group& group_for(Warp& wp, unsigned mask) {
    for (unsigned i = 0; i < wp.ngroups; ++i)
        if (wp.groups[i].mask == mask) return wp.groups[i];
    if (wp.ngroups == kMaxGroupsPerWarp)
        fail("more than %u distinct warp-collective masks in one warp", kMaxGroupsPerWarp);
    Group& g = wp.groups[wp.ngroups++];
    g.mask = mask;
    g.arrived = 0;
    g.fn = nullptr;
    return g;
}

// The warp collective: deposit `n` bytes, wait for the mask's live lanes, let the last arriving
// lane run `fn` once for the warp; returns this lane's slot (valid until the mask's next-but-one
// collective).
CUSIM_NOSAN inline Slot& collective(unsigned mask, const void* in, size_t n, CollectiveFn fn, const char* what,
                        unsigned* took_part = nullptr) {
    Worker* w = t_worker;
    Fiber* f = w->cur;
    Warp& wp = w->warps[f->warp];
    const unsigned bit = 1u << f->lane;
    if (!(mask & bit)) fail("%s: mask 0x%08x does not include the calling lane %u", what, mask, f->lane);
    Group& g = group_for(wp, mask);
    if (g.arrived && g.fn != fn)
        fail("warp divergence: lanes of mask 0x%08x meet at different collectives (%s and %s)", mask, g.what, what);
    g.fn = fn;
    g.what = what;
    w->idle_polls = 0;
    f->poll_addr = nullptr;
    Slot& mine = g.slots[g.gen & 1u][f->lane];
    if (n) std::memcpy(mine.in, in, n);
    g.arrived |= bit;
    const unsigned expected = mask & wp.alive;
    const unsigned parity = g.gen & 1u;
    if ((g.arrived & expected) == expected) {
        complete_group(w, wp, g, expected);
    } else {
        f->state = FiberState::AtCollective;
        f->wait_group = &g;
        f->wait_gen = g.gen;
        yield_current();
    }
    if (took_part) *took_part = g.took_part[parity];   // valid until the mask's next-but-one collective
    return mine;
}

// ------------------------------------------------------------------ spin-waits
// A thread that reads one address again with a volatile or atomic load (a poll: a spin-wait on a
// flag) yields to the block's other threads, so the thread that sets the flag gets to run; a
// write through a volatile or atomic access, a barrier, a warp collective or an exit is
// progress. kPollLimit polls in a block without progress is a deadlock: the watchdog reports
// where each warp waits. (Volatile accesses are seen through the thread-sanitizer hooks; the
// launcher compiles a module whose source has `volatile` data with them, cuflash/sim/launcher.py.)
CUSIM_NOSAN inline uint64_t shared_site(Worker* w, uint64_t off, CheckReport& r);   // (checked mode, below)

CUSIM_NOSAN inline void describe_address(Worker* w, const void* p, char* out, size_t cap) {
    const uint64_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(w->arena);
    if (off < w->arena_cap) {
        CheckReport r{};
        const uint64_t rel = shared_site(w, off, r);
        std::snprintf(out, cap, "__shared__ %s byte %llu", r.name, (unsigned long long)rel);
    } else {
        std::snprintf(out, cap, "global address %p", p);
    }
}

[[noreturn]] CUSIM_NOSAN inline void watchdog(Worker* w) {
    char msg[1800];
    size_t n = std::snprintf(msg, sizeof msg, "deadlock: %llu polls (volatile or atomic re-reads) without progress; ",
                             (unsigned long long)kPollLimit);
    for (unsigned wi = 0; wi < w->nwarps && n < sizeof msg - 200; ++wi) {
        unsigned polling = 0, at_bar = 0, at_coll = 0, done = 0;
        const void* addr = nullptr;
        const char* coll = "";
        for (unsigned l = 0; l < 32 && wi * 32 + l < w->nthreads; ++l) {
            const Fiber& f = w->fibers[wi * 32 + l];
            if (f.state == FiberState::Done) ++done;
            else if (f.state == FiberState::AtBarrier) ++at_bar;
            else if (f.state == FiberState::AtCollective) ++at_coll, coll = f.wait_group->what;
            else if (f.poll_addr) ++polling, addr = addr ? addr : f.poll_addr;
        }
        char where[96] = "-";
        if (addr) describe_address(w, addr, where, sizeof where);
        n += std::snprintf(msg + n, sizeof msg - n, "warp %u: %u lane(s) poll %s, %u at __syncthreads%s%s, %u at %s, "
                           "%u exited; ", wi, polling, where, at_bar, at_bar && w->bar_site ? " " : "",
                           at_bar && w->bar_site ? w->bar_site : "", at_coll, at_coll ? coll : "a collective", done);
    }
    fail("%s", msg);
}

CUSIM_NOSAN inline void poll(const void* p) {
    Worker* w = t_worker;
    if (!w || !w->cur) return;
    Fiber* f = w->cur;
    if (f->poll_addr != p) {
        f->poll_addr = p;
        return;
    }
    if (++w->idle_polls > kPollLimit) watchdog(w);
    yield_current();   // stays Ready: the scheduler runs the others first
}

CUSIM_NOSAN inline void progress() {
    Worker* w = t_worker;
    if (!w || !w->cur) return;
    w->idle_polls = 0;
    w->cur->poll_addr = nullptr;
}

// ------------------------------------------------------------------ shared memory
CUSIM_NOSAN inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

CUSIM_NOSAN inline void* shared_static(const void* key, uint64_t size, uint64_t align,
                           const SiteInfo& info = SiteInfo{"<shared>", 1, 0, {0, 0, 0, 0}}) {
    Worker* w = t_worker;
    for (const SharedSite& s : w->sites)
        if (s.key == key) return w->arena + s.offset;
    const uint64_t off = align_up(w->arena_used, std::max<uint64_t>(align, 16));
    const uint64_t static_bytes = off + size - w->dyn_end;
    if (static_bytes > w->cfg->static_smem_limit)
        fail("static __shared__ memory of the block reaches %llu bytes; the limit is %llu bytes",
             (unsigned long long)static_bytes, (unsigned long long)w->cfg->static_smem_limit);
    if (off + size > w->arena_cap)
        fail("shared memory of the block (dynamic %llu + static %llu bytes) exceeds this launch's limit of %llu bytes"
             " (the plan's opt-in decides between the 48 KB default and the device maximum)",
             (unsigned long long)w->cfg->dynamic_smem, (unsigned long long)static_bytes,
             (unsigned long long)w->arena_cap);
    w->sites.push_back({key, off, size, info});
    check_declare(w, off, size);
    w->arena_used = off + size;
    if (static_bytes > w->static_smem_max) w->static_smem_max = static_bytes;
    return w->arena + off;
}

CUSIM_NOSAN inline void* shared_dynamic() { return t_worker->arena; }
CUSIM_NOSAN inline void* shared_dynamic(const SiteInfo& info) {
    Worker* w = t_worker;
    w->dyn_info = info;
    return w->arena;
}

CUSIM_NOSAN inline bool is_shared(const void* p, uint64_t n) {
    Worker* w = t_worker;
    auto a = reinterpret_cast<const unsigned char*>(p);
    return a >= w->arena && a + n <= w->arena + w->arena_cap;
}

// ------------------------------------------------------------------ checked mode
// With -DCUSIM_CHECKED the launcher compiles the module with g++'s thread-sanitizer
// instrumentation (-fsanitize=thread, no runtime linked): every load and store the compiler
// cannot prove local calls __tsan_{read,write}{1,2,4,8,16}(addr) (or the _range forms) before it
// happens, reads and writes apart, so a read-modify-write is seen as both.
// Those hooks are defined below ("instrumentation hooks"): an access inside a registered
// argument region must hit a byte of the argument's view (a per-byte map built by the launcher
// from the plan's shape and strides), and writes need a writable argument; an access to the
// block's shared-memory arena must hit a declared variable, a read must find the byte written
// earlier in the block, and two threads touching one byte in the same barrier phase (at least
// one writing) must be ordered by a __syncwarp that both took part in. Written arguments get the
// same race rule per byte, across blocks too (check_global_race); an access of the kernel's own
// code that hits no argument, no shared memory, not its stack and not the module is wild
// (check_wild). The first fault fills LaunchConfig::report and stops the launch, before the
// faulty access is made.

struct ShadowByte {
    uint32_t w_epoch, r_epoch;   // barrier phase of the last write / read of the byte
    uint32_t w_clock, r_clock;   // warp-sync clock at that access
    uint16_t w_tid, r_tid;       // linear id of the thread that made it
    uint8_t r_multi;             // 0: one reader this phase; 1: several, all in r_tid's warp; 2: several warps
    uint8_t pad[3];
};

// kInFlight: a cp.async has been issued into the byte and the issuer's cp.async.wait_group has
// not covered it yet (PTX ISA, "cp.async": the copy is complete only after the wait).
// kGenericDirty: written by a thread (the generic proxy) since that thread's last
// fence.proxy.async; kMbarrierObj: the 8 bytes of an mbarrier (cusim_sm90.h).
enum : uint8_t { kDeclared = 1, kWritten = 2, kInFlight = 4, kGenericDirty = 8, kMbarrierObj = 16 };

struct CheckState {
    uint64_t cap = 0;
    ShadowByte* shadow = nullptr;   // per arena byte
    uint8_t* state = nullptr;       // per arena byte: kDeclared | kWritten, reset per block
    uint32_t* pair = nullptr;       // per warp, 32 x 32: clock of the last __syncwarp both lanes took part in
    uint32_t* full_sync = nullptr;  // per thread: clock of its last __syncwarp with all live lanes of its warp
    uint32_t epoch = 1, clock = 1;
    uint32_t atomic_depth = 0;   // inside an atomic built-in: the hooks stay silent
    unsigned nthreads = 0;
    uint32_t* hb = nullptr;        // sm_90a: thread x thread ordering edges (cusim_sm90.h: hb_matrix)
    uint16_t* readers = nullptr;   // sm_90a: per arena byte, unfinished wgmma / TMA-store reads
    CheckState(uint64_t cap_, unsigned nwarps, unsigned nthreads_) : cap(cap_), nthreads(nthreads_) {
        const unsigned nthreads = nthreads_;
        shadow = static_cast<ShadowByte*>(std::calloc(cap, sizeof(ShadowByte)));
        state = static_cast<uint8_t*>(std::calloc(cap, 1));
        pair = static_cast<uint32_t*>(std::calloc(size_t(nwarps) * 1024, 4));
        full_sync = static_cast<uint32_t*>(std::calloc(nthreads, 4));
    }
    ~CheckState() {
        std::free(shadow);
        std::free(state);
        std::free(pair);
        std::free(full_sync);
        std::free(hb);
        std::free(readers);
    }
    bool ok() const { return shadow && state && pair && full_sync; }
};

CUSIM_NOSAN inline void check_barrier(Worker* w) { ++w->chk->epoch; }

CUSIM_NOSAN inline void check_syncwarp(Worker* w, unsigned warp, unsigned lanes) {
    CheckState& c = *w->chk;
    const uint32_t t = ++c.clock;
    uint32_t* p = c.pair + size_t(warp) * 1024;
    const bool full = lanes == w->warps[warp].alive;
    for (unsigned i = 0; i < 32; ++i) {
        if (!(lanes & (1u << i))) continue;
        for (unsigned j = 0; j < 32; ++j)
            if (lanes & (1u << j)) p[i * 32 + j] = t;
        if (full && warp * 32 + i < w->nthreads) c.full_sync[warp * 32 + i] = t;
    }
}

CUSIM_NOSAN inline void check_block_start(Worker* w, uint64_t dirty) {
    CheckState& c = *w->chk;
    ++c.epoch;
    std::memset(c.state, 0, std::min<uint64_t>(std::max(dirty, w->dyn_end), c.cap));
    std::memset(c.state, kDeclared, std::min<uint64_t>(w->cfg->dynamic_smem, c.cap));
    if (c.hb) std::memset(c.hb, 0, size_t(c.nthreads) * c.nthreads * 4);
    if (c.readers) std::memset(c.readers, 0, c.cap * 2);
}

CUSIM_NOSAN inline void check_declare(Worker* w, uint64_t off, uint64_t size) {
    if (w->chk) std::memset(w->chk->state + off, kDeclared, size);
}

// Report a checked-mode fault of the running fiber and abandon the launch.
[[noreturn]] __attribute__((format(printf, 3, 4))) CUSIM_NOSAN inline void check_fail(Worker* w, CheckReport r,
                                                                                       const char* fmt, ...) {
    Fiber* f = w->cur;
    r.block[0] = w->block_idx.x, r.block[1] = w->block_idx.y, r.block[2] = w->block_idx.z;
    r.thread[0] = f->tid.x, r.thread[1] = f->tid.y, r.thread[2] = f->tid.z;
    {
        std::lock_guard<std::mutex> lock(w->launch->mu);
        if (!w->launch->failed.load() && w->cfg->report) *w->cfg->report = r;
    }
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fail("%s", msg);
}

// Which shared variable holds arena byte `off`: fills the report's name and layout and returns
// the byte offset from the variable's start.
CUSIM_NOSAN inline uint64_t shared_site(Worker* w, uint64_t off, CheckReport& r) {
    SiteInfo info{"<shared memory outside any variable>", 1, 0, {0, 0, 0, 0}};
    uint64_t base = 0;
    if (off < w->dyn_end) {
        info = w->dyn_info;
        uint64_t inner = 1;
        for (uint32_t i = 1; i < info.rank && i < 4; ++i) inner *= info.dims[i] ? info.dims[i] : 1;
        if (info.rank) info.dims[0] = w->cfg->dynamic_smem / std::max<uint64_t>(1, info.elem * inner);
    } else {
        for (const SharedSite& s : w->sites)
            if (off >= s.offset && off < s.offset + s.size) {
                info = s.info;
                base = s.offset;
                break;
            }
    }
    std::snprintf(r.name, sizeof r.name, "%s", info.name);
    r.elem_size = info.elem;
    r.rank = info.rank;
    for (int i = 0; i < 4; ++i) r.dims[i] = info.dims[i];
    r.offset = int64_t(off - base);
    return off - base;
}

CUSIM_NOSAN inline void thread_xyz(Worker* w, unsigned linear, uint32_t out[3]) {
    const unsigned bx = w->block_dim.x, by = w->block_dim.y;
    out[0] = linear % bx, out[1] = (linear / bx) % by, out[2] = linear / (bx * by);
}

CUSIM_NOSAN inline bool check_ordered(const CheckState& c, const Fiber* f, unsigned other, uint32_t clock) {
    if (other == f->linear) return true;
    if (c.hb && c.hb[size_t(other) * c.nthreads + f->linear] > clock) return true;
    if (other / 32 != f->warp) return false;
    return c.pair[size_t(f->warp) * 1024 + (other % 32) * 32 + f->lane] > clock;
}

// The race rule of one byte within a block: an earlier write in this barrier phase by another
// thread, or (for a write) an earlier read, not ordered by a __syncwarp both took part in.
// Returns the other thread's linear id, or 0xffff if none; `other_write` says which it was.
CUSIM_NOSAN inline unsigned race_other(const CheckState& c, const Fiber* f, const ShadowByte& s, bool write,
                                       bool& other_write) {
    if (s.w_epoch == c.epoch && !check_ordered(c, f, s.w_tid, s.w_clock)) {
        other_write = true;
        return s.w_tid;
    }
    if (write && s.r_epoch == c.epoch) {
        bool ordered;
        if (s.r_multi == 0) ordered = check_ordered(c, f, s.r_tid, s.r_clock);
        else ordered = s.r_multi == 1 && s.r_tid / 32 == f->warp && c.full_sync[f->linear] > s.r_clock;
        if (!ordered) {
            other_write = false;
            return s.r_tid;
        }
    }
    return 0xffffu;
}

CUSIM_NOSAN inline void race_note(const CheckState& c, const Fiber* f, ShadowByte& s, bool write) {
    const uint16_t me = uint16_t(f->linear);
    if (write) {
        s.w_epoch = c.epoch;
        s.w_clock = c.clock;
        s.w_tid = me;
    } else if (s.r_epoch != c.epoch) {
        s.r_epoch = c.epoch;
        s.r_clock = c.clock;
        s.r_tid = me;
        s.r_multi = 0;
    } else if (s.r_tid != me) {
        if (s.r_multi == 0 && check_ordered(c, f, s.r_tid, s.r_clock)) {
            s.r_tid = me;   // the earlier read is ordered before this one (and before what follows it)
        } else {
            s.r_multi = (s.r_multi == 2 || s.r_tid / 32 != f->warp) ? 2 : 1;
        }
        s.r_clock = c.clock;
    }
}

CUSIM_NOSAN inline void check_shared(Worker* w, uint64_t off, uint64_t n, bool write, bool atomic) {
    CheckState& c = *w->chk;
    Fiber* f = w->cur;
    for (uint64_t k = 0; k < n; ++k) {
        const uint64_t b = off + k;
        CheckReport r{};
        r.size = uint32_t(n);
        r.is_write = write;
        if (b >= c.cap || !(c.state[b] & kDeclared)) {
            r.kind = kSharedOob;
            shared_site(w, off, r);
            check_fail(w, r, "checked: shared-memory %s of %u bytes at arena offset %llu lies outside every "
                       "__shared__ variable", write ? "write" : "read", unsigned(n), (unsigned long long)off);
        }
        if (c.state[b] & kMbarrierObj) {
            r.kind = 14;   // kMbarrierAccess (cusim_sm90.h)
            const uint64_t rel = shared_site(w, b, r);
            check_fail(w, r, "checked: %s of %s, byte %llu, which holds an mbarrier object: only mbarrier "
                       "instructions may access it (PTX ISA: mbarrier)", write ? "write" : "read", r.name,
                       (unsigned long long)rel);
        }
        if (write && w->sm90) check_own_pending_read(w, b, false);
        if (write && c.readers && c.readers[b]) {
            r.kind = 13;   // kAsyncOverlap (cusim_sm90.h)
            const uint64_t rel = shared_site(w, b, r);
            check_fail(w, r, "checked: write of %s, byte %llu (element %llu), while an unfinished wgmma or TMA store "
                       "still reads it (no wgmma.wait_group / cp.async.bulk.wait_group.read covers that read)",
                       r.name, (unsigned long long)rel, (unsigned long long)(rel / std::max<uint32_t>(1, r.elem_size)));
        }
        if (c.state[b] & kInFlight) {
            r.kind = kAsyncInFlight;
            r.other_write = 1;
            thread_xyz(w, c.shadow[b].w_tid, r.other_thread);
            const uint64_t rel = shared_site(w, b, r);
            check_fail(w, r, "checked: %s of %s, byte %llu (element %llu), while a cp.async or TMA load issued by "
                       "thread (%u,%u,%u) is still filling it (no cp.async.wait_group of the issuer, or completed "
                       "mbarrier phase, has covered it)",
                       write ? "write" : "read", r.name, (unsigned long long)rel,
                       (unsigned long long)(rel / std::max<uint32_t>(1, r.elem_size)), r.other_thread[0],
                       r.other_thread[1], r.other_thread[2]);
        }
        if ((!write || atomic) && !(c.state[b] & kWritten)) {
            r.kind = kSharedUninitRead;
            const uint64_t rel = shared_site(w, b, r);
            check_fail(w, r, "checked: read of uninitialized shared memory: %s, byte %llu (element %llu) was "
                       "never written in this block", r.name, (unsigned long long)rel,
                       (unsigned long long)(rel / std::max<uint32_t>(1, r.elem_size)));
        }
        if (atomic) {
            c.state[b] |= kWritten;
            continue;
        }
        ShadowByte& s = c.shadow[b];
        bool other_write = false;
        const unsigned other = race_other(c, f, s, write, other_write);
        if (other != 0xffffu) {
            r.kind = kSharedRace;
            r.other_write = other_write;
            thread_xyz(w, other, r.other_thread);
            const uint64_t rel = shared_site(w, b, r);
            check_fail(w, r, "checked: shared-memory race on %s, byte %llu (element %llu): %s here, %s by thread "
                       "(%u,%u,%u) in the same barrier phase without a __syncthreads or __syncwarp between them",
                       r.name, (unsigned long long)rel, (unsigned long long)(rel / std::max<uint32_t>(1, r.elem_size)),
                       write ? "write" : "read", other_write ? "written" : "read", r.other_thread[0],
                       r.other_thread[1], r.other_thread[2]);
        }
        race_note(c, f, s, write);
        if (write) c.state[b] |= kWritten | kGenericDirty;
    }
}

// Global-memory race shadow, per byte of a written argument's region. Blocks of one launch are
// not ordered (no grid-wide barrier exists here), so a byte written by one block and read or
// written by another is a race; within a block the shared-memory rule applies (barrier phase,
// __syncwarp). Atomics are exempt. Blocks run concurrently on several workers, but a byte that
// only one block touches is only ever updated by that block's worker.
struct GShadow {
    ShadowByte s;
    uint32_t w_block, r_block;   // linear block + 1 of the last writer / reader (0: none)
    uint32_t r_blocks;           // 1: readers of more than one block
    uint32_t red_block;          // linear block + 1 of the last cp.reduce.async.bulk on the byte (0: none)
};

CUSIM_NOSAN inline void block_xyz(Worker* w, uint64_t linear, uint32_t out[3]) {
    const LaunchConfig& c = *w->cfg;
    out[0] = uint32_t(linear % c.grid[0]);
    out[1] = uint32_t((linear / c.grid[0]) % c.grid[1]);
    out[2] = uint32_t(linear / (uint64_t(c.grid[0]) * c.grid[1]));
}

// The report of a global race on byte `offset` of `region` (the other access's block and thread
// are the caller's to fill).
CUSIM_NOSAN inline CheckReport global_race_report(uint64_t region, int64_t offset, uint64_t n, bool write,
                                                  bool other_write) {
    CheckReport r{};
    r.kind = kGlobalRace;
    r.region = uint32_t(region);
    r.offset = offset;
    r.size = uint32_t(n);
    r.is_write = write;
    r.other_write = other_write;
    return r;
}

CUSIM_NOSAN inline void check_global_race(Worker* w, uint64_t region, int64_t off, uint64_t n, bool write) {
    GShadow* shadow = static_cast<GShadow*>(w->launch->gshadow[region]);
    if (!shadow) return;
    CheckState& c = *w->chk;
    Fiber* f = w->cur;
    const uint32_t me = uint32_t(w->block_linear + 1);
    for (uint64_t k = 0; k < n; ++k) {
        GShadow& g = shadow[off + int64_t(k)];
        uint32_t other_block = 0;
        unsigned other = 0xffffu;
        bool other_write = false;
        if (g.red_block && g.red_block != me) {   // a plain access of bytes another block reduce-adds to
            CheckReport r = global_race_report(region, off + int64_t(k), n, write, true);
            block_xyz(w, g.red_block - 1, r.other_block);
            r.other_valid = 1;
            check_fail(w, r, "checked: global-memory race through argument %u, byte %lld of its region: plain %s here, "
                       "reduce-added (cp.reduce.async.bulk) by another block", w->cfg->regions[region].index,
                       (long long)(off + int64_t(k)), write ? "write" : "read");
        }
        if (g.w_block && g.w_block != me) {
            other_block = g.w_block, other = g.s.w_tid, other_write = true;
        } else if (write && g.r_block && (g.r_block != me || g.r_blocks)) {
            other_block = g.r_block != me ? g.r_block : 0, other = g.s.r_tid;
        } else {
            ShadowByte mine = g.s;
            if (g.w_block != me) mine.w_epoch = 0;
            if (g.r_block != me) mine.r_epoch = 0;
            other = race_other(c, f, mine, write, other_write);
            if (other != 0xffffu) other_block = me;
        }
        if (other != 0xffffu || other_block) {
            CheckReport r = global_race_report(region, off + int64_t(k), n, write, other_write);
            if (other_block) {
                block_xyz(w, other_block - 1, r.other_block);
                r.other_valid = 1;
                if (other != 0xffffu) thread_xyz(w, other, r.other_thread);
            }
            check_fail(w, r, "checked: global-memory race through argument %u, byte %lld of its region: %s here, %s "
                       "by %s", w->cfg->regions[region].index, (long long)(off + int64_t(k)),
                       write ? "write" : "read", other_write ? "written" : "read",
                       other_block == me ? "another thread of this block in the same barrier phase" : "another block");
        }
        if (write) {
            if (g.w_block != me) g.s.w_epoch = 0;
            g.w_block = me;
        } else {
            if (g.r_block && g.r_block != me) {
                g.r_blocks = 1;
                g.s.r_epoch = 0;
            }
            g.r_block = me;
        }
        race_note(c, f, g.s, write);
    }
}

// Returns whether [a, a + n) touches a registered argument region (and checks it if so).
CUSIM_NOSAN inline bool check_global(Worker* w, uintptr_t a, uint64_t n, bool write, bool atomic) {
    const LaunchConfig& cfg = *w->cfg;
    for (uint64_t i = 0; i < cfg.nregions; ++i) {
        const Region& g = cfg.regions[i];
        const int64_t off = int64_t(a - g.start);
        if (off + int64_t(n) <= 0 || off >= int64_t(g.size)) continue;
        for (uint64_t k = 0; k < n; ++k) {
            const int64_t b = off + int64_t(k);
            if (b < 0 || b >= int64_t(g.size) || !g.valid[b]) {
                CheckReport r{};
                r.kind = write ? kGlobalOobWrite : kGlobalOobRead;
                r.region = uint32_t(i);
                r.offset = off;
                r.size = uint32_t(n);
                r.is_write = write;
                check_fail(w, r, "checked: out-of-bounds global %s of %u bytes through argument %u, %lld bytes from "
                           "its registered region (outside the argument's view)", write ? "write" : "read",
                           unsigned(n), g.index, (long long)off);
            }
        }
        if (write && !g.writable) {
            CheckReport r{};
            r.kind = kReadOnlyWrite;
            r.region = uint32_t(i);
            r.offset = off;
            r.size = uint32_t(n);
            r.is_write = 1;
            check_fail(w, r, "checked: write through argument %u, which the launch plan marks read-only", g.index);
        }
        if (!atomic && w->sm90) check_reduce_in_flight(w, i, off, a, n, write);
        if (!atomic) check_global_race(w, i, off, n, write);
        return true;
    }
    return false;
}

// Checked mode: a bulk reduce-add (cp.reduce.async.bulk ... .add) landing on [a, a + n): bounds and
// writability as for a write; reduce-adds of several blocks on one byte are atomic (no race), but a
// plain write or read of another block on the same bytes races with it (and the reverse, in
// check_global_race).
CUSIM_NOSAN inline void check_global_reduce(Worker* w, uintptr_t a, uint64_t n) {
    if (!w->chk) return;
    if (!check_global(w, a, n, true, true)) {
        CheckReport r{};
        r.kind = kWild;
        r.size = uint32_t(n);
        r.is_write = 1;
        r.address = a;
        check_fail(w, r, "checked: cp.reduce.async.bulk writes %u bytes at 0x%llx, inside no argument of the launch",
                   unsigned(n), (unsigned long long)a);
    }
    const LaunchConfig& cfg = *w->cfg;
    const uint32_t me = uint32_t(w->block_linear + 1);
    for (uint64_t i = 0; i < cfg.nregions; ++i) {
        const Region& g = cfg.regions[i];
        const int64_t off = int64_t(a - g.start);
        if (off + int64_t(n) <= 0 || off >= int64_t(g.size)) continue;
        GShadow* shadow = static_cast<GShadow*>(w->launch->gshadow[i]);
        if (!shadow) return;
        for (uint64_t k = 0; k < n; ++k) {
            GShadow& s = shadow[off + int64_t(k)];
            const uint32_t other = s.w_block && s.w_block != me ? s.w_block
                                   : s.r_block && (s.r_block != me || s.r_blocks) ? s.r_block : 0;
            if (other) {
                CheckReport r{};
                r.kind = kGlobalRace;
                r.region = uint32_t(i);
                r.offset = off + int64_t(k);
                r.size = uint32_t(n);
                r.is_write = true;
                r.other_write = s.w_block == other;
                if (other != me) {
                    block_xyz(w, other - 1, r.other_block);
                    r.other_valid = 1;
                }
                check_fail(w, r, "checked: global-memory race through argument %u, byte %lld of its region: "
                           "cp.reduce.async.bulk here, plainly %s by another block", g.index,
                           (long long)(off + int64_t(k)), s.w_block == other ? "written" : "read");
            }
            s.red_block = me;
        }
        return;
    }
}

// The loaded image of this module (code, constants, __constant__ and other globals).
struct Image {
    uintptr_t lo = 0, hi = 0;
};
CUSIM_NOSAN inline int image_segments(dl_phdr_info* info, size_t, void* data) {
    Image& im = *static_cast<Image*>(data);
    const uintptr_t self = reinterpret_cast<uintptr_t>(&image_segments);
    uintptr_t lo = ~uintptr_t(0), hi = 0;
    bool mine = false;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD) continue;
        const uintptr_t s = info->dlpi_addr + ph.p_vaddr, e = s + ph.p_memsz;
        lo = std::min(lo, s);
        hi = std::max(hi, e);
        if (self >= s && self < e) mine = true;
    }
    if (!mine) return 0;
    im.lo = lo, im.hi = hi;
    return 1;
}
CUSIM_NOSAN inline Image find_image() {
    Image r;
    dl_iterate_phdr(&image_segments, &r);
    return r;
}
CUSIM_NOSAN inline const Image& image() {
    static const Image im = find_image();   // (no lambdas here: they would be instrumented)
    return im;
}

CUSIM_NOSAN inline bool inside(uintptr_t a, uint64_t n, const void* lo, uint64_t size) {
    const uintptr_t l = reinterpret_cast<uintptr_t>(lo);
    return a >= l && a + n <= l + size;
}

// Checked mode: an access of the kernel's own code that hits no argument and no shared memory
// must be to the thread's stack (its local memory) or this module's image; the simulator's
// state (the worker, its fibers and warps) is also tolerated, for the runtime's memcpy calls.
CUSIM_NOSAN inline void check_wild(Worker* w, uintptr_t a, uint64_t n, bool write) {
    const Fiber* f = w->cur;
    const uint64_t stack = w->cfg->stack_size;
    if (inside(a, n, f->stack, stack)) return;
    const Image& im = image();
    if (a >= im.lo && a + n <= im.hi) return;
    if (inside(a, n, w, sizeof(Worker)) || inside(a, n, w->fibers.data(), w->fibers.size() * sizeof(Fiber)) ||
        inside(a, n, w->warps.data(), w->warps.size() * sizeof(Warp)))
        return;
    CheckReport r{};
    r.kind = kWild;
    r.size = uint32_t(n);
    r.is_write = write;
    r.address = a;
    char where[96] = "";
    for (const Fiber& o : w->fibers)
        if (&o != f && inside(a, n, o.stack, stack)) {
            std::snprintf(where, sizeof where, " (it lies in the local memory of thread (%u,%u,%u))", o.tid.x, o.tid.y,
                          o.tid.z);
            r.other_thread[0] = o.tid.x, r.other_thread[1] = o.tid.y, r.other_thread[2] = o.tid.z;
            r.other_valid = 1;
            break;
        }
    check_fail(w, r, "checked: wild %s of %u bytes at address 0x%llx: outside every argument, the block's shared "
               "memory and the thread's own stack%s", write ? "write" : "read", unsigned(n), (unsigned long long)a,
               where);
}

// `kernel_code`: the access is made by the kernel's own code (see CUSIM_KERNEL_CODE), so one
// outside the arguments and shared memory is checked as a wild access.
CUSIM_NOSAN inline void check_access(uintptr_t a, uint64_t n, bool write, bool atomic = false,
                                     bool kernel_code = false) {
    Worker* w = t_worker;
    if (!w || !w->chk || !w->cur || (w->chk->atomic_depth && !atomic)) return;
    const uint64_t off = a - reinterpret_cast<uintptr_t>(w->arena);
    if (off < w->arena_cap) {
        check_shared(w, off, n, write, atomic);
        return;
    }
    if (check_global(w, a, n, write, atomic)) return;
    if (w->sm90 && inside(a, n, w->cur->stack, w->cfg->stack_size)) check_wgmma_regs(w, a, n, write);
    if (kernel_code) check_wild(w, a, n, write);
}

// Copy n bytes as the current thread. In checked mode the source is checked as a read and the
// destination as a write, so the bytes cp.async lands (ptx.cuh) count as written by the thread
// that waits for them; the loop itself is not instrumented.
CUSIM_NOSAN inline void checked_copy(void* d, const void* s, uint64_t n) {
    check_access(reinterpret_cast<uintptr_t>(s), n, false);
    check_access(reinterpret_cast<uintptr_t>(d), n, true);
    auto* dc = static_cast<unsigned char*>(d);
    const auto* sc = static_cast<const unsigned char*>(s);
    for (uint64_t i = 0; i < n; ++i) dc[i] = sc[i];
}

// cp.async in checked mode (ptx.cuh). At issue the destination counts as written by the issuer
// in the current barrier phase, so refilling a buffer that another thread read (or wrote) in
// this phase, with no barrier between, is a race; from then on its bytes are in flight until
// the issuer's covering cp.async.wait_group, and any access to them meanwhile, by any thread, is
// an error. At the wait the bytes land as the issuer's write in the wait's phase, so a reader
// in another thread still needs a barrier after that wait.
CUSIM_NOSAN inline void check_async_issue(void* dst, uint64_t n) {
    Worker* w = t_worker;
    if (!w || !w->chk || !w->cur) return;
    const uint64_t off = reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(w->arena);
    if (off >= w->arena_cap) return;   // not shared memory: ptx.cuh refuses it
    check_shared(w, off, n, true, false);
    for (uint64_t k = 0; k < n && off + k < w->chk->cap; ++k) w->chk->state[off + k] |= kInFlight;
}

CUSIM_NOSAN inline void check_async_land(void* dst, uint64_t n) {
    Worker* w = t_worker;
    if (!w || !w->chk) return;
    const uint64_t off = reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(w->arena);
    for (uint64_t k = 0; k < n && off + k < w->chk->cap; ++k) w->chk->state[off + k] &= uint8_t(~kInFlight);
}

// Normal mode: whether a cp.async just issued lands at once (true) or at its wait (false), drawn
// from the block's seeded generator. Landing early is what a GPU may do at any point between
// issue and wait; drawing both ends makes a buffer refilled while still being read, or read
// before its wait, give a wrong result under some seed instead of passing by luck.
CUSIM_NOSAN inline uint64_t splitmix(uint64_t& s);

CUSIM_NOSAN inline bool async_lands_early() {
    Worker* w = t_worker;
#ifdef CUSIM_CHECKED
    (void)w;
    return false;   // checked mode tracks the in-flight bytes instead
#else
    return w && (splitmix(w->rng) & 1u);
#endif
}

// The runtime's atomic built-ins check their operand themselves (bounds; initialized shared
// memory) and silence the hooks for the atomic operation: atomics of several threads on one
// address are not a race.
struct AtomicScope {
    Worker* w = nullptr;
    template <class T>
    CUSIM_NOSAN explicit AtomicScope(T* p) {
#ifdef CUSIM_CHECKED
        check_access(reinterpret_cast<uintptr_t>(p), sizeof(T), true, true);
        w = t_worker;
        if (w && w->chk) ++w->chk->atomic_depth;
#else
        (void)p;
#endif
    }
    CUSIM_NOSAN ~AtomicScope() {
        if (w && w->chk) --w->chk->atomic_depth;
    }
    AtomicScope(const AtomicScope&) = delete;
    AtomicScope& operator=(const AtomicScope&) = delete;
};

// ------------------------------------------------------------------ fibers and blocks
CUSIM_NOSAN inline uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

CUSIM_NOSAN inline void shuffle_order(Worker& w) {
    for (unsigned i = w.nthreads; i > 1; --i) {
        unsigned j = unsigned(splitmix(w.rng) % i);
        std::swap(w.order[i - 1], w.order[j]);
    }
}

CUSIM_NOSAN inline void fiber_exit(Worker* w, Fiber* f) {
    f->state = FiberState::Done;
    f->nasync = 0;   // copies never waited for never land
    w->idle_polls = 0;
    if (w->sm90) sm90_thread_exit(w, f->linear);
    Warp& wp = w->warps[f->warp];
    wp.alive &= ~(1u << f->lane);
    --w->bar_alive;
    if (w->bar_arrived > 0 && w->bar_arrived >= w->bar_alive) release_barrier(w);
    for (unsigned i = 0; i < wp.ngroups; ++i) {
        Group& g = wp.groups[i];
        const unsigned expected = g.mask & wp.alive;
        if (g.arrived && (g.arrived & expected) == expected) complete_group(w, wp, g, expected);
    }
}

extern "C" CUSIM_NOSAN inline void cusim_fiber_main() {
    Worker* w = t_worker;
    w->launch->thunk(w->launch->ctx);
    w = t_worker;
    Fiber* f = w->cur;
    fiber_exit(w, f);
    for (;;) switch_to_scheduler(w, f);
}

// Pool of fiber stacks (mmap'd once, reused across launches). One per process: the launcher
// makes it with cusim_new_stack_pool (of the first module it loads) and hands it to every launch
// (LaunchConfig::stack_pool), so modules share their stacks. Each stack is two mappings (the
// stack and its guard page); a pool per module, hundreds of modules in a test session, 512 stacks
// each for 256-thread blocks, would pass the kernel's map count limit (vm.max_map_count, 65530).
// Every module is compiled from this header by one compiler, so the pool's layout is the same
// in all of them.
struct StackPool {
    std::mutex mu;
    std::vector<std::pair<char*, uint64_t>> free;   // (usable base, size)
    static uint64_t page() { return uint64_t(sysconf(_SC_PAGESIZE)); }
    char* acquire(uint64_t size) {
        {
            std::lock_guard<std::mutex> lock(mu);
            for (size_t i = 0; i < free.size(); ++i)
                if (free[i].second == size) {
                    char* s = free[i].first;
                    free[i] = free.back();
                    free.pop_back();
                    return s;
                }
        }
        const uint64_t pg = page();
        void* m = mmap(nullptr, size + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return nullptr;
        mprotect(m, pg, PROT_NONE);   // guard page: an overflow faults instead of corrupting
        return static_cast<char*>(m) + pg;
    }
    void release(char* s, uint64_t size) {
        std::lock_guard<std::mutex> lock(mu);
        free.emplace_back(s, size);
    }
};
CUSIM_NOSAN inline StackPool& stack_pool(const LaunchConfig& c) {
    static StackPool own;   // a launch that brings none (a module used on its own)
    return c.stack_pool ? *static_cast<StackPool*>(c.stack_pool) : own;
}

CUSIM_NOSAN inline void start_fiber(Worker& w, Fiber& f) {
    const uint64_t size = w.cfg->stack_size;
    char* top = f.stack + size;
    const uint64_t poison = std::min<uint64_t>(w.cfg->stack_poison, size);
    std::memset(top - poison, kPoison, poison);
#ifdef CUSIM_FIBERS_UCONTEXT
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = size;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, reinterpret_cast<void (*)()>(&cusim_fiber_main), 0);
#else
    uintptr_t t = reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(t);
    *--sp = nullptr;                                            // fake return address: entry sees rsp % 16 == 8
    *--sp = reinterpret_cast<void*>(&cusim_fiber_main);          // where cusim_switch's `ret` goes
    for (int r = 0; r < 6; ++r) *--sp = nullptr;                 // rbp rbx r12 r13 r14 r15
    f.sp = sp;
#endif
}

CUSIM_NOSAN inline void resume(Worker& w, Fiber& f) {
    w.cur = &f;
    ++w.switches;
#ifdef CUSIM_FIBERS_UCONTEXT
    swapcontext(&w.sched_uc, &f.uc);
#else
    cusim_switch(&w.sched_sp, f.sp);
#endif
    w.cur = nullptr;
}

CUSIM_NOSAN inline bool run_block(Worker& w, uint64_t b) {
    const LaunchConfig& c = *w.cfg;
    w.block_linear = b;
    w.idle_polls = 0;
    w.block_idx = {unsigned(b % c.grid[0]), unsigned((b / c.grid[0]) % c.grid[1]),
                   unsigned(b / (uint64_t(c.grid[0]) * c.grid[1]))};
    w.bar_arrived = 0;
    w.bar_alive = w.nthreads;
    // Shared memory: poison what the previous block touched (the first block sees a fresh arena).
    std::memset(w.arena, kPoison, std::max(w.arena_dirty, w.dyn_end));
    if (w.chk) check_block_start(&w, w.arena_dirty);
    if (w.sm90) sm90_block_start(&w);
    w.arena_used = w.dyn_end;
    w.sites.clear();
    for (unsigned i = 0; i < w.nwarps; ++i) {
        Warp& wp = w.warps[i];
        const unsigned lanes = std::min(32u, w.nthreads - i * 32);
        wp.alive = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        wp.ngroups = 0;
    }
    const unsigned bx = c.block[0], by = c.block[1];
    for (unsigned i = 0; i < w.nthreads; ++i) {
        Fiber& f = w.fibers[i];
        f.linear = i;
        f.lane = i & 31u;
        f.warp = i >> 5;
        f.tid = {i % bx, (i / bx) % by, i / (bx * by)};
        f.state = FiberState::Ready;
        f.nasync = 0;
        f.poll_addr = nullptr;
        f.async_committed = 0;
        start_fiber(w, f);
    }
    w.rng = c.seed * 0x2545f4914f6cdd1dull + b;
    splitmix(w.rng);
    for (unsigned i = 0; i < w.nthreads; ++i) w.order[i] = i;
    shuffle_order(w);

    unsigned remaining = w.nthreads;
    unsigned phase = w.bar_gen;
    while (remaining) {
        bool ran = false;
        for (unsigned k = 0; k < w.nthreads; ++k) {
            Fiber& f = w.fibers[w.order[k]];
            switch (f.state) {
                case FiberState::Done: continue;
                case FiberState::AtBarrier:
                    if (f.wait_gen == w.bar_gen) continue;
                    break;
                case FiberState::AtCollective:
                    if (f.wait_gen == f.wait_group->gen) continue;
                    break;
                default: break;
            }
            f.state = FiberState::Ready;
            resume(w, f);
            ran = true;
            if (w.launch->failed.load(std::memory_order_relaxed)) return false;
            if (f.state == FiberState::Done) --remaining;
        }
        if (!ran) {
            unsigned at_bar = 0, at_coll = 0;
            const char* what = "";
            unsigned mask = 0;
            for (unsigned i = 0; i < w.nthreads; ++i) {
                if (w.fibers[i].state == FiberState::AtBarrier) ++at_bar;
                if (w.fibers[i].state == FiberState::AtCollective) {
                    ++at_coll;
                    what = w.fibers[i].wait_group->what;
                    mask = w.fibers[i].wait_group->mask;
                }
            }
            fail_block(&w,
                       "deadlock: %u threads wait at __syncthreads and %u at a warp collective (%s, mask 0x%08x); "
                       "the others exited or wait elsewhere",
                       at_bar, at_coll, at_coll ? what : "-", mask);
            return false;
        }
        if (w.bar_gen != phase) {   // a new barrier phase: draw a new order
            phase = w.bar_gen;
            shuffle_order(w);
        }
    }
    w.arena_dirty = w.arena_used;
    return true;
}

CUSIM_NOSAN inline void worker_main(Launch& L) {
    const LaunchConfig& c = *L.cfg;
    Worker w;
    w.launch = &L;
    w.cfg = &c;
    w.nthreads = c.block[0] * c.block[1] * c.block[2];
    w.nwarps = (w.nthreads + 31) / 32;
    w.fibers.resize(w.nthreads);
    w.async_pool.resize(size_t(w.nthreads) * kMaxAsync);
    for (unsigned i = 0; i < w.nthreads; ++i) w.fibers[i].async = w.async_pool.data() + size_t(i) * kMaxAsync;
    w.warps.resize(w.nwarps);
    w.order.resize(w.nthreads);
    w.block_dim = dim3(c.block[0], c.block[1], c.block[2]);
    w.grid_dim = dim3(c.grid[0], c.grid[1], c.grid[2]);
    w.arena_cap = std::max<uint64_t>(c.smem_limit, 16);
    w.dyn_end = align_up(c.dynamic_smem, 16);
    w.arena = static_cast<unsigned char*>(std::aligned_alloc(4096, align_up(w.arena_cap, 4096)));
    bool ok = w.arena != nullptr;
    if (ok) std::memset(w.arena, kPoison, w.arena_cap);
#ifdef CUSIM_CHECKED
    if (ok) {
        w.chk = new CheckState(w.arena_cap, w.nwarps, w.nthreads);
        ok = w.chk->ok();
    }
#endif
    for (Fiber& f : w.fibers) {
        f.stack = ok ? stack_pool(c).acquire(c.stack_size) : nullptr;
        if (!f.stack) ok = false;
    }
    // the crash handler's stack (cusim::on_crash)
    constexpr size_t kAltStack = 1 << 16;
    void* alt = std::malloc(kAltStack);
    stack_t ss{}, old_ss{};
    ss.ss_sp = alt;
    ss.ss_size = kAltStack;
    const bool have_alt = alt && sigaltstack(&ss, &old_ss) == 0;
#ifdef CUSIM_GPU_NUMERICS
    const unsigned mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr | 0x8040u);   // flush-to-zero (bit 15) and denormals-are-zero (bit 6), as -ftz=true
#endif
    t_worker = &w;
    if (!ok) {
        fail_block(&w, "out of memory allocating fiber stacks or the shared memory arena");
    } else {
        uint64_t b;
        while (!L.failed.load(std::memory_order_relaxed) && (b = L.next_block.fetch_add(1)) < L.nblocks) {
            if (!run_block(w, b)) break;
        }
    }
    t_worker = nullptr;
#ifdef CUSIM_GPU_NUMERICS
    _mm_setcsr(mxcsr);
#endif
    if (have_alt) sigaltstack(&old_ss, nullptr);
    std::free(alt);
    for (Fiber& f : w.fibers)
        if (f.stack) stack_pool(c).release(f.stack, c.stack_size);
    sm90_free(&w);
    std::free(w.arena);
    delete w.chk;
    std::lock_guard<std::mutex> lock(L.mu);
    LaunchConfig& out = const_cast<LaunchConfig&>(c);
    out.context_switches += w.switches;
    out.static_smem_used = std::max(out.static_smem_used, w.static_smem_max);
}

// ------------------------------------------------------------------ crashes
// A fault in a kernel's thread (SIGSEGV: a wild pointer, a stack overflow into the guard page;
// SIGBUS; SIGFPE: an integer division by zero, which the GPU does not trap) becomes a launch
// error naming the block and thread, instead of killing the process. The handler is installed
// for the duration of a launch (the previous one is restored after the last running launch of
// this module ends) and runs on an alternate stack; a fault outside a kernel thread goes back to
// the previous handler. It leaves the faulting thread through the scheduler, never returning.
struct CrashGuard {
    std::mutex mu;
    unsigned depth = 0;
    struct sigaction old[3];
};
inline CrashGuard& crash_guard() {
    static CrashGuard g;
    return g;
}
constexpr int kCrashSignals[3] = {SIGSEGV, SIGBUS, SIGFPE};

CUSIM_NOSAN inline void on_crash(int sig, siginfo_t* info, void*) {
    Worker* w = t_worker;
    if (w && w->cur && w->launch) {
        const char* what = sig == SIGSEGV ? "segmentation fault (an access to unmapped or protected memory)"
                           : sig == SIGBUS ? "bus error"
                                           : "arithmetic fault (an integer division by zero)";
        fail("%s at address %p in the kernel's code", what, info ? info->si_addr : nullptr);
    }
    CrashGuard& g = crash_guard();   // not a kernel thread: the previous handler takes it
    for (int i = 0; i < 3; ++i)
        if (kCrashSignals[i] == sig) sigaction(sig, &g.old[i], nullptr);
}

inline void crash_guard_enter() {
    CrashGuard& g = crash_guard();
    std::lock_guard<std::mutex> lock(g.mu);
    if (g.depth++ == 0) {
        struct sigaction sa {};
        sa.sa_sigaction = &on_crash;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        for (int i = 0; i < 3; ++i) sigaction(kCrashSignals[i], &sa, &g.old[i]);
    }
}

inline void crash_guard_leave() {
    CrashGuard& g = crash_guard();
    std::lock_guard<std::mutex> lock(g.mu);
    if (--g.depth == 0)
        for (int i = 0; i < 3; ++i) sigaction(kCrashSignals[i], &g.old[i], nullptr);
}

// ------------------------------------------------------------------ kernel entry glue
template <class... A>
struct KernelCall {
    void (*kernel)(A...);
    void** args;
};

template <class... A, size_t... I>
CUSIM_NOSAN inline void invoke(KernelCall<A...>* c, std::index_sequence<I...>) {
    c->kernel(*static_cast<std::decay_t<A>*>(c->args[I])...);
}

template <class... A>
CUSIM_NOSAN inline void call_thunk(void* p) {
    invoke(static_cast<KernelCall<A...>*>(p), std::index_sequence_for<A...>{});
}

CUSIM_NOSAN inline int config_error(LaunchConfig* c, const char* msg) {
    if (c->error && c->error_cap) std::snprintf(c->error, c->error_cap, "%s", msg);
    return 2;
}

// The launch itself does not depend on the kernel's parameter types: the launcher compiles it once
// per flag set into a runtime object (-DCUSIM_RUNTIME_OBJECT=1, which also holds the hooks below)
// that every module of that flag set links, and a module (-DCUSIM_MODULE=1) only declares it; a
// translation unit with neither macro is whole on its own.
#if defined(CUSIM_MODULE)
CUSIM_NOSAN int launch_blocks(LaunchConfig* c, void (*thunk)(void*), void* ctx);
#else
#ifdef CUSIM_RUNTIME_OBJECT
CUSIM_NOSAN int launch_blocks(LaunchConfig* c, void (*thunk)(void*), void* ctx) {
#else
CUSIM_NOSAN inline int launch_blocks(LaunchConfig* c, void (*thunk)(void*), void* ctx) {
#endif
    const uint64_t nthreads = uint64_t(c->block[0]) * c->block[1] * c->block[2];
    const uint64_t nblocks = uint64_t(c->grid[0]) * c->grid[1] * c->grid[2];
    if (nthreads == 0 || nblocks == 0) return config_error(c, "empty grid or block");
    if (nthreads > c->max_threads) return config_error(c, "too many threads per block");
    if (c->block[0] > 1024 || c->block[1] > 1024 || c->block[2] > 64) return config_error(c, "block dimension too large");
    if (c->grid[0] > 2147483647u || c->grid[1] > 65535u || c->grid[2] > 65535u)
        return config_error(c, "grid dimension too large");
    if (c->dynamic_smem > c->smem_limit) return config_error(c, "dynamic shared memory exceeds the limit");
    if (c->stack_size < 16384 || c->stack_size % 4096) return config_error(c, "bad fiber stack size");
    c->static_smem_used = 0;
    c->context_switches = 0;
    Launch L;
    L.cfg = c;
    L.thunk = thunk;
    L.ctx = ctx;
    L.nblocks = nblocks;
#ifdef CUSIM_CHECKED
    L.gshadow.assign(c->nregions, nullptr);
    for (uint64_t i = 0; i < c->nregions; ++i)
        if (c->regions[i].writable) {
            L.gshadow[i] = std::calloc(c->regions[i].size, sizeof(GShadow));
            if (!L.gshadow[i]) {
                for (void* p : L.gshadow) std::free(p);
                return config_error(c, "out of memory for the global-memory race shadow");
            }
        }
#endif
    crash_guard_enter();
    const uint64_t nworkers = std::max<uint64_t>(1, std::min<uint64_t>(c->workers, nblocks));
    std::vector<std::thread> threads;
    for (uint64_t i = 1; i < nworkers; ++i) threads.emplace_back([&L] { worker_main(L); });
    worker_main(L);
    for (auto& t : threads) t.join();
    crash_guard_leave();
    for (void* p : L.gshadow) std::free(p);
    c->blocks_run = std::min<uint64_t>(L.next_block.load(), nblocks);
    return L.failed.load() ? 1 : 0;
}
#endif

template <class... A>
CUSIM_NOSAN inline int launch(void (*kernel)(A...), LaunchConfig* c, void** args) {
    KernelCall<A...> call{kernel, args};
    return launch_blocks(c, &call_thunk<A...>, &call);
}

// Parameter signature for the launcher's type check: kind letter ('p' pointer, 'i' signed
// integer, 'u' unsigned integer, 'f' floating point, 's' other) and size of each parameter.
template <class T>
constexpr char kind_of() {
    return std::is_pointer<T>::value         ? 'p'
           : std::is_floating_point<T>::value ? 'f'
           : std::is_integral<T>::value       ? (std::is_signed<T>::value ? 'i' : 'u')
                                              : 's';
}

template <class... A>
CUSIM_NOSAN inline int signature(void (*)(A...), char* kinds, uint32_t* sizes, int cap) {
    constexpr int n = int(sizeof...(A));
    const char ks[n + 1] = {kind_of<std::decay_t<A>>()..., 0};
    const uint32_t ss[n + 1] = {uint32_t(sizeof(std::decay_t<A>))..., 0};
    for (int i = 0; i < n && i < cap; ++i) {
        kinds[i] = ks[i];
        sizes[i] = ss[i];
    }
    return n;
}

// ------------------------------------------------------------------ collectives used by the built-ins
template <int KIND>
CUSIM_NOSAN inline void no_compute(Slot*, unsigned) {}

CUSIM_NOSAN inline unsigned lane_id() { return t_worker->cur->lane; }

}  // namespace cusim

// ------------------------------------------------------------------ CUDA built-in variables
// (Values, read by runtime functions: the kernel's own instrumented code never touches the
// simulator's state.)
namespace cusim {
CUSIM_NOSAN inline uint3 thread_idx() { return t_worker->cur->tid; }
CUSIM_NOSAN inline uint3 block_idx() { return t_worker->block_idx; }
CUSIM_NOSAN inline dim3 block_dim() { return t_worker->block_dim; }
CUSIM_NOSAN inline dim3 grid_dim() { return t_worker->grid_dim; }
}  // namespace cusim
#ifdef CUSIM_CHECKED
#define threadIdx (::cusim::thread_idx())
#define blockIdx (::cusim::block_idx())
#define blockDim (::cusim::block_dim())
#define gridDim (::cusim::grid_dim())
#else   // (references: the fastest form, where nothing is instrumented)
#define threadIdx (static_cast<const uint3&>(::cusim::t_worker->cur->tid))
#define blockIdx (static_cast<const uint3&>(::cusim::t_worker->block_idx))
#define blockDim (static_cast<const dim3&>(::cusim::t_worker->block_dim))
#define gridDim (static_cast<const dim3&>(::cusim::t_worker->grid_dim))
#endif
static constexpr int warpSize = 32;

// ------------------------------------------------------------------ synchronization
namespace cusim {
// __launch_bounds__(max_threads) of a kernel, moved into its body by the lowering
// (cuflash/sim/lower.py): a launch of more threads per block fails, as PTX's .maxntid makes it.
CUSIM_NOSAN inline void check_launch_bounds(unsigned max_threads, const char* text) {
    const Worker* w = t_worker;
    const unsigned n = w->block_dim.x * w->block_dim.y * w->block_dim.z;
    if (n > max_threads)
        fail("launch of %u threads per block exceeds the kernel's __launch_bounds__(%s) = %u (PTX ISA .maxntid: "
             "the launch fails)", n, text, max_threads);
}
}  // namespace cusim

CUSIM_NOSAN inline void __syncthreads() { cusim::syncthreads(); }
#define CUSIM_STR2(x) #x
#define CUSIM_STR(x) CUSIM_STR2(x)
#define __syncthreads() ::cusim::syncthreads(__FILE__ ":" CUSIM_STR(__LINE__))
#define __syncthreads_or(p) ::cusim::syncthreads_or((p), __FILE__ ":" CUSIM_STR(__LINE__))
CUSIM_NOSAN inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cusim::collective(mask, nullptr, 0, &cusim::no_compute<0>, "__syncwarp");
}
CUSIM_NOSAN inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
CUSIM_NOSAN inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] CUSIM_NOSAN inline void __trap() { cusim::fail("__trap() called"); }
CUSIM_NOSAN inline unsigned __activemask() { return cusim::t_worker->warps[cusim::t_worker->cur->warp].alive; }
CUSIM_NOSAN inline void __nanosleep(unsigned) {}

namespace cusim {
enum ShflKind { kShflIdx = 1, kShflUp, kShflDown, kShflXor };
template <int KIND, class T>
CUSIM_NOSAN inline T shfl(unsigned mask, T v, int arg, int width, const char* what) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type wider than 8 bytes");
    if (width <= 0 || width > 32 || (width & (width - 1))) fail("%s: width %d is not a power of two in [1, 32]", what, width);
    unsigned took_part = 0;
    Slot& mine = collective(mask, &v, sizeof(T), &no_compute<KIND>, what, &took_part);
    const unsigned lane = lane_id(), w = unsigned(width), base = lane & ~(w - 1);
    unsigned src;
    switch (KIND) {
        case kShflIdx: src = base + (unsigned(arg) & (w - 1)); break;
        case kShflUp: src = (lane - base) >= unsigned(arg) ? lane - unsigned(arg) : lane; break;
        case kShflDown: src = (lane - base) + unsigned(arg) < w ? lane + unsigned(arg) : lane; break;
        default:
            src = (lane ^ unsigned(arg)) & 31u;
            if ((src & ~(w - 1)) > base) src = lane;   // later segments are not visible
            break;
    }
    if (!(mask & (1u << src))) fail("%s: lane %u reads lane %u, which is not in mask 0x%08x", what, lane, src, mask);
    if (!(took_part & (1u << src)))   // PTX ISA, shfl.sync: the value read from an inactive lane is undefined
        fail("%s: lane %u reads lane %u, which has exited (mask 0x%08x; the value would be undefined)", what, lane,
             src, mask);
    // `mine` lives in the buffer of this collective; its peers' slots sit beside it.
    const Slot* slots = &mine - lane;
    T out;
    std::memcpy(&out, slots[src].in, sizeof(T));
    return out;
}
template <int KIND>
CUSIM_NOSAN inline unsigned vote(unsigned mask, int pred, const char* what) {
    const uint64_t p = pred != 0;
    Slot& mine = collective(mask, &p, sizeof p, &no_compute<KIND>, what);
    const Slot* slots = &mine - lane_id();
    unsigned bits = 0;
    for (unsigned l = 0; l < 32; ++l)
        if ((mask & (1u << l)) && slots[l].in[0]) bits |= 1u << l;
    return bits;
}
}  // namespace cusim

template <class T> CUSIM_NOSAN inline T __shfl_sync(unsigned m, T v, int src, int w = 32) { return cusim::shfl<cusim::kShflIdx>(m, v, src, w, "__shfl_sync"); }
template <class T> CUSIM_NOSAN inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) { return cusim::shfl<cusim::kShflUp>(m, v, int(d), w, "__shfl_up_sync"); }
template <class T> CUSIM_NOSAN inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) { return cusim::shfl<cusim::kShflDown>(m, v, int(d), w, "__shfl_down_sync"); }
template <class T> CUSIM_NOSAN inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) { return cusim::shfl<cusim::kShflXor>(m, v, x, w, "__shfl_xor_sync"); }
// __reduce_{add,min,max}_sync (redux.sync, sm_80+): every lane of the mask must take part.
namespace cusim {
template <int KIND>
CUSIM_NOSAN inline int warp_reduce(unsigned mask, int v, const char* what) {
    unsigned took_part = 0;
    const int64_t x = v;
    Slot& mine = collective(mask, &x, sizeof x, &no_compute<KIND>, what, &took_part);
    if (took_part != mask) fail("%s: lanes 0x%08x of mask 0x%08x have exited (redux.sync needs all of them)", what,
                                mask & ~took_part, mask);
    const Slot* slots = &mine - lane_id();
    int64_t acc = 0;
    bool first = true;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(mask & (1u << l))) continue;
        int64_t y;
        std::memcpy(&y, slots[l].in, sizeof y);
        acc = first ? y : (KIND == 20 ? acc + y : KIND == 21 ? std::min(acc, y) : std::max(acc, y));
        first = false;
    }
    return int(uint32_t(acc));   // add wraps as the 32-bit hardware sum does
}
}  // namespace cusim
CUSIM_NOSAN inline int __reduce_add_sync(unsigned m, int v) { return cusim::warp_reduce<20>(m, v, "__reduce_add_sync"); }
CUSIM_NOSAN inline int __reduce_min_sync(unsigned m, int v) { return cusim::warp_reduce<21>(m, v, "__reduce_min_sync"); }
CUSIM_NOSAN inline int __reduce_max_sync(unsigned m, int v) { return cusim::warp_reduce<22>(m, v, "__reduce_max_sync"); }
// Lanes of the mask that have exited count as false (the GPU leaves this undefined).
CUSIM_NOSAN inline unsigned __ballot_sync(unsigned m, int p) { return cusim::vote<10>(m, p, "__ballot_sync"); }
CUSIM_NOSAN inline int __any_sync(unsigned m, int p) { return cusim::vote<11>(m, p, "__any_sync") != 0; }
CUSIM_NOSAN inline int __all_sync(unsigned m, int p) {
    const unsigned live = m & cusim::t_worker->warps[cusim::t_worker->cur->warp].alive;
    return (cusim::vote<12>(m, p, "__all_sync") & live) == live;
}

// ------------------------------------------------------------------ atomics (global and shared memory)
// An atomic that leaves memory unchanged (a failed atomicCAS, atomicAdd(p, 0), ...) is a poll of
// a spin-wait; one that changes it is progress (see poll()).
namespace cusim {
template <class T>
CUSIM_NOSAN inline T after_atomic(T* p, T old, T now) {
    if (std::memcmp(&old, &now, sizeof(T)) == 0) poll(p);
    else progress();
    return old;
}
}  // namespace cusim
template <class T> CUSIM_NOSAN inline T cusim_atomic_cas_op(T* p, T v, T (*op)(T, T)) {
    T old, want;
    {
        cusim::AtomicScope scope_(p);
        __atomic_load(p, &old, __ATOMIC_SEQ_CST);
        do { want = op(old, v); } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    }
    return cusim::after_atomic(p, old, want);
}
#define CUSIM_ATOMIC_OP(NAME, T, EXPR) \
    CUSIM_NOSAN inline T NAME(T* p, T v) { return cusim_atomic_cas_op<T>(p, v, [](T a, T b) -> T { return EXPR; }); }
CUSIM_ATOMIC_OP(atomicAdd, int, a + b)
CUSIM_ATOMIC_OP(atomicAdd, unsigned, a + b)
CUSIM_ATOMIC_OP(atomicAdd, unsigned long long, a + b)
CUSIM_ATOMIC_OP(atomicAdd, float, a + b)
CUSIM_ATOMIC_OP(atomicAdd, double, a + b)
CUSIM_ATOMIC_OP(atomicSub, int, a - b)
CUSIM_ATOMIC_OP(atomicSub, unsigned, a - b)
CUSIM_ATOMIC_OP(atomicAnd, int, a & b)
CUSIM_ATOMIC_OP(atomicAnd, unsigned, a & b)
CUSIM_ATOMIC_OP(atomicOr, int, a | b)
CUSIM_ATOMIC_OP(atomicOr, unsigned, a | b)
CUSIM_ATOMIC_OP(atomicXor, int, a ^ b)
CUSIM_ATOMIC_OP(atomicXor, unsigned, a ^ b)
#define CUSIM_ATOMIC_MINMAX(T) CUSIM_ATOMIC_OP(atomicMax, T, a > b ? a : b) CUSIM_ATOMIC_OP(atomicMin, T, a < b ? a : b)
CUSIM_ATOMIC_MINMAX(int)
CUSIM_ATOMIC_MINMAX(unsigned)
CUSIM_ATOMIC_MINMAX(long long)
CUSIM_ATOMIC_MINMAX(unsigned long long)
#undef CUSIM_ATOMIC_MINMAX
#undef CUSIM_ATOMIC_OP
template <class T> CUSIM_NOSAN inline T atomicExch(T* p, T v) {
    T old;
    {
        cusim::AtomicScope scope_(p);
        __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
    }
    cusim::progress();
    return old;
}
template <class T> CUSIM_NOSAN inline T atomicCAS(T* p, T cmp, T v) {
    T expected = cmp;
    {
        cusim::AtomicScope scope_(p);
        __atomic_compare_exchange(p, &expected, &v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    if (std::memcmp(&expected, &cmp, sizeof(T)) == 0) cusim::progress();   // swapped
    else cusim::poll(p);
    return expected;
}

// ------------------------------------------------------------------ device math
// The GPU's fast intrinsics (__expf, __fdividef, ...) are approximations; here they are the
// correctly rounded host functions, so compare simulator results with tolerances.
inline float __expf(float x) { return ::expf(x); }
inline float __exp10f(float x) { return ::exp10f(x); }
inline float __logf(float x) { return ::logf(x); }
inline float __log2f(float x) { return ::log2f(x); }
inline float __sinf(float x) { return ::sinf(x); }
inline float __cosf(float x) { return ::cosf(x); }
inline float __powf(float a, float b) { return ::powf(a, b); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return ::sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / ::sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / ::sqrt(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float __fmaf_rn(float a, float b, float c) { return ::fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
template <class T> inline T __ldg(const T* p) { return *p; }
// CUDA's overloaded min/max device functions.
#define CUSIM_MINMAX(T)                                  \
    inline T max(T a, T b) { return a > b ? a : b; }     \
    inline T min(T a, T b) { return a < b ? a : b; }
CUSIM_MINMAX(int)
CUSIM_MINMAX(unsigned)
CUSIM_MINMAX(long long)
CUSIM_MINMAX(unsigned long long)
#undef CUSIM_MINMAX
inline float max(float a, float b) { return ::fmaxf(a, b); }
inline float min(float a, float b) { return ::fminf(a, b); }
inline double max(double a, double b) { return ::fmax(a, b); }
inline double min(double a, double b) { return ::fmin(a, b); }

#ifdef CUSIM_GPU_NUMERICS
// SimOptions(gpu_numerics=True): the math functions within the GPU's documented error instead of
// correctly rounded (CUDA C++ Programming Guide, "Mathematical Functions": exp2f and expf 2 ulp,
// logf 1 ulp; NVRTC with -ftz=true compiles exp2f to ex2.approx.ftz.f32). The error of each call
// is drawn from the bits of its argument, so a run is deterministic; results below the float
// range's normal numbers flush to zero, as every float32 operation does under -ftz=true.
namespace cusim {
CUSIM_NOSAN inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
CUSIM_NOSAN inline float within_ulps(double exact, float x, int max_ulp) {
    float r = ftz(float(exact));
    if (!std::isfinite(r) || r == 0.0f) return r;
    uint32_t h = f32_bits(x) * 0x9e3779b1u;
    h ^= h >> 15;
    const int k = int(h % uint32_t(2 * max_ulp + 1)) - max_ulp;
    for (int i = 0; i < (k < 0 ? -k : k); ++i) {
        const float next = std::nextafter(r, k > 0 ? HUGE_VALF : -HUGE_VALF);
        if (!std::isfinite(next) || std::fpclassify(next) == FP_SUBNORMAL || next == 0.0f) break;
        r = next;
    }
    return r;
}
CUSIM_NOSAN inline float gpu_exp2f(float x) { return within_ulps(std::exp2(double(ftz(x))), x, 2); }
CUSIM_NOSAN inline float gpu_expf(float x) { return within_ulps(std::exp(double(ftz(x))), x, 2); }
CUSIM_NOSAN inline float gpu_logf(float x) {
    x = ftz(x);
    return x > 0.0f && std::isfinite(x) ? within_ulps(std::log(double(x)), x, 1) : ::logf(x);
}
// __expf is ex2.approx of x * log2(e) rounded to float: its error grows with |x| as on the GPU.
CUSIM_NOSAN inline float gpu_fast_expf(float x) { return gpu_exp2f(ftz(x * 1.4426950408889634f)); }
}  // namespace cusim
#define exp2f(x) ::cusim::gpu_exp2f(x)
#define expf(x) ::cusim::gpu_expf(x)
#define logf(x) ::cusim::gpu_logf(x)
#define __expf(x) ::cusim::gpu_fast_expf(x)
#endif

#include "cusim_sm90.h"

// Entry stubs generated by the launcher call this.
#define CUSIM_EXPORT extern "C" __attribute__((visibility("default")))

#ifdef CUSIM_MODULE
// (the hooks and the stack pool's constructor are in the runtime object; the module's kernel code
// calls memcpy and memset of its own image, not the C library's, in checked mode)
#ifdef CUSIM_CHECKED
extern "C" CUSIM_NOSAN __attribute__((visibility("hidden"))) void* memcpy(void* __restrict d, const void* __restrict s,
                                                                          size_t n) noexcept;
extern "C" CUSIM_NOSAN __attribute__((visibility("hidden"))) void* memset(void* d, int c, size_t n) noexcept;
#endif
#else
// A fiber-stack pool for the whole process (see StackPool), never freed.
CUSIM_EXPORT void* cusim_new_stack_pool() { return new cusim::StackPool; }

// ------------------------------------------------------------------ instrumentation hooks
// Checked modules (and normal ones whose kernels have volatile data) are compiled with g++'s
// thread-sanitizer instrumentation, without its runtime: every load and store of the kernel's
// code calls __tsan_{read,write}N (separately, so a read-modify-write is seen as both), volatile
// ones __tsan_volatile_{read,write}N, and atomic built-ins become __tsan_atomicN_* calls.
#if defined(CUSIM_CHECKED) || defined(CUSIM_POLL_HOOKS)
extern "C" char __start_cusim_kernel_text[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cusim_kernel_text[] __attribute__((weak, visibility("hidden")));
namespace cusim {
CUSIM_NOSAN inline bool kernel_code(const void* ra) {
    return ra >= static_cast<const void*>(__start_cusim_kernel_text) &&
           ra < static_cast<const void*>(__stop_cusim_kernel_text);
}
CUSIM_NOSAN inline void hook(void* a, uint64_t n, bool write, const void* ra) {
    check_access(reinterpret_cast<uintptr_t>(a), n, write, false, kernel_code(ra));
}
CUSIM_NOSAN inline void hook_volatile(void* a, uint64_t n, bool write, const void* ra) {
    if (!kernel_code(ra)) return;
    // A volatile read is exempt from the race rule, as an atomic is (the flag of a spin-wait;
    // PTX ISA memory model: volatile operations are relaxed, not data races); a volatile write is
    // an ordinary write.
    check_access(reinterpret_cast<uintptr_t>(a), n, write, !write, true);
    if (write) progress();
    else poll(a);
}
}  // namespace cusim
#ifdef CUSIM_CHECKED
#define CUSIM_PLAIN(a, n, w) ::cusim::hook(a, n, w, __builtin_return_address(0))
#else
#define CUSIM_PLAIN(a, n, w) ((void)(a))
#endif
#define CUSIM_HOOK(N)                                                                                      \
    extern "C" CUSIM_NOSAN void __tsan_read##N(void* a) { CUSIM_PLAIN(a, N, false); }                        \
    extern "C" CUSIM_NOSAN void __tsan_write##N(void* a) { CUSIM_PLAIN(a, N, true); }                        \
    extern "C" CUSIM_NOSAN void __tsan_unaligned_read##N(void* a) { CUSIM_PLAIN(a, N, false); }              \
    extern "C" CUSIM_NOSAN void __tsan_unaligned_write##N(void* a) { CUSIM_PLAIN(a, N, true); }              \
    extern "C" CUSIM_NOSAN void __tsan_volatile_read##N(void* a) {                                        \
        ::cusim::hook_volatile(a, N, false, __builtin_return_address(0));                                 \
    }                                                                                                      \
    extern "C" CUSIM_NOSAN void __tsan_volatile_write##N(void* a) {                                       \
        ::cusim::hook_volatile(a, N, true, __builtin_return_address(0));                                  \
    }
CUSIM_HOOK(1)
CUSIM_HOOK(2)
CUSIM_HOOK(4)
CUSIM_HOOK(8)
CUSIM_HOOK(16)
#undef CUSIM_HOOK
extern "C" CUSIM_NOSAN void __tsan_read_range(void* a, unsigned long n) { CUSIM_PLAIN(a, n, false); }
extern "C" CUSIM_NOSAN void __tsan_write_range(void* a, unsigned long n) { CUSIM_PLAIN(a, n, true); }
extern "C" CUSIM_NOSAN void __tsan_init() {}
extern "C" CUSIM_NOSAN void __tsan_func_entry(void*) {}
extern "C" CUSIM_NOSAN void __tsan_func_exit() {}
extern "C" CUSIM_NOSAN void __tsan_vptr_update(void**, void*) {}
extern "C" CUSIM_NOSAN void __tsan_vptr_read(void**) {}
// Atomic built-ins in the kernel's code: checked as atomics (exempt from race checks), polls and
// progress as for the CUDA atomics. (The runtime's std::atomic operations come here too: they are
// only performed.)
namespace cusim {
template <class T>
CUSIM_NOSAN inline bool tsan_cas(volatile T* a, T* c, T v, const void* ra) {
    const bool kern = kernel_code(ra);
    if (kern) check_access(reinterpret_cast<uintptr_t>(a), sizeof(T), true, true, true);
    const bool ok = __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    if (kern) {
        if (ok) progress();
        else poll(const_cast<T*>(a));
    }
    return ok;
}
// After a read-modify-write: unchanged memory is a poll, a change is progress.
template <class T>
CUSIM_NOSAN inline T tsan_rmw_done(volatile T* a, T old, bool kern) {
    if (kern) {
        if (__atomic_load_n(a, __ATOMIC_SEQ_CST) == old) poll(const_cast<T*>(a));
        else progress();
    }
    return old;
}
}  // namespace cusim
#define CUSIM_ATOMIC_CHECK(a, N, write)                                                                   \
    const bool kern_ = ::cusim::kernel_code(__builtin_return_address(0));                                 \
    if (kern_) ::cusim::check_access(reinterpret_cast<uintptr_t>(a), N / 8, write, true, true)
#define CUSIM_TSAN_ATOMIC(N, T)                                                                                 \
    extern "C" CUSIM_NOSAN T __tsan_atomic##N##_load(const volatile T* a, int) {                               \
        CUSIM_ATOMIC_CHECK(a, N, false);                                                                       \
        T v = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                            \
        if (kern_) ::cusim::poll(const_cast<T*>(a));                                                           \
        return v;                                                                                              \
    }                                                                                                          \
    extern "C" CUSIM_NOSAN void __tsan_atomic##N##_store(volatile T* a, T v, int) {                           \
        CUSIM_ATOMIC_CHECK(a, N, true);                                                                        \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                              \
        if (kern_) ::cusim::progress();                                                                        \
    }                                                                                                          \
    extern "C" CUSIM_NOSAN T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                           \
        CUSIM_ATOMIC_CHECK(a, N, true);                                                                        \
        if (kern_) ::cusim::progress();                                                                        \
        return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                    \
    }                                                                                                          \
    CUSIM_TSAN_RMW(N, T, fetch_add) CUSIM_TSAN_RMW(N, T, fetch_sub) CUSIM_TSAN_RMW(N, T, fetch_and)           \
    CUSIM_TSAN_RMW(N, T, fetch_or) CUSIM_TSAN_RMW(N, T, fetch_xor) CUSIM_TSAN_RMW(N, T, fetch_nand)           \
    extern "C" CUSIM_NOSAN int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) { \
        return ::cusim::tsan_cas(a, c, v, __builtin_return_address(0));                                        \
    }                                                                                                          \
    extern "C" CUSIM_NOSAN int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {  \
        return ::cusim::tsan_cas(a, c, v, __builtin_return_address(0));                                        \
    }                                                                                                          \
    extern "C" CUSIM_NOSAN T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {      \
        ::cusim::tsan_cas(a, &c, v, __builtin_return_address(0));                                              \
        return c;                                                                                              \
    }
#define CUSIM_TSAN_RMW(N, T, OP)                                                                   \
    extern "C" CUSIM_NOSAN T __tsan_atomic##N##_##OP(volatile T* a, T v, int) {                   \
        CUSIM_ATOMIC_CHECK(a, N, true);                                                           \
        return ::cusim::tsan_rmw_done(a, __atomic_##OP(a, v, __ATOMIC_SEQ_CST), kern_);           \
    }
CUSIM_TSAN_ATOMIC(8, uint8_t)
CUSIM_TSAN_ATOMIC(16, uint16_t)
CUSIM_TSAN_ATOMIC(32, uint32_t)
CUSIM_TSAN_ATOMIC(64, uint64_t)
#undef CUSIM_TSAN_ATOMIC
#undef CUSIM_TSAN_RMW
extern "C" CUSIM_NOSAN void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" CUSIM_NOSAN void __tsan_atomic_signal_fence(int) {}
#endif

#ifdef CUSIM_CHECKED
// memcpy/memset calls are not instrumented (libtsan's interceptors would see them; no runtime is
// linked here): the module's own memcpy and memset check their ranges, so cp.async (ptx.cuh) is
// checked on its global read and marks the shared bytes it lands as written by the waiting thread.
namespace cusim {
using MemcpyFn = void* (*)(void*, const void*, size_t);
using MemsetFn = void* (*)(void*, int, size_t);
CUSIM_NOSAN inline MemcpyFn real_memcpy() {
    static MemcpyFn fn = reinterpret_cast<MemcpyFn>(dlsym(RTLD_NEXT, "memcpy"));
    return fn;
}
CUSIM_NOSAN inline MemsetFn real_memset() {
    static MemsetFn fn = reinterpret_cast<MemsetFn>(dlsym(RTLD_NEXT, "memset"));
    return fn;
}
}  // namespace cusim
extern "C" CUSIM_NOSAN __attribute__((visibility("hidden"))) void* memcpy(void* __restrict d, const void* __restrict s,
                                                                          size_t n) noexcept {
    ::cusim::check_access(reinterpret_cast<uintptr_t>(s), n, false);
    ::cusim::check_access(reinterpret_cast<uintptr_t>(d), n, true);
    return ::cusim::real_memcpy()(d, s, n);
}
extern "C" CUSIM_NOSAN __attribute__((visibility("hidden"))) void* memset(void* d, int c, size_t n) noexcept {
    ::cusim::check_access(reinterpret_cast<uintptr_t>(d), n, true);
    return ::cusim::real_memset()(d, c, n);
}
#endif

// ------------------------------------------------------------------ misaligned accesses
// Checked modules are compiled with -fsanitize=alignment (no runtime): an access through a pointer
// below its type's natural alignment (a float4 load from a 4-byte-aligned address: on the GPU a
// misaligned-address fault, PTX ISA "Memory Consistency Model"/ld alignment rules; on this CPU
// possibly a crash) calls this handler before it happens, with the kernel's source line.
namespace cusim {
struct UbsanLocation {
    const char* file;
    uint32_t line, column;
};
struct UbsanType {
    uint16_t kind, info;
    char name[1];
};
struct UbsanMismatch {
    UbsanLocation loc;
    const UbsanType* type;
    unsigned char log_alignment, check_kind;
};
CUSIM_NOSAN inline void misaligned(const UbsanMismatch* d, uintptr_t p) {
    static const char* const kinds[] = {"load of", "store to", "reference binding to", "member access within",
                                        "member call on", "constructor call on"};
    const uint64_t align = d->log_alignment < 64 ? uint64_t(1) << d->log_alignment : 0;
    if (p == 0 || align == 0 || p % align == 0) return;   // only the alignment check is compiled in
    Worker* w = t_worker;
    const char* what = d->check_kind < 6 ? kinds[d->check_kind] : "access to";
    const char* type = d->type ? d->type->name : "?";
    if (!w || !w->cur) std::abort();
#ifdef CUSIM_CHECKED
    CheckReport r{};
    r.kind = kMisaligned;
    r.address = p;
    r.align = uint32_t(align);
    r.size = uint32_t(align);
    r.is_write = d->check_kind == 1;
    std::snprintf(r.name, sizeof r.name, "%s", type);
    check_fail(w, r, "misaligned access: %s address 0x%llx of type %s, which needs %llu-byte alignment, at %s:%u",
               what, (unsigned long long)p, type, (unsigned long long)align, d->loc.file, d->loc.line);
#else
    fail("misaligned access: %s address 0x%llx of type %s, which needs %llu-byte alignment, at %s:%u", what,
         (unsigned long long)p, type, (unsigned long long)align, d->loc.file, d->loc.line);
#endif
}
}  // namespace cusim
extern "C" CUSIM_NOSAN void __ubsan_handle_type_mismatch_v1(const cusim::UbsanMismatch* d, uintptr_t p) {
    cusim::misaligned(d, p);
}
extern "C" CUSIM_NOSAN void __ubsan_handle_type_mismatch_v1_abort(const cusim::UbsanMismatch* d, uintptr_t p) {
    cusim::misaligned(d, p);
}
#endif   // CUSIM_MODULE
