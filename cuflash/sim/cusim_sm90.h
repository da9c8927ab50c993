// cuflash CUDA simulator: the asynchronous machinery of sm_90a (Hopper), included by cusim.h.
//
// What kernels_cu/ptx.cuh's Hopper wrappers stand on. Each piece follows the PTX ISA section
// named beside it; what the hardware leaves open is drawn by the launch's seed, as cp.async is:
//
// * Warpgroups (PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): four
//   consecutive warps, threads 128w..128w+127. `wgmma.mma_async` is a warpgroup rendezvous (all
//   128 threads must execute it); the last arriving thread computes D for the warpgroup. The
//   result is held as the operation's and lands in each thread's accumulator registers at that
//   thread's covering `wgmma.wait_group` (or at once, by the seed); a later wgmma on the same
//   accumulator chains on the held result, as the tensor core's in-order pipe does.
// * mbarriers (9.7.13.15 "Parallel Synchronization and Communication Instructions: mbarrier"):
//   one record per 8-byte shared object: expected and pending arrivals, the transaction count
//   (tx), the phase. A phase completes when its pending arrivals and tx both reach zero.
// * TMA (9.7.9.25 "cp.async.bulk.tensor"): a load reads its box at issue (out-of-bounds elements
//   zero), then lands in shared memory, swizzled, and completes its bytes on the mbarrier, either
//   at once or when a thread first waits on that mbarrier (by the seed; always the latter in
//   checked mode). A store reads shared memory and writes global memory at issue or at the
//   issuer's covering `cp.async.bulk.wait_group` (by the seed; the latter in checked mode).
// * Named barriers (9.7.13.4 "bar.sync / bar.arrive"), `setmaxnreg` (9.7.17.1), `elect.sync`.
//
// Waiting threads spin (they yield to the block's others); a block where no thread makes
// progress for kPollLimit spins is a deadlock, reported with what each waiting thread waits for
// (the mbarrier by name, its phase and counts; the named barrier; the setmaxnreg request).
//
// Checked mode adds the proxy model (PTX ISA 8.6 "Memory Consistency Model: proxies"): shared
// bytes written by threads (the generic proxy) and read by a wgmma or a TMA store (the async
// proxy) need a `fence.proxy.async` of the writer in between; bytes a TMA is still filling, or
// that an unfinished wgmma or TMA store still reads, may not be touched; a thread's wgmma
// registers may not be touched between the wgmma and its `wgmma.wait_group`, and registers
// touched after one must see a `wgmma.fence` before the next wgmma uses them. Ordering between
// threads gains the one-directional edges of mbarriers (arrive -> the waiter that sees the phase
// complete) and the edges of named barriers, beside __syncthreads and __syncwarp.
#pragma once

