/* Devices, memory and streams of the software GPU.
 *
 * Memory: every allocation is host memory filled with poison (0xff: NaN as f32) and, once freed,
 * poisoned again and kept in a quarantine, so a stale read sees NaN and a stale pointer is named.
 * Streams: one worker thread each, running operations in order after the operations they wait
 * for. Races: each operation gets a vector clock when it is enqueued (stream order, events, the
 * legacy stream's rule, host synchronisation); when it runs, every byte range it touches is
 * compared with the earlier accesses of other streams, and an access not ordered before it that
 * overlaps and writes is a race, whatever order the workers happened to run in. */
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "sim.h"

namespace sim {

void violation(const char *fmt, ...) {
    char text[2048];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    fprintf(stderr, "\nsimgpu: %s\n", text);
    fflush(stderr);
    abort();
}

static unsigned env_unsigned(const char *name, unsigned fallback) {
    const char *v = getenv(name);
    return v && *v ? (unsigned)strtoul(v, nullptr, 10) : fallback;
}

const Config &config() {
    static const Config c = [] {
        Config c;
        c.devices = (int)env_unsigned("SIMGPU_DEVICES", 2);
        c.sms = std::max(1, (int)env_unsigned("SIMGPU_SMS", 2));
        unsigned cc = env_unsigned("SIMGPU_CC", 80);
        c.cc_major = (int)cc / 10;
        c.cc_minor = (int)cc % 10;
        c.memory_pools = env_unsigned("SIMGPU_MEMORY_POOLS", 1) != 0;
        c.delay_us = env_unsigned("SIMGPU_DELAY_US", 0);
        c.timeout_s = env_unsigned("SIMGPU_TIMEOUT_S", 60);
        c.driver_version = (int)env_unsigned("SIMGPU_DRIVER_VERSION", 12080);
        c.reset_refuses_push = env_unsigned("SIMGPU_RESET_REFUSES_PUSH", 0) != 0;
        return c;
    }();
    return c;
}

void join(Clock &into, const Clock &other) {
    for (auto &[s, v] : other) {
        auto &mine = into[s];
        mine = std::max(mine, v);
    }
}

/* ---- Memory ---- */

namespace {

struct Record {
    uint64_t lo, hi;
    bool write;
    uint32_t stream;
    uint64_t seq;
    std::string what;
};

struct Alloc {
    uint64_t base, bytes;
    int device;
    bool pool;
    bool free_enqueued = false;
    bool dead = false;
    uint64_t id = 0;
    bool reset = false; /* freed by a primary context reset */
    std::vector<Record> records;
};

/* Process-lifetime state is never destroyed: stream workers may still wait on it at exit. */
std::mutex &memory_mutex = *new std::mutex;
std::map<uint64_t, Alloc> &allocations = *new std::map<uint64_t, Alloc>; /* by base address, live and quarantined */
std::deque<uint64_t> &quarantine = *new std::deque<uint64_t>;
uint64_t quarantined_bytes = 0;
constexpr uint64_t kQuarantineBytes = 1ull << 30;

Alloc *containing(uint64_t ptr) {
    auto it = allocations.upper_bound(ptr);
    if (it == allocations.begin()) return nullptr;
    --it;
    Alloc &a = it->second;
    return ptr < a.base + std::max<uint64_t>(a.bytes, 1) ? &a : nullptr;
}

/* Null with the reason when [ptr, ptr + bytes) is not inside one live allocation of `device`.
 * When an operation is enqueued its memory must not have a free enqueued already; when it runs,
 * the memory must not be freed yet (a free enqueued later but unordered is the race detector's). */
Alloc *check_range(uint64_t ptr, uint64_t bytes, int device, std::string *why, bool enqueuing) {
    Alloc *a = containing(ptr);
    char text[256];
    if (!a) {
        snprintf(text, sizeof text, "%#llx is not inside any allocation", (unsigned long long)ptr);
    } else if (a->dead || (enqueuing && a->free_enqueued)) {
        snprintf(text, sizeof text, "%#llx is inside an allocation of %llu bytes at %#llx that was freed", (unsigned long long)ptr,
                 (unsigned long long)a->bytes, (unsigned long long)a->base);
    } else if (ptr + bytes > a->base + a->bytes) {
        snprintf(text, sizeof text, "[%#llx, +%llu) runs %llu bytes past the end of the allocation of %llu bytes at %#llx", (unsigned long long)ptr,
                 (unsigned long long)bytes, (unsigned long long)(ptr + bytes - a->base - a->bytes), (unsigned long long)a->bytes,
                 (unsigned long long)a->base);
    } else if (device >= 0 && a->device != device) {
        snprintf(text, sizeof text, "%#llx is memory of device %d, not device %d", (unsigned long long)ptr, a->device, device);
    } else {
        return a;
    }
    if (why) *why = text;
    return nullptr;
}

} // namespace

uint64_t allocate(int dev, uint64_t bytes, bool pool) {
    void *p = aligned_alloc(256, (std::max<uint64_t>(bytes, 1) + 255) / 256 * 256);
    if (!p) return 0;
    memset(p, 0xff, bytes);
    std::lock_guard<std::mutex> lock(memory_mutex);
    uint64_t base = (uint64_t)(uintptr_t)p;
    allocations.erase(base); /* a quarantined block the allocator handed out again */
    static uint64_t ids = 0;
    Alloc a{base, bytes, dev, pool};
    a.id = ++ids;
    allocations.emplace(base, std::move(a));
    return base;
}

uint64_t buffer_id(uint64_t ptr) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    Alloc *a = check_range(ptr, 0, -1, nullptr, false);
    return a ? a->id : 0;
}

