/* Thread blocks on the host: every CUDA thread of a block is a fiber (ucontext) on the calling
 * OS thread, scheduled cooperatively. __syncthreads releases when every thread that has not exited
 * arrived; __shfl_down_sync exchanges through per-warp slots and releases when the warp's 32 lanes
 * arrived. A barrier that can never release (divergent barriers, a shuffle with exited lanes) is
 * reported instead of hanging. */
#include <sys/mman.h>
#include <ucontext.h>

#include <cstring>

#include "sim.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SIM_SANITIZED 1
#endif
#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#endif
#ifdef __SANITIZE_THREAD__
#include <sanitizer/tsan_interface.h>
#endif

namespace sim {
namespace {

constexpr size_t kStack = 256 * 1024;
constexpr unsigned kWarp = 32;

enum class State { Ready, AtBarrier, AtShuffle, Done };

struct Fiber {
    ucontext_t context;
    char *stack = nullptr;
    State state = State::Ready;
    unsigned tid = 0;
    int predicate = 0;
#ifdef __SANITIZE_THREAD__
    void *tsan = nullptr;
#endif
};

struct Warp {
    uint64_t slots[2][kWarp];
    unsigned generation = 0;
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    ucontext_t scheduler;
    Fiber *current = nullptr;
    Dim3 grid, index, dim;
    const std::function<void()> *body = nullptr;
    int barrier_result = 0;
#ifdef __SANITIZE_THREAD__
    void *tsan_scheduler = nullptr;
#endif
};

thread_local Block *tl_block = nullptr;

/* One stack per fiber, kept for the OS thread's life and reused by every block it runs. */
struct Stacks {
    std::vector<char *> stacks;
    ~Stacks() {
        for (char *s : stacks) munmap(s, kStack);
    }
    char *get(size_t i) {
        while (stacks.size() <= i) {
            void *p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) violation("cannot map a fiber stack");
            stacks.push_back(static_cast<char *>(p));
        }
        return stacks[i];
    }
};
thread_local Stacks tl_stacks;

/* Switches from `from` to `to`, telling the sanitizers about the stack change. */
void switch_to(ucontext_t *from, ucontext_t *to, const char *to_stack, size_t to_size, void *tsan_to) {
#ifdef __SANITIZE_ADDRESS__
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, to_stack, to_size);
#else
    (void)to_stack;
    (void)to_size;
#endif
#ifdef __SANITIZE_THREAD__
    __tsan_switch_to_fiber(tsan_to, 0);
#else
    (void)tsan_to;
#endif
    swapcontext(from, to);
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void yield_to_scheduler() {
    Block *b = tl_block;
    Fiber *f = b->current;
#ifdef __SANITIZE_THREAD__
    void *to = b->tsan_scheduler;
#else
    void *to = nullptr;
#endif
    /* The scheduler runs on the OS thread's own stack: no bounds to announce. */
    switch_to(&f->context, &b->scheduler, nullptr, 0, to);
}

void fiber_entry() {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    Block *b = tl_block;
    (*b->body)();
    b->current->state = State::Done;
    yield_to_scheduler();
    violation("a finished fiber was resumed");
}

const char *state_name(State s) {
    switch (s) {
    case State::Ready: return "running";
    case State::AtBarrier: return "at __syncthreads";
    case State::AtShuffle: return "at __shfl_down_sync";
    case State::Done: return "exited";
    }
    return "?";
}

/* Releases what can be released; false when nothing can (a deadlock). */
bool release(Block &b) {
    size_t alive = 0, at_barrier = 0;
    for (auto &f : b.fibers) {
        alive += f.state != State::Done;
        at_barrier += f.state == State::AtBarrier;
    }
    bool released = false;
    for (size_t w = 0; w < b.warps.size(); ++w) {
        size_t lanes = 0, waiting = 0;
        for (size_t t = w * kWarp; t < std::min(b.fibers.size(), (w + 1) * kWarp); ++t) {
            ++lanes;
            waiting += b.fibers[t].state == State::AtShuffle;
        }
        if (waiting == 0) continue;
        if (waiting == kWarp) {
            b.warps[w].generation++;
            for (size_t t = w * kWarp; t < (w + 1) * kWarp; ++t) b.fibers[t].state = State::Ready;
            released = true;
        } else if (lanes < kWarp) {
            violation("__shfl_down_sync with a full mask in a partial warp (%zu threads)", lanes);
        }
    }
    if (released) return true;
    if (alive > 0 && at_barrier == alive) {
        int any = 0;
        for (auto &f : b.fibers) any |= f.state == State::AtBarrier && f.predicate;
        b.barrier_result = any;
        for (auto &f : b.fibers)
            if (f.state == State::AtBarrier) f.state = State::Ready;
        return true;
    }
    return false;
}

} // namespace