namespace cusim {

constexpr unsigned kWarpgroup = 128;
constexpr unsigned kMaxWgAcc = 8;        // accumulators in flight per thread
constexpr unsigned kMaxWgOps = 64;       // wgmma operations in flight per thread
constexpr unsigned kMaxWatched = 16;     // checked: register ranges of landed wgmmas per thread
constexpr unsigned kNamedBarriers = 16;
constexpr int64_t kTxLimit = (int64_t(1) << 20) - 1;   // PTX ISA: tx-count range [-(2^20-1), 2^20-1]

enum : uint32_t {
    kWgmmaRegs = 11,        // checked: wgmma registers touched in flight, or without wgmma.fence
    kProxyFence = 12,       // checked: generic write read by the async proxy without fence.proxy.async
    kAsyncOverlap = 13,     // checked: bytes an unfinished wgmma / TMA store reads, written
    kMbarrierAccess = 14,   // checked: an mbarrier's bytes touched by ordinary loads or stores
};

struct WgSlot {
    uint64_t in[8];
};
using WgFn = void (*)(Worker* w, WgSlot* slots, unsigned wg);

struct WgRendezvous {
    unsigned arrived = 0, gen = 0;
    WgFn fn = nullptr;
    const char* what = nullptr;
    WgSlot slots[2][kWarpgroup];
};

struct WgAcc {          // one accumulator (a thread's D registers) with a held result
    float* regs = nullptr;
    uint32_t n = 0;     // floats
    uint32_t group = 0; // the wgmma-group of the newest operation on it
    float vals[128];
};

struct RegRange {
    uintptr_t lo = 0, hi = 0;
    uint32_t group = 0;
    uint8_t touched = 0;
};

struct WgOpRef {        // an operation this thread has not landed yet (checked: its smem reads)
    uint32_t op = 0, group = 0;
};

struct WgThread {
    uint32_t committed = 0;                 // wgmma.commit_group count
    uint32_t nacc = 0;
    WgAcc acc[kMaxWgAcc];
    uint32_t na = 0;
    RegRange a[kMaxWgOps];                  // A registers of unfinished operations (checked)
    uint32_t nops = 0;
    WgOpRef ops[kMaxWgOps];                 // checked: unfinished operations' ids
    uint32_t nwatch = 0;
    RegRange watch[kMaxWatched];            // checked: registers of landed operations
    bool fenced = false;                    // a wgmma.fence was executed
    uint32_t bulk_committed = 0;            // cp.async.bulk.commit_group count
    uint32_t bulk_done = 0;                 // groups below this are complete (wait_group, not .read)
    uint32_t reduce_groups = 0;             // the newest cp.reduce.async.bulk's group + 1
    uint32_t global_fenced = 0;             // bulk_done at the last fence.proxy.async.global
    bool acquired = false;                  // an ld.acquire wait not yet followed by fence.proxy.async.global
    const char* wait_what = nullptr;        // what the thread spins on (deadlock reports)
    uint64_t wait_obj = 0, wait_arg = 0;
};

struct MBar {
    uint64_t off = 0;                       // arena offset of the 8-byte object
    uint32_t expected = 0, pending = 0, phase = 0;
    unsigned initializer = 0;               // the thread that ran mbarrier.init
    uint32_t init_epoch = 0, init_clock = 0;   // checked: its barrier phase and clock then
    bool fenced = false;                    // ... and has since run fence.mbarrier_init (or fence.proxy.async)
    int64_t tx = 0;
    std::vector<std::pair<uint16_t, uint32_t>> arrivals, last;   // checked: (thread, clock) per phase
};

struct TmaLoad {
    uint64_t bar_off = 0, dst_off = 0;
    unsigned issuer = 0;
    std::vector<unsigned char> bytes;       // the shared-memory image of the box, swizzled
};

struct TmaStore {       // a TMA store, or (reduce_dst != 0) a cp.reduce.async.bulk .add.f32
    unsigned issuer = 0;
    uint32_t group = 0;
    uint64_t src_off = 0, bytes = 0;
    uintptr_t reduce_dst = 0;
    unsigned char map[128];
    int32_t coords[5];
};

struct WgOp {           // checked: the shared bytes (16-byte granules) one wgmma reads
    std::vector<uint32_t> granules;
    bool live = false;                      // no thread's wait has covered it yet
};

struct NamedBar {
    unsigned arrived = 0, count = 0, gen = 0;
    std::vector<uint16_t> syncers, arrivers;   // checked: this phase's participants
};

struct Sm90State {
    std::vector<WgThread> threads;
    std::vector<WgRendezvous> wgs;
    std::vector<MBar> bars;
    std::vector<TmaLoad> loads;
    std::vector<TmaStore> stores;
    std::vector<WgOp> ops;
    NamedBar named[kNamedBarriers];
    std::vector<int> regs;                  // setmaxnreg: per warpgroup, registers per thread
    int64_t free_regs = 0;
};

// ------------------------------------------------------------------ tensor-core rounding
// One element of D = A * B + C: the 16 products of 16-bit values are exact in double. By default
// the sum is rounded once to float, in mma_m16n8k16_compute's and wgmma_compute's loops (the tensor core's internal
// order and rounding are not specified by the PTX ISA). With gpu_numerics (cuflash.sim.options) it is rounded as measured on
// NVIDIA tensor cores (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor
// cores", PeerJ Comput. Sci. 7:e330, 2021): every term is aligned to the largest exponent among
// the products and C and truncated to 24 significant bits of that scale, the aligned terms are
// added exactly, and the sum is truncated (rounded toward zero) to float (tensor_core_dot; a non-finite
// term keeps the plain sum's inf/NaN).
#ifdef CUSIM_GPU_NUMERICS
CUSIM_NOSAN inline float tensor_core_dot(double c, const double* prod, int k) {
    int emax = INT32_MIN;
    bool finite = std::isfinite(c);
    for (int i = -1; i < k; ++i) {
        const double t = i < 0 ? c : prod[i];
        finite = finite && std::isfinite(t);
        if (t != 0.0) emax = std::max(emax, std::ilogb(t));
    }
    if (finite && emax != INT32_MIN) {
        const double quantum = std::ldexp(1.0, emax - 23);
        double sum = 0.0;
        for (int i = -1; i < k; ++i) sum += std::trunc((i < 0 ? c : prod[i]) / quantum) * quantum;
        float r = float(sum);
        if (std::fabs(double(r)) > std::fabs(sum)) r = std::nextafter(r, 0.0f);   // toward zero
        return ftz(r);
    }
    double acc = c;
    for (int i = 0; i < k; ++i) acc += prod[i];
    return float(acc);
}
#endif


// ------------------------------------------------------------------ state
CUSIM_NOSAN inline Sm90State& sm90(Worker* w) {
    if (!w->sm90) {
        auto* s = new Sm90State;
        s->threads.resize(w->nthreads);
        s->wgs.resize((w->nthreads + kWarpgroup - 1) / kWarpgroup);
        w->sm90 = s;
        sm90_block_start(w);
    }
    return *w->sm90;
}

// Registers per thread at launch, for setmaxnreg's pool: the 64K-register file shared evenly,
// rounded down to a multiple of 8 (what `__launch_bounds__(threads, 1)` gives ptxas).
CUSIM_NOSAN inline int launch_regs(const Worker* w) {
    const int r = int(65536u / std::max(1u, w->nthreads)) & ~7;
    return std::min(r, 255 & ~7);
}

CUSIM_NOSAN inline void sm90_block_start(Worker* w) {
    Sm90State* s = w->sm90;
    if (!s) return;
    for (WgThread& t : s->threads) t = WgThread{};
    for (WgRendezvous& r : s->wgs) r.arrived = 0, r.fn = nullptr;
    s->bars.clear();
    s->loads.clear();
    s->stores.clear();
    s->ops.clear();
    for (NamedBar& b : s->named) b = NamedBar{};
    const int r0 = launch_regs(w);
    s->regs.assign(s->wgs.size(), r0);
    s->free_regs = 65536 - int64_t(r0) * w->nthreads;
}

CUSIM_NOSAN inline void sm90_free(Worker* w) {
    delete w->sm90;
    w->sm90 = nullptr;
}

CUSIM_NOSAN inline uint64_t arena_off(Worker* w, const void* p) {
    return reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(w->arena);
}

// The shared-window address of a pointer into the block's shared memory (cvta.to.shared): its
// arena offset. (A runtime function: the kernel's own code never reads the simulator's state.)
CUSIM_NOSAN inline unsigned shared_window_address(const void* p) {
    Worker* w = t_worker;
    if (!is_shared(p, 1)) fail("cvta.to.shared: %p is not in the block's shared memory", p);
    return unsigned(arena_off(w, p));
}

// The pointer at a shared-window address (the inverse of shared_window_address): an instruction
// that takes a shared address in a register reaches the arena there.
CUSIM_NOSAN inline void* shared_window_pointer(unsigned addr) {
    Worker* w = t_worker;
    void* p = w->arena + addr;
    if (!is_shared(p, 1)) fail("shared address 0x%x is not in the block's shared memory", addr);
    return p;
}

CUSIM_NOSAN inline void describe_shared(Worker* w, uint64_t off, char* out, size_t cap) {
    describe_address(w, w->arena + off, out, cap);
}

// ------------------------------------------------------------------ spinning and deadlocks
[[noreturn]] CUSIM_NOSAN inline void sm90_deadlock(Worker* w) {
    Sm90State& s = *w->sm90;
    char msg[2000];
    size_t n = std::snprintf(msg, sizeof msg, "deadlock: no thread of the block made progress in %llu spins; ",
                             (unsigned long long)kPollLimit);
    // one entry per distinct wait, with the number of threads and the first of them
    std::vector<unsigned> seen;
    for (unsigned i = 0; i < w->nthreads && n < sizeof msg - 300; ++i) {
        const WgThread& t = s.threads[i];
        if (!t.wait_what || w->fibers[i].state == FiberState::Done) continue;
        bool dup = false;
        for (unsigned j : seen)
            if (s.threads[j].wait_what == t.wait_what && s.threads[j].wait_obj == t.wait_obj &&
                s.threads[j].wait_arg == t.wait_arg)
                dup = true;
        if (dup) continue;
        seen.push_back(i);
        unsigned count = 0;
        for (unsigned k = 0; k < w->nthreads; ++k)
            if (s.threads[k].wait_what == t.wait_what && s.threads[k].wait_obj == t.wait_obj &&
                s.threads[k].wait_arg == t.wait_arg && w->fibers[k].state != FiberState::Done)
                ++count;
        char where[128] = "";
        if (std::strcmp(t.wait_what, "mbarrier.try_wait.parity") == 0) {
            describe_shared(w, t.wait_obj, where, sizeof where);
            const MBar* b = nullptr;
            for (const MBar& m : s.bars)
                if (m.off == t.wait_obj) b = &m;
            n += std::snprintf(msg + n, sizeof msg - n,
                               "%u thread(s) from (%u,%u,%u) wait on the mbarrier %s for the phase of parity %llu "
                               "(its phase %u, %u of %u arrivals pending, tx-count %lld); ",
                               count, w->fibers[i].tid.x, w->fibers[i].tid.y, w->fibers[i].tid.z, where,
                               (unsigned long long)t.wait_arg, b ? b->phase : 0u, b ? b->pending : 0u,
                               b ? b->expected : 0u, b ? (long long)b->tx : 0ll);
        } else if (std::strcmp(t.wait_what, "bar.sync") == 0) {
            const NamedBar& b = s.named[t.wait_obj];
            n += std::snprintf(msg + n, sizeof msg - n, "%u thread(s) from (%u,%u,%u) wait at named barrier %llu "
                               "(%u of %u threads arrived); ", count, w->fibers[i].tid.x, w->fibers[i].tid.y,
                               w->fibers[i].tid.z, (unsigned long long)t.wait_obj, b.arrived, b.count);
        } else if (std::strcmp(t.wait_what, "setmaxnreg.inc") == 0) {
            n += std::snprintf(msg + n, sizeof msg - n, "warpgroup %llu waits in setmaxnreg.inc for %llu registers per "
                               "thread; only %lld registers of the block are free (no setmaxnreg.dec released enough: "
                               "on a GPU this hangs); ", (unsigned long long)t.wait_obj,
                               (unsigned long long)t.wait_arg, (long long)s.free_regs);
        } else {
            n += std::snprintf(msg + n, sizeof msg - n, "%u thread(s) from (%u,%u,%u) wait at %s (the rest of their "
                               "warpgroup never arrives); ", count, w->fibers[i].tid.x, w->fibers[i].tid.y,
                               w->fibers[i].tid.z, t.wait_what);
        }
    }
    unsigned at_bar = 0, done = 0;
    for (unsigned i = 0; i < w->nthreads; ++i) {
        if (w->fibers[i].state == FiberState::AtBarrier) ++at_bar;
        if (w->fibers[i].state == FiberState::Done) ++done;
    }
    std::snprintf(msg + n, sizeof msg - n, "%u at __syncthreads, %u exited", at_bar, done);
    fail("%s", msg);
}

// One spin of a waiting thread: note what it waits for, yield, and fire the watchdog when the
// block stopped making progress.
CUSIM_NOSAN inline void spin(Worker* w, const char* what, uint64_t obj, uint64_t arg) {
    WgThread& t = sm90(w).threads[w->cur->linear];
    t.wait_what = what, t.wait_obj = obj, t.wait_arg = arg;
    if (++w->idle_polls > kPollLimit) sm90_deadlock(w);
    yield_current();
    t.wait_what = nullptr;
}

// ------------------------------------------------------------------ checked-mode ordering
// hb[a * n + b] > clock: an access of thread a at `clock` happens before thread b's accesses
// from now on (a named barrier both took part in, or an mbarrier phase a arrived on and b saw
// complete). Allocated at the first such edge.
CUSIM_NOSAN inline uint32_t* hb_matrix(Worker* w) {
    CheckState& c = *w->chk;
    if (!c.hb) {
        c.hb = static_cast<uint32_t*>(std::calloc(size_t(w->nthreads) * w->nthreads, 4));
        if (!c.hb) fail("checked: out of memory for the ordering matrix of %u threads", w->nthreads);
    }
    return c.hb;
}

CUSIM_NOSAN inline void hb_edge(Worker* w, unsigned from, unsigned to, uint32_t clock) {
    uint32_t& e = hb_matrix(w)[size_t(from) * w->nthreads + to];
    if (e < clock) e = clock;
}

// ------------------------------------------------------------------ checked-mode proxy state
[[noreturn]] CUSIM_NOSAN inline void proxy_fail(Worker* w, uint32_t kind, uint64_t off, bool write, const char* fmt,
                                                 ...) {
    CheckReport r{};
    r.kind = kind;
    r.size = 1;
    r.is_write = write;
    shared_site(w, off, r);
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    check_fail(w, r, "%s", msg);
}

// An async-proxy read of shared bytes (a wgmma operand, a TMA store's source): declared, written,
// not being filled, and not written by a thread since that thread's last fence.proxy.async.
CUSIM_NOSAN inline void check_async_read(Worker* w, uint64_t off, uint64_t n, const char* who) {
    if (!w->chk) return;
    CheckState& c = *w->chk;
    for (uint64_t b = off; b < off + n; ++b) {
        char where[128];
        if (b >= c.cap || !(c.state[b] & kDeclared)) {
            describe_shared(w, b, where, sizeof where);
            proxy_fail(w, kSharedOob, b, false, "checked: %s reads shared memory outside every __shared__ variable "
                       "(arena offset %llu)", who, (unsigned long long)b);
        }
        if (c.state[b] & kInFlight) {
            describe_shared(w, b, where, sizeof where);
            proxy_fail(w, kAsyncInFlight, b, false, "checked: %s reads %s while a TMA load or cp.async is still "
                       "filling it (no completed mbarrier phase or wait covers it)", who, where);
        }
        if (!(c.state[b] & kWritten)) {
            describe_shared(w, b, where, sizeof where);
            proxy_fail(w, kSharedUninitRead, b, false, "checked: %s reads %s, which was never written in this block",
                       who, where);
        }
        if (c.state[b] & kGenericDirty) {
            describe_shared(w, b, where, sizeof where);
            uint32_t xyz[3];
            thread_xyz(w, c.shadow[b].w_tid, xyz);
            proxy_fail(w, kProxyFence, b, false, "checked: %s (async proxy) reads %s, written by thread (%u,%u,%u) "
                       "through the generic proxy with no fence.proxy.async of that thread in between (PTX ISA: "
                       "proxies)", who, where, xyz[0], xyz[1], xyz[2]);
        }
    }
}

CUSIM_NOSAN inline uint16_t* async_readers(Worker* w) {
    CheckState& c = *w->chk;
    if (!c.readers) {
        c.readers = static_cast<uint16_t*>(std::calloc(c.cap, 2));
        if (!c.readers) fail("checked: out of memory for the async-reader shadow");
    }
    return c.readers;
}

// Whether a wgmma of this thread's warpgroup that this thread has not waited for reads `byte`: a
// thread learns that its warpgroup's wgmma finished only from its own wgmma.wait_group (threads of
// other warpgroups, from the first waiter on: they are ordered after it by an mbarrier or barrier).
CUSIM_NOSAN inline bool own_pending_read(Worker* w, uint64_t byte) {
    const WgThread& t = w->sm90->threads[w->cur->linear];
    const uint32_t g = uint32_t(byte / 16);
    for (uint32_t i = 0; i < t.nops; ++i) {
        const std::vector<uint32_t>& gr = w->sm90->ops[t.ops[i].op].granules;
        if (std::binary_search(gr.begin(), gr.end(), g)) return true;
    }
    return false;
}

CUSIM_NOSAN inline void check_own_pending_read(Worker* w, uint64_t byte, bool tma) {
    if (!w->sm90 || !w->sm90->threads[w->cur->linear].nops || !own_pending_read(w, byte)) return;
    CheckReport r{};
    r.kind = kAsyncOverlap;
    r.is_write = 1;
    const uint64_t rel = shared_site(w, byte, r);
    check_fail(w, r, "checked: %s of %s, byte %llu, which a wgmma of this thread's warpgroup still reads: this "
               "thread has not waited for it (wgmma.commit_group + wgmma.wait_group) - an unfinished wgmma or "
               "TMA store read", tma ? "a TMA load into" : "write", r.name, (unsigned long long)rel);
}

// An async-proxy write of shared bytes (a TMA load landing or issuing): not read by an
// unfinished wgmma or TMA store, not being filled by another TMA.
CUSIM_NOSAN inline void check_async_write(Worker* w, uint64_t off, uint64_t n, const char* who) {
    if (!w->chk) return;
    CheckState& c = *w->chk;
    const uint16_t* rd = c.readers;
    for (uint64_t b = off; b < off + n; ++b) {
        char where[128];
        if (b >= c.cap || !(c.state[b] & kDeclared)) {
            proxy_fail(w, kSharedOob, b, true, "checked: %s writes shared memory outside every __shared__ variable "
                       "(arena offset %llu)", who, (unsigned long long)b);
        }
        check_own_pending_read(w, b, true);
        if (rd && rd[b]) {
            describe_shared(w, b, where, sizeof where);
            proxy_fail(w, kAsyncOverlap, b, true, "checked: %s writes %s while an unfinished wgmma or TMA store "
                       "still reads it (no wgmma.wait_group / cp.async.bulk.wait_group, and no mbarrier, orders "
                       "them)", who, where);
        }
        if (c.state[b] & kInFlight) {
            describe_shared(w, b, where, sizeof where);
            proxy_fail(w, kAsyncInFlight, b, true, "checked: %s writes %s while another TMA load is still filling it",
                       who, where);
        }
    }
}

CUSIM_NOSAN inline void add_readers(Worker* w, uint64_t off, uint64_t n, int d) {
    if (!w->chk) return;
    uint16_t* rd = async_readers(w);
    for (uint64_t b = off; b < off + n && b < w->chk->cap; ++b) rd[b] = uint16_t(int(rd[b]) + d);
}

// fence.proxy.async.shared::cta by the current thread: its generic writes become visible to the
// async proxy.
CUSIM_NOSAN inline void mark_mbarriers_fenced(Worker* w) {
    if (!w->sm90) return;
    for (MBar& b : w->sm90->bars)
        if (b.initializer == w->cur->linear) b.fenced = true;
}

// fence.mbarrier_init.release.cluster: this thread's mbarrier.init become visible to the async
// proxy (the TMA unit's complete_tx) and to the cluster (PTX ISA 9.7.13.4).
CUSIM_NOSAN inline void fence_mbarrier_init() {
    Worker* w = t_worker;
    mark_mbarriers_fenced(w);
    progress();
}

CUSIM_NOSAN inline void fence_proxy_async() {
    Worker* w = t_worker;
    mark_mbarriers_fenced(w);
    progress();
    if (!w->chk) return;
    CheckState& c = *w->chk;
    const uint16_t me = uint16_t(w->cur->linear);
    const uint64_t hi = std::min<uint64_t>(c.cap, std::max(w->arena_used, w->dyn_end));
    for (uint64_t b = 0; b < hi; ++b)
        if ((c.state[b] & kGenericDirty) && c.shadow[b].w_tid == me) c.state[b] &= uint8_t(~kGenericDirty);
}

// Checked mode, from check_access: an access of the thread's own stack (its registers and local
// memory) against its wgmma state.
CUSIM_NOSAN inline void check_wgmma_regs(Worker* w, uintptr_t a, uint64_t n, bool write) {
    WgThread& t = w->sm90->threads[w->cur->linear];
    for (uint32_t i = 0; i < t.nacc; ++i) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(t.acc[i].regs), hi = lo + 4ull * t.acc[i].n;
        if (a < hi && a + n > lo) {
            CheckReport r{};
            r.kind = kWgmmaRegs;
            r.size = uint32_t(n);
            r.is_write = write;
            r.address = a;
            check_fail(w, r, "checked: %s of wgmma accumulator register %llu while the wgmma that writes it is in "
                       "flight (no wgmma.commit_group + wgmma.wait_group of this thread covers it yet)",
                       write ? "write" : "read", (unsigned long long)((a - lo) / 4));
        }
    }
    if (write)
        for (uint32_t i = 0; i < t.na; ++i)
            if (a < t.a[i].hi && a + n > t.a[i].lo) {
                CheckReport r{};
                r.kind = kWgmmaRegs;
                r.size = uint32_t(n);
                r.is_write = 1;
                r.address = a;
                check_fail(w, r, "checked: write of a wgmma A-operand register while the wgmma that reads it is in "
                           "flight (PTX ISA: the registers may not change until wgmma.wait_group)");
            }
    for (uint32_t i = 0; i < t.nwatch; ++i)
        if (a < t.watch[i].hi && a + n > t.watch[i].lo) t.watch[i].touched = 1;
}