bool freed_by_reset(uint64_t ptr) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    Alloc *a = containing(ptr);
    return a && a->reset;
}

uint64_t find_live(uint64_t ptr, uint64_t bytes, int dev, std::string *why) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    Alloc *a = check_range(ptr, bytes, dev, why, true);
    return a ? a->base : 0;
}

bool mark_free_enqueued(uint64_t base) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    auto it = allocations.find(base);
    if (it == allocations.end() || it->second.free_enqueued) return false;
    it->second.free_enqueued = true;
    return true;
}

uint64_t allocation_bytes(uint64_t base) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    auto it = allocations.find(base);
    return it == allocations.end() ? 0 : it->second.bytes;
}

namespace {

/* Under memory_mutex: frees `a` as a free does when it executes. */
void release_locked(Alloc &a);

} // namespace

void release(uint64_t base) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    release_locked(allocations.at(base));
}

namespace {

void release_locked(Alloc &a) {
    uint64_t base = a.base;
    memset((void *)(uintptr_t)a.base, 0xff, a.bytes);
    a.dead = true;
    a.records.clear();
    quarantine.push_back(base);
    quarantined_bytes += a.bytes;
    while (quarantined_bytes > kQuarantineBytes) {
        uint64_t oldest = quarantine.front();
        quarantine.pop_front();
        auto it = allocations.find(oldest);
        quarantined_bytes -= it->second.bytes;
        free((void *)(uintptr_t)oldest);
        allocations.erase(it);
    }
}

} // namespace

namespace {

/* Under memory_mutex: `device` may touch `a` (its own memory, another device's plain memory, or
 * another device's pool memory the pool granted it). */
void check_reach(const Alloc *a, uint64_t ptr, int device, const std::string &what) {
    if (a->device != device && a->pool && !sim::device(a->device).pool_access[device])
        violation("%s: device %d touches %#llx, a stream-ordered allocation of device %d whose pool did not grant it access (cuMemPoolSetAccess)",
                  what.c_str(), device, (unsigned long long)ptr, a->device);
}

} // namespace