void run_block(Dim3 grid, Dim3 index, Dim3 dim, const std::function<void()> &body) {
    Block b;
    b.grid = grid;
    b.index = index;
    b.dim = dim;
    b.body = &body;
    size_t threads = (size_t)dim.x * dim.y * dim.z;
    b.fibers.resize(threads);
    b.warps.resize((threads + kWarp - 1) / kWarp);
    Block *outer = tl_block;
    tl_block = &b;
#ifdef __SANITIZE_THREAD__
    b.tsan_scheduler = __tsan_get_current_fiber();
#endif
    for (size_t t = 0; t < threads; ++t) {
        Fiber &f = b.fibers[t];
        f.tid = (unsigned)t;
        f.stack = tl_stacks.get(t);
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack;
        f.context.uc_stack.ss_size = kStack;
        f.context.uc_link = nullptr;
        makecontext(&f.context, fiber_entry, 0);
#ifdef __SANITIZE_THREAD__
        f.tsan = __tsan_create_fiber(0);
#endif
    }
    for (;;) {
        bool ran = false;
        for (auto &f : b.fibers) {
            if (f.state != State::Ready) continue;
            b.current = &f;
#ifdef __SANITIZE_THREAD__
            void *to = f.tsan;
#else
            void *to = nullptr;
#endif
            switch_to(&b.scheduler, &f.context, f.stack, kStack, to);
            ran = true;
        }
        bool finished = true;
        for (auto &f : b.fibers) finished &= f.state == State::Done;
        if (finished) break;
        if (!release(b) && !ran) {
            std::string states;
            for (auto &f : b.fibers)
                if (f.state != State::Done)
                    states += " thread " + std::to_string(f.tid) + " " + state_name(f.state) + ";";
            violation("block (%u,%u,%u) deadlocked:%s", index.x, index.y, index.z, states.substr(0, 400).c_str());
        }
    }
#ifdef __SANITIZE_THREAD__
    for (auto &f : b.fibers) __tsan_destroy_fiber(f.tsan);
#endif
    tl_block = outer;
}

Dim3 thread_idx() {
    Block *b = tl_block;
    unsigned t = b->current->tid;
    return Dim3{t % b->dim.x, (t / b->dim.x) % b->dim.y, t / (b->dim.x * b->dim.y)};
}
Dim3 block_idx() { return tl_block->index; }
Dim3 block_dim() { return tl_block->dim; }
Dim3 grid_dim() { return tl_block->grid; }

int barrier(int predicate) {
    Block *b = tl_block;
    b->current->predicate = predicate != 0;
    b->current->state = State::AtBarrier;
    yield_to_scheduler();
    return b->barrier_result;
}

uint64_t shuffle_down(uint64_t bits, unsigned mask, unsigned delta, int width) {
    Block *b = tl_block;
    if (mask != 0xffffffffu) violation("__shfl_down_sync with mask %#x: the kernels only use full warps", mask);
    if (width <= 0 || width > (int)kWarp || (width & (width - 1)) != 0) violation("__shfl_down_sync width %d", width);
    unsigned tid = b->current->tid, lane = tid % kWarp;
    Warp &w = b->warps[tid / kWarp];
    unsigned g = w.generation & 1;
    w.slots[g][lane] = bits;
    b->current->state = State::AtShuffle;
    yield_to_scheduler();
    unsigned segment = lane / (unsigned)width * (unsigned)width;
    unsigned source = lane + delta;
    return source < segment + (unsigned)width ? w.slots[g][source] : w.slots[g][lane];
}

} // namespace sim