// ------------------------------------------------------------------ warpgroup rendezvous
// All 128 threads of the caller's warpgroup deposit `n` bytes; the last one runs `fn` for the
// warpgroup; returns this thread's slot (valid until the warpgroup's next-but-one rendezvous).
CUSIM_NOSAN inline WgSlot& wg_rendezvous(const void* in, size_t n, WgFn fn, const char* what) {
    Worker* w = t_worker;
    Fiber* f = w->cur;
    Sm90State& s = sm90(w);
    const unsigned wg = f->linear / kWarpgroup;
    if ((wg + 1) * kWarpgroup > w->nthreads)
        fail("%s: thread %u is in warpgroup %u, which has fewer than 128 threads (the block has %u)", what, f->linear,
             wg, w->nthreads);
    WgRendezvous& r = s.wgs[wg];
    if (r.arrived && r.fn != fn)
        fail("warpgroup divergence: threads of warpgroup %u meet at different warpgroup instructions (%s and %s)", wg,
             r.what, what);
    r.fn = fn;
    r.what = what;
    progress();
    const unsigned gen = r.gen;
    WgSlot& mine = r.slots[gen & 1u][f->linear % kWarpgroup];
    std::memcpy(mine.in, in, n);
    if (++r.arrived == kWarpgroup) {
        r.arrived = 0;
        fn(w, r.slots[gen & 1u], wg);
        ++r.gen;
        progress();
    } else {
        while (r.gen == gen) spin(w, what, wg, 0);
    }
    return mine;
}

// ------------------------------------------------------------------ wgmma
// The shared-memory matrix descriptor (PTX ISA 9.7.15.5.1.2 "Matrix Descriptor Format"): start
// address >> 4 in bits 0-13, leading-dimension byte offset >> 4 in 16-29, stride-dimension byte
// offset >> 4 in 32-45, base offset in 49-51, swizzle in 62-63 (0 none, 1 128 B, 2 64 B, 3 32 B).
struct Desc {
    uint64_t start, lbo, sbo;
    unsigned base_offset, swizzle_bytes;   // 0, 32, 64 or 128
};

CUSIM_NOSAN inline Desc decode_desc(uint64_t d) {
    Desc r;
    r.start = (d & 0x3fffull) << 4;
    r.lbo = ((d >> 16) & 0x3fffull) << 4;
    r.sbo = ((d >> 32) & 0x3fffull) << 4;
    r.base_offset = unsigned((d >> 49) & 7u);
    static const unsigned sw[4] = {0, 128, 64, 32};
    r.swizzle_bytes = sw[(d >> 62) & 3u];
    return r;
}

// The swizzle of TMA and wgmma, on shared-memory byte offsets (PTX ISA "Shared Memory Matrix
// Layout", "Tensor-map swizzling modes"): within each 8 x S-byte atom, the 16-byte chunk index
// (offset bits 4..) is XORed with the row index (bits 7..), over log2(S / 16) bits: S = 128 B
// XORs bits 4-6 with bits 7-9, 64 B bits 4-5 with 7-8, 32 B bit 4 with bit 7.
CUSIM_NOSAN inline uint64_t swizzle(uint64_t off, unsigned swizzle_bytes) {
    if (!swizzle_bytes) return off;
    const uint64_t mask = swizzle_bytes / 16 - 1;
    return off ^ (((off >> 7) & mask) << 4);
}