void Footprint::peer_access(uint64_t ptr, uint64_t bytes, int peer) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    std::string why;
    Alloc *a = check_range(ptr, bytes, -1, &why, false);
    if (!a) violation("%s: %s", what_.c_str(), why.c_str());
    check_reach(a, ptr, peer, what_);
}

void Footprint::access(uint64_t ptr, uint64_t bytes, bool write) {
    if (ptr == 0 && bytes == 0) return;
    std::lock_guard<std::mutex> lock(memory_mutex);
    std::string why;
    Alloc *a = check_range(ptr, bytes, -1, &why, false);
    if (!a) violation("%s %s: %s", what_.c_str(), write ? "writes" : "reads", why.c_str());
    check_reach(a, ptr, device_, what_);
    if (bytes == 0) return;
    uint64_t lo = ptr, hi = ptr + bytes;
    auto &records = a->records;
    for (const Record &r : records) {
        if (r.hi <= lo || hi <= r.lo || !(write || r.write) || r.stream == stream_) continue;
        auto seen = clock_->find(r.stream);
        if (seen != clock_->end() && seen->second >= r.seq) continue;
        violation("race on [%#llx, +%llu) of the allocation at %#llx: %s %s it, unordered with the earlier %s that %s it (no event or "
                  "synchronisation between them)",
                  (unsigned long long)std::max(lo, r.lo), (unsigned long long)(std::min(hi, r.hi) - std::max(lo, r.lo)), (unsigned long long)a->base,
                  what_.c_str(), write ? "writes" : "reads", r.what.c_str(), r.write ? "wrote" : "read");
    }
    /* Earlier accesses this one covers and that are ordered before it can go. */
    records.erase(std::remove_if(records.begin(), records.end(),
                                 [&](const Record &r) {
                                     if (r.lo < lo || r.hi > hi || (r.write && !write)) return false;
                                     if (r.stream == stream_) return true;
                                     auto seen = clock_->find(r.stream);
                                     return write && seen != clock_->end() && seen->second >= r.seq;
                                 }),
                  records.end());
    records.push_back(Record{lo, hi, write, stream_, seq_, what_});
}

/* ---- Streams ---- */

struct QueuedOp {
    uint64_t seq;
    Clock clock;
    std::vector<std::pair<Stream *, uint64_t>> waits;
    Op op;
};

struct Stream {
    uint32_t id;
    Context *ctx;
    bool blocking; /* synchronises with the legacy stream */
    bool legacy = false;
    std::deque<QueuedOp> queue;
    uint64_t enqueued = 0, completed = 0;
    Clock clock;
    bool stopping = false;
    std::thread worker;
    std::unique_ptr<Graph> capture; /* while capturing */
    bool capture_invalid = false;
    uint64_t capture_id = 0;
    bool gone = false; /* destroyed by a primary context reset: its handle is invalid */
};