// Offset of element (mn, k) of an operand (mn < 64 or N, k < 16) from the descriptor: the
// canonical layouts of PTX ISA 9.7.15.5.1.2, in 16-byte chunks of T = 16 / elem_bytes elements.
//   K-major, no swizzle:   8-row x 16-byte core matrices of 128 contiguous bytes; the next core
//                          matrix along K at LBO, along M/N at SBO.
//   K-major, S-byte swizzle: rows of S bytes (the K extent of the atom), 8 rows per atom; the
//                          next 8 rows at SBO (LBO unused); the 16 K elements lie within a row.
//   MN-major, no swizzle:  core matrices of 8 K-rows x 16 bytes of M/N; the next along M/N at
//                          SBO, the next 8 K-rows at LBO.
//   MN-major, S-byte swizzle: K-rows of S bytes of M/N, 8 K-rows per atom; the next S bytes of
//                          M/N at LBO, the next 8 K-rows at SBO.
CUSIM_NOSAN inline uint64_t operand_offset(const Desc& d, bool mn_major, unsigned mn, unsigned k, unsigned eb) {
    const unsigned T = 16 / eb;
    const unsigned S = d.swizzle_bytes;
    uint64_t o;
    if (!mn_major) {
        if (!S) o = d.start + (mn % 8) * 16 + (mn / 8) * d.sbo + (k / T) * d.lbo + (k % T) * eb;
        else o = d.start + (mn % 8) * S + (mn / 8) * d.sbo + k * eb;
    } else {
        if (!S) o = d.start + (mn % T) * eb + (mn / T) * d.sbo + (k % 8) * 16 + (k / 8) * d.lbo;
        else {
            const unsigned W = S / eb;   // M/N elements per K-row of the atom
            o = d.start + (mn % W) * eb + (mn / W) * d.lbo + (k % 8) * S + (k / 8) * d.sbo;
        }
    }
    return swizzle(o, S);
}

// Read operand element (mn, k) as float, with the descriptor checks: the start aligned as its
// swizzle needs (PTX ISA: the repeating pattern starts at a 1024 / 512 / 256-byte boundary; a
// start inside the first row of an atom is the K offset of a K-major operand), base offset 0,
// and every byte inside the block's shared memory.
struct Operand {
    Desc d;
    bool mn_major, bf16;
    const char* name;
    bool e4m3 = false;   // float8_e4m3fn elements (1 byte; K-major only, as the PTX ISA allows for fp8)
};

CUSIM_NOSAN inline void check_desc(Worker* w, const Operand& op) {
    const Desc& d = op.d;
    if (d.base_offset)
        fail("wgmma: %s descriptor has base offset %u; cuflash's simulator models base offset 0 (pattern-aligned "
             "tiles)", op.name, d.base_offset);
    if (d.swizzle_bytes) {
        const uint64_t atom = 8ull * d.swizzle_bytes;
        const uint64_t abs = reinterpret_cast<uintptr_t>(w->arena) + d.start;
        if ((abs % atom) >= d.swizzle_bytes)
            fail("wgmma: %s descriptor starts at shared offset %llu, inside row %llu of a %u-byte swizzle atom; a "
                 "%u-byte swizzled tile must start on a %llu-byte boundary (plus a K offset within its first row)",
                 op.name, (unsigned long long)d.start, (unsigned long long)((abs % atom) / d.swizzle_bytes),
                 unsigned(atom), d.swizzle_bytes, (unsigned long long)atom);
    }
}

CUSIM_NOSAN inline float operand_at(Worker* w, const Operand& op, unsigned mn, unsigned k, std::vector<uint32_t>* gr) {
    const unsigned eb = op.e4m3 ? 1 : 2;
    const uint64_t off = operand_offset(op.d, op.mn_major, mn, k, eb);
    if (op.e4m3) {
        if (off + 1 > w->arena_cap)
            fail("wgmma: %s descriptor reaches shared offset %llu, beyond the block's %llu bytes of shared memory "
                 "(element (%u, %u))", op.name, (unsigned long long)off, (unsigned long long)w->arena_cap, mn, k);
        if (w->chk) {
            check_async_read(w, off, 1, "wgmma");
            if (gr) gr->push_back(uint32_t(off / 16));
        }
        return e4m3_bits_to_f32(w->arena[off]);
    }
    if (off + 2 > w->arena_cap)
        fail("wgmma: %s descriptor reaches shared offset %llu, beyond the block's %llu bytes of shared memory "
             "(element (%u, %u))", op.name, (unsigned long long)off, (unsigned long long)w->arena_cap, mn, k);
    if (w->chk) {
        check_async_read(w, off, 2, "wgmma");
        if (gr) gr->push_back(uint32_t(off / 16));
    }
    uint16_t b;
    std::memcpy(&b, w->arena + off, 2);
    return op.bf16 ? bf16_bits_to_f32(b) : f16_bits_to_f32(b);
}

// Slot layout of one thread's wgmma deposit.
//   in[0]: accumulator registers (float*), in[1]: A descriptor or 0, in[2]: B descriptor,
//   in[3]: A registers a0 a1 (A from registers), in[4]: a2 a3, in[5]: A registers' address,
//   in[6]: N | bf16 << 16 | transA << 17 | transB << 18 | scale_d << 19 | a_regs << 20 | e4m3 << 21
//   (e4m3: .m64nNk32.f32.e4m3.e4m3, both operands K-major; the A registers hold four e4m3 each)
CUSIM_NOSAN inline bool lands_early(Worker* w) {
#ifdef CUSIM_CHECKED
    (void)w;
    return false;
#else
    return splitmix(w->rng) & 1u;
#endif
}

CUSIM_NOSAN inline WgAcc* find_acc(Worker* w, WgThread& t, float* regs, uint32_t n) {
    for (uint32_t i = 0; i < t.nacc; ++i) {
        WgAcc& a = t.acc[i];
        const uintptr_t lo = reinterpret_cast<uintptr_t>(a.regs), hi = lo + 4ull * a.n;
        const uintptr_t l2 = reinterpret_cast<uintptr_t>(regs), h2 = l2 + 4ull * n;
        if (a.regs == regs && a.n == n) return &a;
        if (l2 < hi && h2 > lo) fail("wgmma: accumulator registers overlap those of another wgmma in flight");
    }
    (void)w;
    return nullptr;
}

CUSIM_NOSAN inline void wgmma_compute(Worker* w, WgSlot* slots, unsigned wg) {
    const uint64_t flags = slots[0].in[6];
    const unsigned N = unsigned(flags & 0xffffu);
    const bool bf16 = (flags >> 16) & 1u, trans_a = (flags >> 17) & 1u, trans_b = (flags >> 18) & 1u;
    const bool a_regs = (flags >> 20) & 1u, e4m3 = (flags >> 21) & 1u;
    const unsigned K = e4m3 ? 32 : 16;   // k per instruction
    for (unsigned i = 1; i < kWarpgroup; ++i) {
        const uint64_t fi = slots[i].in[6];
        if ((fi & ~(uint64_t(1) << 19)) != (flags & ~(uint64_t(1) << 19)) || slots[i].in[2] != slots[0].in[2] ||
            (!a_regs && slots[i].in[1] != slots[0].in[1]))
            fail("wgmma.mma_async: the threads of warpgroup %u give different shapes, types or descriptors (thread "
                 "%u differs from thread 0); the instruction is .sync.aligned", wg, wg * kWarpgroup + i);
    }
    Sm90State& s = *w->sm90;
    std::vector<uint32_t> granules;
    std::vector<uint32_t>* gr = w->chk ? &granules : nullptr;
    // A: 64 x K, B: N x K (B[n][k]), both as float
    static thread_local float A[64][32], B[256][32];
    if (a_regs && e4m3) {
        // PTX ISA "Register Fragments and Shared Memory Matrix Layouts", wgmma .m64nNk32 A for .e4m3:
        // warp j holds rows 16j..16j+15 as mma.m16n8k32's 8-bit A fragment, four elements per register,
        // the lowest column in the low byte: a0 (g, 4t..4t+3), a1 (g+8, 4t..), a2 (g, 4t+16..), a3 (g+8, 4t+16..).
        for (unsigned i = 0; i < kWarpgroup; ++i) {
            const unsigned j = i / 32, l = i % 32, g = l / 4, c = 4 * (l % 4);
            const uint32_t reg[4] = {uint32_t(slots[i].in[3]), uint32_t(slots[i].in[3] >> 32), uint32_t(slots[i].in[4]),
                                     uint32_t(slots[i].in[4] >> 32)};
            for (unsigned r = 0; r < 4; ++r)
                for (unsigned e = 0; e < 4; ++e)
                    A[16 * j + g + 8 * (r % 2)][c + 16 * (r / 2) + e] = e4m3_bits_to_f32(uint8_t(reg[r] >> (8 * e)));
        }
    } else if (a_regs) {
        // PTX ISA "Register Fragments and Shared Memory Matrix Layouts", wgmma .m64nNk16 A: warp j of the
        // warpgroup holds rows 16j..16j+15 as mma.m16n8k16's A fragment: a0 (g, 2t..2t+1), a1 (g+8, 2t..),
        // a2 (g, 2t+8..), a3 (g+8, 2t+8..).
        for (unsigned i = 0; i < kWarpgroup; ++i) {
            const unsigned j = i / 32, l = i % 32, g = l / 4, c = 2 * (l % 4);
            const uint32_t reg[4] = {uint32_t(slots[i].in[3]), uint32_t(slots[i].in[3] >> 32), uint32_t(slots[i].in[4]),
                                     uint32_t(slots[i].in[4] >> 32)};
            for (int h = 0; h < 2; ++h) {
                auto un = [&](uint32_t r) {
                    const uint16_t b = uint16_t(h ? r >> 16 : r & 0xffffu);
                    return bf16 ? bf16_bits_to_f32(b) : f16_bits_to_f32(b);
                };
                A[16 * j + g][c + h] = un(reg[0]);
                A[16 * j + g + 8][c + h] = un(reg[1]);
                A[16 * j + g][c + 8 + h] = un(reg[2]);
                A[16 * j + g + 8][c + 8 + h] = un(reg[3]);
            }
        }
    } else {
        Operand oa{decode_desc(slots[0].in[1]), trans_a, bf16, "A", e4m3};
        check_desc(w, oa);
        for (unsigned m = 0; m < 64; ++m)
            for (unsigned k = 0; k < K; ++k) A[m][k] = operand_at(w, oa, m, k, gr);
    }
    Operand ob{decode_desc(slots[0].in[2]), trans_b, bf16, "B", e4m3};
    check_desc(w, ob);
    for (unsigned n = 0; n < N; ++n)
        for (unsigned k = 0; k < K; ++k) B[n][k] = operand_at(w, ob, n, k, gr);
    uint32_t op_id = 0;
    if (w->chk) {   // the operation's shared reads stay "read" until every thread has landed it
        std::sort(granules.begin(), granules.end());
        granules.erase(std::unique(granules.begin(), granules.end()), granules.end());
        op_id = uint32_t(s.ops.size());
        s.ops.push_back(WgOp{granules, true});
        for (uint32_t g : granules) add_readers(w, uint64_t(g) * 16, 16, +1);
    }
    const bool early = lands_early(w);
    // D: accumulator fragment (PTX ISA, wgmma .m64nNk16 D): register i of thread l of warp j holds
    // row 16j + g + 8 * ((i % 4) / 2), column 8 * (i / 4) + 2t + (i % 2).
    for (unsigned i = 0; i < kWarpgroup; ++i) {
        const unsigned tid = wg * kWarpgroup + i;
        WgThread& t = s.threads[tid];
        float* regs = reinterpret_cast<float*>(slots[i].in[0]);
        const bool scale_d = (slots[i].in[6] >> 19) & 1u;
        WgAcc* acc = find_acc(w, t, regs, N / 2);
        float din[128];
        if (acc) std::memcpy(din, acc->vals, 4 * (N / 2));
        else std::memcpy(din, regs, 4 * (N / 2));   // (the runtime reads the thread's registers)
        if (!acc) {
            if (t.nacc == kMaxWgAcc) fail("wgmma: more than %u accumulators of one thread in flight", kMaxWgAcc);
            acc = &t.acc[t.nacc++];
            acc->regs = regs;
            acc->n = N / 2;
        }
        acc->group = t.committed;
        const unsigned j = i / 32, l = i % 32, g = l / 4, c = 2 * (l % 4);
        for (unsigned r = 0; r < N / 2; ++r) {
            const unsigned row = 16 * j + g + 8 * ((r % 4) / 2), col = 8 * (r / 4) + c + (r % 2);
#ifdef CUSIM_GPU_NUMERICS
            double prod[32];
            for (unsigned k = 0; k < K; ++k) prod[k] = double(A[row][k]) * double(B[col][k]);
            acc->vals[r] = tensor_core_dot(scale_d ? double(din[r]) : 0.0, prod, int(K));
#else
            double sum = scale_d ? double(din[r]) : 0.0;
            for (unsigned k = 0; k < K; ++k) sum += double(A[row][k]) * double(B[col][k]);
            acc->vals[r] = float(sum);
#endif
        }
        if (early) std::memcpy(regs, acc->vals, 4 * (N / 2));
        if (w->chk) {
            if (t.nops == kMaxWgOps) fail("wgmma: more than %u operations of one thread in flight", kMaxWgOps);
            t.ops[t.nops++] = WgOpRef{op_id, t.committed};
            if (a_regs) {
                const uintptr_t lo = uintptr_t(slots[i].in[5]);
                if (t.na == kMaxWgOps) fail("wgmma: more than %u operations of one thread in flight", kMaxWgOps);
                t.a[t.na++] = RegRange{lo, lo + 16, t.committed, 0};
            }
        }
    }
}

// The checks a thread makes of its own registers as it issues a wgmma (checked mode).
CUSIM_NOSAN inline void wgmma_issue_checks(Worker* w, float* regs, unsigned nf, uintptr_t a_lo) {
    if (!w->chk) return;
    WgThread& t = sm90(w).threads[w->cur->linear];
    if (!t.fenced) {
        CheckReport r{};
        r.kind = kWgmmaRegs;
        check_fail(w, r, "checked: wgmma.mma_async before any wgmma.fence of this thread (PTX ISA: a wgmma.fence must "
                   "precede the warpgroup's first wgmma.mma_async)");
    }
    const uintptr_t lo = reinterpret_cast<uintptr_t>(regs), hi = lo + 4ull * nf;
    for (uint32_t i = 0; i < t.nwatch; ++i) {
        const RegRange& rr = t.watch[i];
        const bool hit = (lo < rr.hi && hi > rr.lo) || (a_lo && a_lo < rr.hi && a_lo + 16 > rr.lo);
        if (hit && rr.touched) {
            CheckReport r{};
            r.kind = kWgmmaRegs;
            check_fail(w, r, "checked: wgmma.mma_async uses registers this thread accessed after an earlier wgmma "
                       "landed in them, with no wgmma.fence in between (PTX ISA: wgmma.fence orders register "
                       "accesses before a wgmma that uses the same registers)");
        }
    }
}

template <unsigned N, bool BF16>
CUSIM_NOSAN inline void wgmma(float* d, uint64_t desc_a, const uint32_t* a, uint64_t desc_b, bool trans_a,
                              bool trans_b, bool scale_d) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is a multiple of 8 in 8..256");
    Worker* w = t_worker;
    wgmma_issue_checks(w, d, N / 2, reinterpret_cast<uintptr_t>(a));
    WgSlot in{};
    in.in[0] = reinterpret_cast<uintptr_t>(d);
    in.in[1] = desc_a;
    in.in[2] = desc_b;
    if (a) {
        in.in[3] = uint64_t(a[0]) | (uint64_t(a[1]) << 32);
        in.in[4] = uint64_t(a[2]) | (uint64_t(a[3]) << 32);
        in.in[5] = reinterpret_cast<uintptr_t>(a);
    }
    in.in[6] = N | (uint64_t(BF16) << 16) | (uint64_t(trans_a) << 17) | (uint64_t(trans_b) << 18) |
               (uint64_t(scale_d) << 19) | (uint64_t(a != nullptr) << 20);
    wg_rendezvous(&in, sizeof in, &wgmma_compute, BF16 ? "wgmma.mma_async.bf16" : "wgmma.mma_async.f16");
}

// wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3: A (from `desc_a`, or four registers `a` per
// thread) and B from shared memory, both K-major (the only layout the PTX ISA gives fp8 operands).
template <unsigned N>
CUSIM_NOSAN inline void wgmma_e4m3(float* d, uint64_t desc_a, const uint32_t* a, uint64_t desc_b, bool scale_d) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk32: N is a multiple of 8 in 8..256");
    Worker* w = t_worker;
    wgmma_issue_checks(w, d, N / 2, reinterpret_cast<uintptr_t>(a));
    WgSlot in{};
    in.in[0] = reinterpret_cast<uintptr_t>(d);
    in.in[1] = desc_a;
    in.in[2] = desc_b;
    if (a) {
        in.in[3] = uint64_t(a[0]) | (uint64_t(a[1]) << 32);
        in.in[4] = uint64_t(a[2]) | (uint64_t(a[3]) << 32);
        in.in[5] = reinterpret_cast<uintptr_t>(a);
    }
    in.in[6] = N | (uint64_t(scale_d) << 19) | (uint64_t(a != nullptr) << 20) | (uint64_t(1) << 21);
    wg_rendezvous(&in, sizeof in, &wgmma_compute, "wgmma.mma_async.e4m3");
}

CUSIM_NOSAN inline void wg_noop(Worker*, WgSlot*, unsigned) {}

CUSIM_NOSAN inline void wgmma_fence() {
    Worker* w = t_worker;
    WgThread& t = sm90(w).threads[w->cur->linear];
    t.fenced = true;
    for (uint32_t i = 0; i < t.nwatch; ++i) t.watch[i].touched = 0;
    progress();
}

CUSIM_NOSAN inline void wgmma_commit() {
    Worker* w = t_worker;
    ++sm90(w).threads[w->cur->linear].committed;
    progress();
}

// wgmma.wait_group N: land every operation of this thread except those of the newest N groups
// (operations issued after the last commit_group belong to no group and stay in flight).
CUSIM_NOSAN inline void wgmma_wait(uint32_t pending) {
    Worker* w = t_worker;
    Sm90State& s = sm90(w);
    WgThread& t = s.threads[w->cur->linear];
    progress();
    if (t.committed < pending) return;
    const uint32_t limit = t.committed - pending;
    uint32_t keep = 0;
    for (uint32_t i = 0; i < t.nacc; ++i) {
        WgAcc& a = t.acc[i];
        if (a.group < limit) {
            std::memcpy(a.regs, a.vals, 4ull * a.n);
            if (w->chk) {   // watch the landed registers for the wgmma.fence rule
                const uintptr_t lo = reinterpret_cast<uintptr_t>(a.regs);
                uint32_t k = 0;
                while (k < t.nwatch && t.watch[k].lo != lo) ++k;
                if (k == t.nwatch && t.nwatch < kMaxWatched) ++t.nwatch;
                if (k < kMaxWatched) t.watch[k] = RegRange{lo, lo + 4ull * a.n, 0, 0};
            }
        } else {
            if (keep != i) t.acc[keep] = a;
            ++keep;
        }
    }
    t.nacc = keep;
    if (!w->chk) return;
    keep = 0;
    for (uint32_t i = 0; i < t.na; ++i) {
        if (t.a[i].group < limit) {
            const RegRange r = t.a[i];
            uint32_t k = 0;
            while (k < t.nwatch && t.watch[k].lo != r.lo) ++k;
            if (k == t.nwatch && t.nwatch < kMaxWatched) ++t.nwatch;
            if (k < kMaxWatched) t.watch[k] = RegRange{r.lo, r.hi, 0, 0};
        } else {
            t.a[keep++] = t.a[i];
        }
    }
    t.na = keep;
    keep = 0;
    for (uint32_t i = 0; i < t.nops; ++i) {
        if (t.ops[i].group < limit) {
            // The operation is one warpgroup-wide event: the first thread whose wait covers it has
            // seen it complete, so its shared-memory reads are over.
            WgOp& op = s.ops[t.ops[i].op];
            if (op.live) {
                for (uint32_t g : op.granules) add_readers(w, uint64_t(g) * 16, 16, -1);
                op.live = false;
            }
        } else {
            t.ops[keep++] = t.ops[i];
        }
    }
    t.nops = keep;
}