namespace {

std::mutex &stream_mutex = *new std::mutex;
std::condition_variable &progress = *new std::condition_variable;
uint32_t next_stream_id = 1;
std::vector<Stream *> &all_streams = *new std::vector<Stream *>; /* every created stream, for a context reset */
Clock &host_clock = *new Clock; /* what any host thread has seen complete (cuStreamSynchronize and friends) */

void run_worker(Stream *s) {
    std::mt19937 rng((unsigned)s->id * 7919u + 17u);
    std::unique_lock<std::mutex> lock(stream_mutex);
    for (;;) {
        progress.wait(lock, [&] { return !s->queue.empty() || s->stopping; });
        if (s->queue.empty()) return;
        QueuedOp &q = s->queue.front();
        for (auto &[other, seq] : q.waits) {
            auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(config().timeout_s);
            if (!progress.wait_until(lock, deadline, [&] { return other->completed >= seq; }))
                violation("stream %u waited %u s for operation %llu of stream %u (before %s)", s->id, config().timeout_s, (unsigned long long)seq,
                          other->id, q.op.what.c_str());
        }
        QueuedOp op = std::move(q);
        s->queue.pop_front();
        lock.unlock();
        if (config().delay_us) std::this_thread::sleep_for(std::chrono::microseconds(rng() % config().delay_us));
        if (op.op.footprint) {
            Footprint f(s->ctx->device->ordinal, op.op.what + " (stream " + std::to_string(s->id) + " op " + std::to_string(op.seq) + ")", s->id,
                        op.seq, &op.clock);
            op.op.footprint(f);
        }
        if (op.op.run) op.op.run();
        lock.lock();
        s->completed = op.seq;
        progress.notify_all();
    }
}

Stream *new_stream(Context *ctx, bool blocking, bool legacy) {
    auto *s = new Stream; /* never deleted: an event may still name it */
    std::lock_guard<std::mutex> lock(stream_mutex);
    s->id = next_stream_id++;
    s->ctx = ctx;
    s->blocking = blocking;
    s->legacy = legacy;
    s->worker = std::thread(run_worker, s);
    if (blocking && !legacy) ctx->streams.push_back(s);
    if (!legacy) all_streams.push_back(s);
    return s;
}

thread_local std::map<Context *, Stream *> per_thread_streams;

} // namespace

Stream *create_stream(Context *ctx, bool blocking) { return new_stream(ctx, blocking, false); }

void destroy_stream(Stream *s) {
    {
        std::lock_guard<std::mutex> lock(stream_mutex);
        auto &list = s->ctx->streams;
        list.erase(std::remove(list.begin(), list.end(), s), list.end());
        s->stopping = true;
        progress.notify_all();
    }
    s->worker.join(); /* pending work completes first, as cuStreamDestroy promises */
}

Stream *resolve_stream(void *handle, Context *ctx) {
    uintptr_t h = (uintptr_t)handle;
    if (!ctx) return nullptr;
    if (h == 0 || h == 1) {
        std::lock_guard<std::mutex> lock(stream_mutex);
        return ctx->legacy;
    }
    if (h == 2) {
        Stream *&s = per_thread_streams[ctx];
        if (!s) s = new_stream(ctx, true, false);
        return s;
    }
    std::lock_guard<std::mutex> lock(stream_mutex);
    auto *s = static_cast<Stream *>(handle);
    return s->ctx == ctx && !s->gone ? s : nullptr;
}

namespace {

/* Under stream_mutex: the next operation's clock and waits on `s`. */
QueuedOp &push(Stream *s) {
    std::vector<std::pair<Stream *, uint64_t>> waits;
    join(s->clock, host_clock);
    if (s->legacy) {
        for (Stream *t : s->ctx->streams)
            if (t->enqueued) {
                waits.emplace_back(t, t->enqueued);
                join(s->clock, t->clock);
            }
    } else if (s->blocking && s->ctx->legacy->enqueued) {
        Stream *l = s->ctx->legacy;
        waits.emplace_back(l, l->enqueued);
        join(s->clock, l->clock);
    }
    uint64_t seq = ++s->enqueued;
    s->clock[s->id] = seq;
    s->queue.push_back(QueuedOp{seq, s->clock, std::move(waits), Op{}});
    return s->queue.back();
}

} // namespace

uint64_t enqueue(Stream *s, Op op) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    if (s->capture) {
        s->capture->push_back(std::move(op));
        return s->enqueued;
    }
    QueuedOp &q = push(s);
    q.op = std::move(op);
    progress.notify_all();
    return q.seq;
}

void enqueue_wait(Stream *s, Stream *other, uint64_t seq, const Clock &clock) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    if (s->capture) {
        /* cuStreamWaitEvent sorts out waits during a capture; any other wait cannot be captured. */
        s->capture_invalid = true;
        return;
    }
    join(s->clock, clock);
    QueuedOp &q = push(s);
    q.op.what = "cuStreamWaitEvent";
    if (other != s) q.waits.emplace_back(other, seq);
    progress.notify_all();
}