// ------------------------------------------------------------------ mbarrier
CUSIM_NOSAN inline uint64_t check_mbar_address(Worker* w, const void* p, const char* what) {
    if (!is_shared(p, 8)) fail("%s: address %p is not in the block's shared memory", what, p);
    if (reinterpret_cast<uintptr_t>(p) & 7u) fail("%s: mbarrier address %p is not 8-byte aligned", what, p);
    return arena_off(w, p);
}

CUSIM_NOSAN inline MBar* find_mbar(Worker* w, uint64_t off) {
    for (MBar& b : sm90(w).bars)
        if (b.off == off) return &b;
    return nullptr;
}

CUSIM_NOSAN inline MBar& get_mbar(Worker* w, const void* p, const char* what) {
    const uint64_t off = check_mbar_address(w, p, what);
    MBar* b = find_mbar(w, off);
    if (!b) {
        char where[128];
        describe_shared(w, off, where, sizeof where);
        fail("%s on %s, which is not an initialized mbarrier (no mbarrier.init in this block, or it is not ordered "
             "before this use)", what, where);
    }
    // checked: another thread's use must be ordered after the init (a __syncthreads, a named
    // barrier or an mbarrier edge), or the object it sees may not be initialized yet
    if (w->chk && b->initializer != w->cur->linear && w->chk->epoch == b->init_epoch &&
        !(w->chk->hb && w->chk->hb[size_t(b->initializer) * w->nthreads + w->cur->linear] > b->init_clock)) {
        char where[128];
        describe_shared(w, off, where, sizeof where);
        uint32_t xyz[3];
        thread_xyz(w, b->initializer, xyz);
        proxy_fail(w, kMbarrierAccess, off, false, "checked: %s on the mbarrier %s, initialized by thread (%u,%u,%u) with no "
                   "barrier between that mbarrier.init and this use", what, where, xyz[0], xyz[1], xyz[2]);
    }
    return *b;
}

CUSIM_NOSAN inline void mbar_init(void* p, uint32_t count) {
    Worker* w = t_worker;
    const uint64_t off = check_mbar_address(w, p, "mbarrier.init");
    if (count < 1 || int64_t(count) > kTxLimit)
        fail("mbarrier.init: expected arrival count %u is outside 1..%lld", count, (long long)kTxLimit);
    if (w->chk) {   // the object's bytes: declared, now "written" and owned by the barrier
        if (!(w->chk->state[off] & kMbarrierObj)) check_shared(w, off, 8, true, false);
        for (uint64_t k = 0; k < 8; ++k) w->chk->state[off + k] |= kMbarrierObj;
    }
    std::memset(p, 0, 8);
    MBar* b = find_mbar(w, off);
    if (!b) {
        sm90(w).bars.push_back(MBar{});
        b = &sm90(w).bars.back();
    }
    *b = MBar{};
    b->off = off;
    b->expected = b->pending = count;
    b->initializer = w->cur->linear;
    if (w->chk) b->init_epoch = w->chk->epoch, b->init_clock = w->chk->clock;
    progress();
}

CUSIM_NOSAN inline void mbar_complete_phase(Worker* w, MBar& b) {
    while (b.pending == 0 && b.tx == 0) {
        ++b.phase;
        b.pending = b.expected;
        if (w->chk) {
            b.last.swap(b.arrivals);
            b.arrivals.clear();
        }
        progress();
    }
}

CUSIM_NOSAN inline void mbar_tx(Worker* w, MBar& b, int64_t delta, const char* what) {
    const int64_t tx = b.tx + delta;
    if (tx > kTxLimit || tx < -kTxLimit) {
        char where[128];
        describe_shared(w, b.off, where, sizeof where);
        fail("%s: the transaction count of mbarrier %s would reach %lld, outside the PTX ISA's range +-(2^20 - 1)",
             what, where, (long long)tx);
    }
    b.tx = tx;
}

CUSIM_NOSAN inline void mbar_arrive(void* p, uint32_t expect_tx, const char* what) {
    Worker* w = t_worker;
    MBar& b = get_mbar(w, p, what);
    if (expect_tx) mbar_tx(w, b, int64_t(expect_tx), what);
    if (b.pending == 0) fail("%s: mbarrier has no pending arrival left in its phase", what);
    if (w->chk) {
        const uint32_t clock = ++w->chk->clock;
        b.arrivals.emplace_back(uint16_t(w->cur->linear), clock);
    }
    --b.pending;
    mbar_complete_phase(w, b);
    progress();
}

CUSIM_NOSAN inline void mbar_expect_tx(void* p, uint32_t bytes) {
    Worker* w = t_worker;
    MBar& b = get_mbar(w, p, "mbarrier.expect_tx");
    mbar_tx(w, b, int64_t(bytes), "mbarrier.expect_tx");
    progress();
}

CUSIM_NOSAN inline void land_tma_loads(Worker* w, uint64_t bar_off);

// mbarrier.try_wait.parity: true once the phase of parity `parity` has completed, i.e. the
// current phase's parity differs (PTX ISA: "phaseParity" operand). A waiter makes the TMA loads
// that signal this mbarrier land (the latest point a GPU may complete them).
CUSIM_NOSAN inline bool mbar_try_wait(void* p, uint32_t parity) {
    Worker* w = t_worker;
    MBar& b0 = get_mbar(w, p, "mbarrier.try_wait.parity");
    if ((b0.phase & 1u) == (parity & 1u)) land_tma_loads(w, b0.off);
    MBar& b = get_mbar(w, p, "mbarrier.try_wait.parity");   // (land_tma_loads may grow nothing, but re-find)
    const bool done = (b.phase & 1u) != (parity & 1u);
    if (done && w->chk)
        for (const auto& a : b.last) hb_edge(w, a.first, w->cur->linear, a.second);
    return done;
}

CUSIM_NOSAN inline void mbar_wait(void* p, uint32_t parity) {
    Worker* w = t_worker;
    while (!mbar_try_wait(p, parity)) spin(w, "mbarrier.try_wait.parity", arena_off(w, p), parity & 1u);
    progress();
}

// ------------------------------------------------------------------ tensor maps and TMA
// The simulator's own tensor-map form (cuflash/runtime/tensor_map.py writes it), 128 bytes as
// CUtensorMap: magic "TMAP", rank, element bytes, swizzle bytes / 16 (0, 2, 4, 8), the global
// address, dims (innermost first), strides of dims 1.. in bytes, box extents.
struct SimTensorMap {
    uint32_t magic;
    uint8_t rank, elem_bytes, swizzle16, pad;
    uint64_t address;
    uint32_t dims[5], pad2;
    uint64_t strides[4];
    uint16_t box[5];
};
static_assert(sizeof(SimTensorMap) <= 128 && offsetof(SimTensorMap, strides) == 40 && offsetof(SimTensorMap, box) == 72,
              "the simulator's tensor map: the layout cuflash/runtime/tensor_map.py packs, within CUtensorMap's 128 bytes");
constexpr uint32_t kTensorMapMagic = 0x50414d54u;   // "TMAP"

CUSIM_NOSAN inline SimTensorMap read_map(const void* m, const char* what) {
    SimTensorMap t;
    std::memcpy(&t, m, sizeof t);
    if (t.magic != kTensorMapMagic || t.rank < 1 || t.rank > 5)
        fail("%s: the tensor map is not one cuflash.runtime.tensor_map encoded for the simulator", what);
    return t;
}

CUSIM_NOSAN inline uint64_t box_bytes(const SimTensorMap& t) {
    uint64_t n = t.elem_bytes;
    for (int i = 0; i < t.rank; ++i) n *= t.box[i];
    return n;
}

CUSIM_NOSAN inline void check_box_smem(Worker* w, const void* smem, const SimTensorMap& t, const char* what) {
    const uint64_t bytes = box_bytes(t);
    if (!is_shared(smem, bytes)) fail("%s: the %llu-byte box at %p is not inside the block's shared memory", what,
                                      (unsigned long long)bytes, smem);
    const uint64_t align = t.swizzle16 ? 128ull * t.swizzle16 : 128ull;   // 1024 / 512 / 256 B swizzled, 128 B else
    if (reinterpret_cast<uintptr_t>(smem) % align)
        fail("%s: shared address %p is not %llu-byte aligned (PTX ISA: 128 bytes, and the swizzle pattern's %s)",
             what, smem, (unsigned long long)align, t.swizzle16 ? "repeat" : "none");
    (void)w;
}

// Visit each element of the box at `coords` (innermost dim first): fn(box linear index, global
// address or 0 when out of bounds).
template <class F>
CUSIM_NOSAN inline void for_box(const SimTensorMap& t, const int32_t* coords, F&& fn) {
    uint64_t idx[5] = {0, 0, 0, 0, 0};
    const uint64_t total = box_bytes(t) / t.elem_bytes;
    for (uint64_t e = 0; e < total; ++e) {
        uint64_t rem = e;
        bool inb = true;
        uint64_t addr = t.address;
        for (int d = 0; d < t.rank; ++d) {
            idx[d] = rem % t.box[d];
            rem /= t.box[d];
            const int64_t g = int64_t(coords[d]) + int64_t(idx[d]);
            if (g < 0 || g >= int64_t(t.dims[d])) inb = false;
            else addr += uint64_t(g) * (d == 0 ? t.elem_bytes : t.strides[d - 1]);
        }
        fn(e, inb ? addr : 0);
    }
}

CUSIM_NOSAN inline void land_load(Worker* w, TmaLoad& l) {
    check_async_land(w->arena + l.dst_off, l.bytes.size());
    std::memcpy(w->arena + l.dst_off, l.bytes.data(), l.bytes.size());
    if (w->chk)   // written by the async proxy: initialized, outside the threads' race shadow
        for (uint64_t k = 0; k < l.bytes.size(); ++k) {
            w->chk->state[l.dst_off + k] = uint8_t((w->chk->state[l.dst_off + k] | kWritten) & ~kGenericDirty);
            w->chk->shadow[l.dst_off + k].w_epoch = 0;
            w->chk->shadow[l.dst_off + k].r_epoch = 0;
        }
    MBar* b = find_mbar(w, l.bar_off);
    if (!b) fail("cp.async.bulk.tensor: its mbarrier was re-initialized or lost before the load completed");
    mbar_tx(w, *b, -int64_t(l.bytes.size()), "cp.async.bulk.tensor (complete_tx)");
    mbar_complete_phase(w, *b);
}

CUSIM_NOSAN inline void land_tma_loads(Worker* w, uint64_t bar_off) {
    Sm90State& s = sm90(w);
    for (size_t i = 0; i < s.loads.size();) {
        if (s.loads[i].bar_off == bar_off) {
            TmaLoad l = std::move(s.loads[i]);
            s.loads.erase(s.loads.begin() + long(i));
            land_load(w, l);
        } else {
            ++i;
        }
    }
}

// cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes (PTX ISA 9.7.9.25.5.1)
CUSIM_NOSAN inline void tma_load(void* smem, const void* map, const int32_t* coords, int rank, void* bar) {
    Worker* w = t_worker;
    const char* what = "cp.async.bulk.tensor (load)";
    const SimTensorMap t = read_map(map, what);
    if (t.rank != rank) fail("%s: a %dd instruction with a rank-%u tensor map", what, rank, unsigned(t.rank));
    check_box_smem(w, smem, t, what);
    MBar& b = get_mbar(w, bar, what);
    if (w->chk && !b.fenced) {
        char where[128];
        describe_shared(w, b.off, where, sizeof where);
        proxy_fail(w, kProxyFence, b.off, false, "checked: %s completes on the mbarrier %s, whose mbarrier.init "
                   "(by thread %u) was never followed by that thread's fence.mbarrier_init (or fence.proxy.async): "
                   "the async proxy may not see the initialized object", what, where, b.initializer);
    }
    TmaLoad l;
    l.bar_off = b.off;
    l.dst_off = arena_off(w, smem);
    l.issuer = w->cur->linear;
    l.bytes.assign(box_bytes(t), 0);   // out-of-bounds elements are zero (OOB fill none)
    const unsigned sw = 16u * t.swizzle16;
    for_box(t, coords, [&](uint64_t e, uint64_t addr) {
        if (!addr) return;
        const uint64_t dst = swizzle(l.dst_off + e * t.elem_bytes, sw) - l.dst_off;
        if (w->chk) check_access(addr, t.elem_bytes, false);
        std::memcpy(l.bytes.data() + dst, reinterpret_cast<const void*>(addr), t.elem_bytes);
    });
    if (w->chk) {
        check_async_write(w, l.dst_off, l.bytes.size(), what);
        for (uint64_t k = 0; k < l.bytes.size(); ++k) {
            w->chk->state[l.dst_off + k] |= kInFlight;
            w->chk->shadow[l.dst_off + k].w_tid = uint16_t(l.issuer);
        }
    }
    progress();
    if (lands_early(w)) land_load(w, l);
    else sm90(w).loads.push_back(std::move(l));
}

CUSIM_NOSAN inline void land_store(Worker* w, TmaStore& st) {
    if (st.reduce_dst) {   // cp.reduce.async.bulk .add.f32: each float added atomically (blocks run in parallel)
        if (w->chk) check_global_reduce(w, st.reduce_dst, st.bytes);
        for (uint64_t k = 0; k < st.bytes / 4; ++k) {
            float* p = reinterpret_cast<float*>(st.reduce_dst) + k;
            float v;
            std::memcpy(&v, w->arena + st.src_off + 4 * k, 4);
            float old, want;
            __atomic_load(p, &old, __ATOMIC_SEQ_CST);
            do { want = old + v; } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
        }
        add_readers(w, st.src_off, st.bytes, -1);
        return;
    }
    SimTensorMap t;
    std::memcpy(&t, st.map, sizeof t);
    const unsigned sw = 16u * t.swizzle16;
    for_box(t, st.coords, [&](uint64_t e, uint64_t addr) {
        if (!addr) return;   // out of bounds: dropped
        const uint64_t src = swizzle(st.src_off + e * t.elem_bytes, sw);
        if (w->chk) check_access(addr, t.elem_bytes, true);
        std::memcpy(reinterpret_cast<void*>(addr), w->arena + src, t.elem_bytes);
    });
    add_readers(w, st.src_off, st.bytes, -1);
}

// cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group (PTX ISA 9.7.9.25.5.2)
CUSIM_NOSAN inline void tma_store(const void* map, const int32_t* coords, int rank, const void* smem) {
    Worker* w = t_worker;
    const char* what = "cp.async.bulk.tensor (store)";
    const SimTensorMap t = read_map(map, what);
    if (t.rank != rank) fail("%s: a %dd instruction with a rank-%u tensor map", what, rank, unsigned(t.rank));
    check_box_smem(w, smem, t, what);
    TmaStore st;
    st.issuer = w->cur->linear;
    st.group = sm90(w).threads[st.issuer].bulk_committed;
    st.src_off = arena_off(w, smem);
    st.bytes = box_bytes(t);
    std::memcpy(st.map, map, 128);
    for (int i = 0; i < 5; ++i) st.coords[i] = i < rank ? coords[i] : 0;
    check_async_read(w, st.src_off, st.bytes, "cp.async.bulk.tensor (store)");
    add_readers(w, st.src_off, st.bytes, +1);
    progress();
    if (lands_early(w)) land_store(w, st);
    else sm90(w).stores.push_back(st);
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], bytes (PTX ISA 9.7.9.24.7):
// the async proxy adds `bytes` of float32 from shared memory into global memory, element by element;
// both addresses 16-byte aligned and bytes a multiple of 16. It completes with the thread's bulk
// group (commit_group / wait_group{.read}), like a TMA store.
CUSIM_NOSAN inline void bulk_reduce_add_f32(float* dst, const void* smem, uint32_t bytes) {
    Worker* w = t_worker;
    const char* what = "cp.reduce.async.bulk (.add.f32)";
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
    if (d % 16 || bytes % 16 || bytes == 0)
        fail("%s: the global address (0x%llx) must be 16-byte aligned and the size (%u bytes) a positive multiple "
             "of 16", what, (unsigned long long)d, bytes);
    TmaStore st;
    st.issuer = w->cur->linear;
    st.group = sm90(w).threads[st.issuer].bulk_committed;
    st.src_off = arena_off(w, smem);
    if (st.src_off % 16) fail("%s: the shared address (arena offset %llu) must be 16-byte aligned", what,
                              (unsigned long long)st.src_off);
    st.bytes = bytes;
    st.reduce_dst = d;
    WgThread& me = sm90(w).threads[st.issuer];
    me.reduce_groups = st.group + 1;
    if (w->chk && me.acquired) {
        CheckReport r{};
        r.kind = kProxyFence;
        check_fail(w, r, "checked: %s issued after an ld.acquire wait with no fence.proxy.async.global in between: "
                   "the async proxy's read of global memory is not ordered after the acquire", what);
    }
    check_async_read(w, st.src_off, st.bytes, what);
    add_readers(w, st.src_off, st.bytes, +1);
    progress();
    if (lands_early(w)) land_store(w, st);
    else sm90(w).stores.push_back(st);
}

// Checked mode: a plain access of global bytes that a cp.reduce.async.bulk of this block still has
// in flight (issued, its issuer's covering cp.async.bulk.wait_group not yet reached) races with it,
// by any thread of the block, the issuer included (reduce-adds of other blocks: check_global_race).
CUSIM_NOSAN inline void check_reduce_in_flight(Worker* w, uint64_t region, int64_t off, uintptr_t a, uint64_t n,
                                              bool write) {
    for (const TmaStore& st : w->sm90->stores) {
        if (!st.reduce_dst || a + n <= st.reduce_dst || a >= st.reduce_dst + st.bytes) continue;
        const uint64_t first = std::max(a, st.reduce_dst) - a;
        CheckReport r = global_race_report(region, off + int64_t(first), n, write, true);
        r.other_write = 2;   // the other access is a bulk reduce-add in flight (launcher.py words it so)
        block_xyz(w, w->block_linear, r.other_block);
        r.other_valid = 1;
        thread_xyz(w, st.issuer, r.other_thread);
        check_fail(w, r, "checked: global-memory race through argument %u, byte %lld of its region: plain %s here "
                   "while this block's cp.reduce.async.bulk (issued by thread (%u,%u,%u)) is in flight: no "
                   "cp.async.bulk.wait_group of its issuer covers it yet", w->cfg->regions[region].index,
                   (long long)(off + int64_t(first)), write ? "write" : "read", r.other_thread[0], r.other_thread[1],
                   r.other_thread[2]);
    }
}

CUSIM_NOSAN inline void bulk_commit() {
    Worker* w = t_worker;
    ++sm90(w).threads[w->cur->linear].bulk_committed;
}

// cp.async.bulk.wait_group{.read} N: this thread's stores of all but the newest N groups are done
// (with .read: done reading shared memory; here both complete together).
CUSIM_NOSAN inline void bulk_wait(uint32_t pending, bool full = false) {
    Worker* w = t_worker;
    Sm90State& s = sm90(w);
    const unsigned me = w->cur->linear;
    const uint32_t c = s.threads[me].bulk_committed;
    progress();
    if (c < pending) return;
    if (full) s.threads[me].bulk_done = std::max(s.threads[me].bulk_done, c - pending);
    for (size_t i = 0; i < s.stores.size();) {
        if (s.stores[i].issuer == me && s.stores[i].group < c - pending) {
            TmaStore st = s.stores[i];
            s.stores.erase(s.stores.begin() + long(i));
            land_store(w, st);
        } else {
            ++i;
        }
    }
}