void host_wait(Stream *s, uint64_t seq) {
    std::unique_lock<std::mutex> lock(stream_mutex);
    if (seq == 0) seq = s->enqueued;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(config().timeout_s);
    if (!progress.wait_until(lock, deadline, [&] { return s->completed >= seq; }))
        violation("the host waited %u s for stream %u (operation %llu; a collective whose peers never came?)", config().timeout_s, s->id,
                  (unsigned long long)seq);
    Clock seen = s->clock;
    for (auto &[id, v] : seen)
        if (id == s->id) v = seq;
    join(host_clock, seen);
}

bool begin_capture(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    static uint64_t captures = 0;
    if (s->capture) return false;
    s->capture = std::make_unique<Graph>();
    s->capture_invalid = false;
    s->capture_id = ++captures;
    return true;
}

std::unique_ptr<Graph> end_capture(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    std::unique_ptr<Graph> g = std::move(s->capture);
    if (s->capture_invalid) g.reset();
    s->capture_invalid = false;
    s->capture_id = 0;
    return g;
}

int capture_status(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    return s->capture ? (s->capture_invalid ? 2 : 1) : 0;
}

uint64_t capture_id(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    return s->capture ? s->capture_id : 0;
}

void invalidate_capture(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    if (s->capture) s->capture_invalid = true;
}

bool done(Stream *s, uint64_t seq) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    return s->completed >= seq;
}

uint64_t last_enqueued(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    return s->enqueued;
}

Clock clock_of(Stream *s) {
    std::lock_guard<std::mutex> lock(stream_mutex);
    return s->clock;
}

void device_synchronize(int dev) {
    std::vector<Stream *> streams;
    Context *ctx = device(dev).primary;
    {
        std::lock_guard<std::mutex> lock(stream_mutex);
        streams = ctx->streams;
        streams.push_back(ctx->legacy);
    }
    for (Stream *s : streams) host_wait(s);
}

void reset_context(Context *ctx) {
    int dev = ctx->device->ordinal;
    /* Every stream of the context drained first, as the driver synchronises the device. */
    std::vector<Stream *> streams;
    {
        std::lock_guard<std::mutex> lock(stream_mutex);
        for (Stream *s : all_streams)
            if (s->ctx == ctx && !s->gone) streams.push_back(s);
        streams.push_back(ctx->legacy);
    }
    for (Stream *s : streams) host_wait(s);
    {
        std::lock_guard<std::mutex> lock(stream_mutex);
        for (Stream *s : all_streams)
            if (s->ctx == ctx) s->gone = true;
        ctx->streams.clear();
    }
    std::lock_guard<std::mutex> lock(memory_mutex);
    /* Released by base: a release may drop the oldest quarantined allocations from the map. */
    std::vector<uint64_t> live;
    for (auto &[base, a] : allocations)
        if (a.device == dev && !a.dead) live.push_back(base);
    for (uint64_t base : live) {
        Alloc &a = allocations.at(base);
        a.reset = true;
        release_locked(a);
    }
    auto &access = ctx->device->pool_access;
    for (size_t d = 0; d < access.size(); ++d) access[d] = (int)d == dev;
}

/* ---- Devices and contexts ---- */

Device &device(int ordinal) {
    static std::vector<Device> *devices = [] {
        auto *d = new std::vector<Device>(config().devices);
        for (int i = 0; i < config().devices; ++i) {
            (*d)[i].ordinal = i;
            (*d)[i].pool_access.assign(config().devices, false);
            (*d)[i].pool_access[i] = true;
            (*d)[i].primary = new Context{&(*d)[i], nullptr, {}};
        }
        for (auto &dev : *d) dev.primary->legacy = new_stream(dev.primary, true, true);
        return d;
    }();
    return (*devices)[ordinal];
}

} // namespace sim