// ------------------------------------------------------------------ ordering between blocks
// The deterministic Hopper backward orders its dQ bulk reduce-adds per query tile with a counter in
// global memory (PTX ISA 8.6 "Memory Consistency Model": release / acquire at .gpu scope, and
// "proxies": the async proxy's cp.reduce.async.bulk is ordered with generic accesses only through
// fence.proxy.async).

// fence.proxy.async.global: this thread's generic accesses of global memory before it are ordered
// with its async-proxy ones after it, and the reduce-adds a full wait_group has completed with its
// generic accesses after it.
CUSIM_NOSAN inline void fence_proxy_async_global() {
    Worker* w = t_worker;
    WgThread& t = sm90(w).threads[w->cur->linear];
    t.acquired = false;
    t.global_fenced = t.bulk_done;
    progress();
}

// `while (ld.acquire.gpu.global.s32 [p] != value) ;` The value is another block's to change: the
// thread yields to its block, and the worker sleeps between rounds (blocks run on other workers;
// a lower block index is always taken first, so the awaited block is running or done). The block's
// own watchdog is held off while it waits; a value unchanged for kCrossBlockWaitSeconds of wall time
// is a deadlock.
constexpr double kCrossBlockWaitSeconds = 120.0;
CUSIM_NOSAN inline void wait_eq_acquire(const int* p, int value) {
    Worker* w = t_worker;
    auto start = std::chrono::steady_clock::now();
    int last = 0;
    bool first = true;
    for (;;) {
        int v;
        {
            AtomicScope scope_(const_cast<int*>(p));
            v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        }
        if (v == value) break;
        if (first || v != last) start = std::chrono::steady_clock::now(), last = v, first = false;
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kCrossBlockWaitSeconds)
            fail("deadlock: ld.acquire wait for the value %d at global address %p, which has stayed %d for %.0f s "
                 "(no block adds to it)", value, (const void*)p, v, kCrossBlockWaitSeconds);
        w->idle_polls = 0;
        WgThread& t = sm90(w).threads[w->cur->linear];
        t.wait_what = "ld.acquire (another block's counter)";
        std::this_thread::sleep_for(std::chrono::microseconds(20));
        yield_current();
        t.wait_what = nullptr;
    }
    sm90(w).threads[w->cur->linear].acquired = true;
    progress();
}

// red.release.gpu.global.add.s32 [p], v. Checked: every cp.reduce.async.bulk of the thread must be
// complete (a full cp.async.bulk.wait_group, not .read) and followed by fence.proxy.async.global,
// else the release publishes the counter before the reduce-add's writes.
CUSIM_NOSAN inline void red_release_add(int* p, int v) {
    Worker* w = t_worker;
    WgThread& t = sm90(w).threads[w->cur->linear];
    if (w->chk && t.reduce_groups > t.global_fenced) {
        CheckReport r{};
        r.kind = kAsyncOverlap;
        check_fail(w, r, "checked: red.release after a cp.reduce.async.bulk that no cp.async.bulk.wait_group (not "
                   ".read) followed by fence.proxy.async.global has completed: the counter is published before the "
                   "reduce-add's writes");
    }
    {
        AtomicScope scope_(p);
        __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
    }
    progress();
}

// A thread that exits with stores in flight: they complete (the grid's end waits for them).
CUSIM_NOSAN inline void sm90_thread_exit(Worker* w, unsigned me) {
    Sm90State* s = w->sm90;
    if (!s) return;
    for (size_t i = 0; i < s->stores.size();) {
        if (s->stores[i].issuer == me) {
            if (w->chk) {   // the block's shared memory may be gone before the store has read it
                CheckReport r{};
                r.kind = kAsyncOverlap;
                shared_site(w, s->stores[i].src_off, r);
                check_fail(w, r, "checked: the thread exits with a TMA store or bulk reduce of %s still in flight (no "
                           "cp.async.bulk.commit_group + cp.async.bulk.wait_group covers it): the block's shared "
                           "memory may be released before the store reads it", r.name);
            }
            TmaStore st = s->stores[i];
            s->stores.erase(s->stores.begin() + long(i));
            land_store(w, st);
        } else {
            ++i;
        }
    }
}

// ------------------------------------------------------------------ named barriers
CUSIM_NOSAN inline NamedBar& named_bar(Worker* w, unsigned id, unsigned count, const char* what) {
    if (id < 1 || id >= kNamedBarriers)
        fail("%s: barrier id %u is outside 1..15 (0 is __syncthreads' barrier)", what, id);
    if (count == 0 || count % 32 || count > w->nthreads)
        fail("%s %u: thread count %u is not a positive multiple of 32 up to the block's %u threads", what, id, count,
             w->nthreads);
    NamedBar& b = sm90(w).named[id];
    if (b.arrived && b.count != count)
        fail("%s %u: thread count %u differs from the %u its other threads of this phase gave", what, id, count,
             b.count);
    b.count = count;
    return b;
}

CUSIM_NOSAN inline void named_release(Worker* w, NamedBar& b) {
    if (w->chk) {
        const uint32_t clock = ++w->chk->clock;
        for (uint16_t s : b.syncers) {
            for (uint16_t o : b.syncers) hb_edge(w, o, s, clock);
            for (uint16_t o : b.arrivers) hb_edge(w, o, s, clock);
        }
        b.syncers.clear();
        b.arrivers.clear();
    }
    b.arrived = 0;
    ++b.gen;
    progress();
}

CUSIM_NOSAN inline void bar_sync(unsigned id, unsigned count) {
    Worker* w = t_worker;
    NamedBar& b = named_bar(w, id, count, "bar.sync");
    const unsigned gen = b.gen;
    if (w->chk) b.syncers.push_back(uint16_t(w->cur->linear));
    if (++b.arrived == count) {
        named_release(w, b);
        return;
    }
    progress();
    while (b.gen == gen) spin(w, "bar.sync", id, 0);
}

CUSIM_NOSAN inline void bar_arrive(unsigned id, unsigned count) {
    Worker* w = t_worker;
    NamedBar& b = named_bar(w, id, count, "bar.arrive");
    if (w->chk) {
        ++w->chk->clock;   // this thread's accesses so far precede the release
        b.arrivers.push_back(uint16_t(w->cur->linear));
    }
    if (++b.arrived == count) named_release(w, b);
    progress();
}

// ------------------------------------------------------------------ setmaxnreg
// PTX ISA 9.7.17.1: .sync.aligned over the warpgroup, a multiple of 8 in 24..256, the same value
// in every thread; .dec releases registers to the block's pool, .inc waits until the pool has
// what it asks for (a request no .dec can satisfy hangs a GPU: here a deadlock report).
CUSIM_NOSAN inline void setmaxnreg_compute(Worker* w, WgSlot* slots, unsigned wg) {
    const uint64_t v = slots[0].in[0];
    for (unsigned i = 1; i < kWarpgroup; ++i)
        if (slots[i].in[0] != v)
            fail("setmaxnreg: threads of warpgroup %u ask for different counts (%llu and %llu)", wg,
                 (unsigned long long)(v & 0xffff), (unsigned long long)(slots[i].in[0] & 0xffff));
    (void)w;
}

CUSIM_NOSAN inline void setmaxnreg(unsigned regs, bool inc) {
    Worker* w = t_worker;
    const char* what = inc ? "setmaxnreg.inc" : "setmaxnreg.dec";
    if (regs % 8 || regs < 24 || regs > 256) fail("%s: %u is not a multiple of 8 in 24..256", what, regs);
    const uint64_t v = regs | (uint64_t(inc) << 16);
    wg_rendezvous(&v, sizeof v, &setmaxnreg_compute, what);
    Sm90State& s = sm90(w);
    const unsigned wg = w->cur->linear / kWarpgroup;
    if (w->cur->linear % kWarpgroup != 0) {   // the warpgroup's first thread moves the registers
        while (s.regs[wg] != int(regs)) spin(w, what, wg, regs);
        return;
    }
    const int cur = s.regs[wg];
    if (!inc) {
        if (int(regs) > cur) fail("setmaxnreg.dec: %u is above the warpgroup's current %d registers per thread", regs, cur);
        s.free_regs += int64_t(cur - int(regs)) * kWarpgroup;
        s.regs[wg] = int(regs);
        progress();
        return;
    }
    if (int(regs) < cur) fail("setmaxnreg.inc: %u is below the warpgroup's current %d registers per thread", regs, cur);
    const int64_t need = int64_t(int(regs) - cur) * kWarpgroup;
    while (s.free_regs < need) spin(w, what, wg, regs);
    s.free_regs -= need;
    s.regs[wg] = int(regs);
    progress();
}

// ------------------------------------------------------------------ elect.sync
// One leader among the mask's live lanes (PTX ISA 9.7.13.10: which one is not specified; drawn by
// the seed here, so a kernel that assumes lane 0 shows).
template <int KIND>
CUSIM_NOSAN inline void no_compute_elect(Slot*, unsigned) {}

CUSIM_NOSAN inline bool elect_one(unsigned mask) {
    Worker* w = t_worker;
    unsigned took_part = 0;
    Slot& mine = collective(mask, nullptr, 0, &no_compute_elect<0>, "elect.sync", &took_part);
    (void)mine;
    // every lane of the collective computes the same leader from the collective's generation
    Warp& wp = w->warps[w->cur->warp];
    const Group& g = group_for(wp, mask);
    const unsigned n = unsigned(__builtin_popcount(took_part));
    uint64_t h = w->cfg->seed * 0x9e3779b97f4a7c15ull + g.gen * 0xbf58476d1ce4e5b9ull + w->cur->warp;
    unsigned pick = unsigned(splitmix(h) % std::max(1u, n));
    for (unsigned l = 0; l < 32; ++l)
        if (took_part & (1u << l)) {
            if (pick == 0) return l == w->cur->lane;
            --pick;
        }
    return false;
}

}  // namespace cusim
