/* NCCL on the software GPU: unique ids, rendezvous with a timeout, all-reduce summed in rank
 * order (so every rank gets the same bits), group calls collected per thread, blocking and
 * non-blocking communicators, abort that wakes every waiter. Misuse is a violation, never a hang:
 * two threads inside one communicator, ranks whose collective sequences differ (count, type, op),
 * use of an aborted or destroyed communicator, a collective whose peers never come. */
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "sim.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int ncclResult_t;
enum : ncclResult_t {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
enum { ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64, ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16 };
enum { ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg };

struct ncclUniqueId {
    char internal[128];
};

/* The head of ncclConfig_t, stable since NCCL 2.14. */
struct ConfigHead {
    size_t size;
    unsigned magic;
    unsigned version;
    int blocking;
};
constexpr unsigned kConfigMagic = 0xcafebeef;

namespace {

struct Comm;

/* One collective of a group, as the ranks reach it. */
struct Collective {
    int arrived = 0, left = 0;
    bool done = false;
    std::vector<const void *> send;
    std::vector<void *> recv;
};

struct Signature {
    size_t count;
    int dtype, op;
    bool operator!=(const Signature &o) const { return count != o.count || dtype != o.dtype || op != o.op; }
};

struct Group {
    std::string id;
    int nranks;
    std::vector<Comm *> ranks;
    int joined = 0;
    std::string failure; /* set when the rendezvous failed */
    bool peer_aborted = false;
    std::vector<std::pair<int, Signature>> sequence; /* first rank to issue each collective, and what */
    std::map<uint64_t, Collective> collectives;
};

struct Comm {
    Group *group;
    int rank, device;
    sim::Context *ctx;
    bool blocking;
    bool aborted = false, destroyed = false;
    ncclResult_t async = ncclSuccess;
    uint64_t issued = 0;
    uint64_t pending = 0; /* non-blocking: issued collectives the peers must reach before it is done */
    std::thread::id inside; /* the thread using it now (a call, or a group until its end) */
    std::vector<sim::Stream *> streams; /* where its collectives were enqueued */
    std::string last_error;
};

/* Never destroyed: collectives may still wait on them at exit. */
std::mutex &mutex = *new std::mutex;
std::condition_variable &changed = *new std::condition_variable;
std::map<std::string, Group> &groups = *new std::map<std::string, Group>;

struct Pending {
    Comm *comm;
    const void *send;
    void *recv;
    size_t count;
    int dtype, op;
    sim::Stream *stream;
};
thread_local int group_depth = 0;
thread_local std::vector<Pending> group_pending;

size_t dtype_size(int dtype) {
    switch (dtype) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
    }
}

template <typename T> T combine(T a, T b, int op) {
    switch (op) {
    case ncclSum: return a + b;
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    default: return a < b ? a : b;
    }
}

/* The reduction over every rank in rank order, written to every rank's receive buffer. */
template <typename T> void reduce(Collective &c, size_t count, int op) {
    std::vector<T> sum(count);
    memcpy(sum.data(), c.send[0], count * sizeof(T));
    for (size_t r = 1; r < c.send.size(); ++r) {
        const T *in = static_cast<const T *>(c.send[r]);
        for (size_t i = 0; i < count; ++i) sum[i] = combine(sum[i], in[i], op);
    }
    for (void *out : c.recv) memcpy(out, sum.data(), count * sizeof(T));
}

std::string describe(const Signature &s) {
    return "allreduce(count " + std::to_string(s.count) + ", type " + std::to_string(s.dtype) + ", op " + std::to_string(s.op) + ")";
}

/* Under `mutex`: the communicator is usable by this thread. */
void enter(Comm *c, const char *call) {
    if (c->destroyed) sim::violation("%s on a destroyed communicator (rank %d)", call, c->rank);
    if (c->aborted) sim::violation("%s on an aborted communicator (rank %d): ncclCommAbort frees it", call, c->rank);
    std::thread::id me = std::this_thread::get_id();
    if (c->inside != std::thread::id() && c->inside != me)
        sim::violation("%s: two threads inside one communicator at once (rank %d of group %s)", call, c->rank, c->group->id.c_str());
    c->inside = me;
}

void leave(Comm *c) {
    if (group_depth == 0) c->inside = std::thread::id();
}

/* Under `mutex`: every peer has issued the communicator's collectives so far (the point where
 * real NCCL may have set up its connections and the call is complete on the host). */
bool peers_caught_up(Comm *c) {
    for (Comm *peer : c->group->ranks)
        if (!peer || peer->issued < c->issued) return false;
    return true;
}

/* Under `mutex`, after a call issued collectives: a blocking communicator returns when every peer
 * has issued them too (or on abort); a non-blocking one returns ncclInProgress and
 * ncclCommGetAsyncError says when. */
ncclResult_t finish(Comm *c, std::unique_lock<std::mutex> &lock) {
    changed.notify_all();
    if (!c->blocking) {
        c->pending = c->issued;
        c->async = ncclInProgress;
        return ncclInProgress;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(sim::config().timeout_s);
    if (!changed.wait_until(lock, deadline, [&] { return peers_caught_up(c) || c->aborted || c->group->peer_aborted; }))
        sim::violation("a blocking collective call of rank %d waited %u s for its peers: a hang", c->rank, sim::config().timeout_s);
    return c->aborted || c->group->peer_aborted ? ncclRemoteError : ncclSuccess;
}

/* The collective's stream operation: wait for every rank, the last one reduces for all. */
void enqueue_collective(const Pending &p, uint64_t index) {
    Comm *c = p.comm;
    Group *g = c->group;
    size_t bytes = p.count * dtype_size(p.dtype);
    char what[160];
    snprintf(what, sizeof what, "ncclAllReduce #%llu of rank %d (group %.8s)", (unsigned long long)index, c->rank, g->id.c_str());
    sim::Op op;
    op.what = what;
    op.footprint = [p, bytes, g](sim::Footprint &f) {
        f.access((uint64_t)(uintptr_t)p.send, bytes, false);
        f.access((uint64_t)(uintptr_t)p.recv, bytes, true);
        /* Every peer device in this process reads and writes these buffers. */
        for (Comm *peer : g->ranks)
            if (peer && peer->device != p.comm->device) {
                f.peer_access((uint64_t)(uintptr_t)p.send, bytes, peer->device);
                f.peer_access((uint64_t)(uintptr_t)p.recv, bytes, peer->device);
            }
    };
    op.run = [p, index, g, c] {
        std::unique_lock<std::mutex> lock(mutex);
        Collective &col = g->collectives[index];
        if (col.send.empty()) {
            col.send.assign(g->nranks, nullptr);
            col.recv.assign(g->nranks, nullptr);
        }
        col.send[c->rank] = p.send;
        col.recv[c->rank] = p.recv;
        if (++col.arrived == g->nranks) {
            switch (p.dtype) {
            case ncclFloat32: reduce<float>(col, p.count, p.op); break;
            case ncclFloat64: reduce<double>(col, p.count, p.op); break;
            case ncclUint64: reduce<uint64_t>(col, p.count, p.op); break;
            case ncclInt64: reduce<int64_t>(col, p.count, p.op); break;
            case ncclUint32: reduce<uint32_t>(col, p.count, p.op); break;
            case ncclInt32: reduce<int32_t>(col, p.count, p.op); break;
            default: sim::violation("ncclAllReduce: type %d is not modelled", p.dtype);
            }
            col.done = true;
            changed.notify_all();
        }
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(sim::config().timeout_s);
        bool ok = changed.wait_until(lock, deadline, [&] { return col.done || c->aborted || g->peer_aborted; });
        if (!ok) {
            std::string missing;
            for (int r = 0; r < g->nranks; ++r)
                if (!col.send[r]) missing += " " + std::to_string(r);
            sim::violation("%s waited %u s for ranks%s: a hang", describe({p.count, p.dtype, p.op}).c_str(), sim::config().timeout_s, missing.c_str());
        }
        if (!col.done && !c->aborted) {
            c->async = ncclRemoteError;
            c->last_error = "a peer aborted its communicator";
        }
        if (++col.left == g->nranks) g->collectives.erase(index);
    };
    if (std::find(c->streams.begin(), c->streams.end(), p.stream) == c->streams.end()) c->streams.push_back(p.stream);
    sim::enqueue(p.stream, std::move(op));
}

/* Under `mutex`: joins the group; returns when every rank joined, it failed, or it timed out. */
ncclResult_t rendezvous(std::unique_lock<std::mutex> &lock, Comm *c) {
    Group &g = *c->group;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(sim::config().timeout_s);
    bool ok = changed.wait_until(lock, deadline, [&] { return g.joined == g.nranks || !g.failure.empty() || c->aborted; });
    if (!ok) g.failure = "the rendezvous timed out: " + std::to_string(g.joined) + " of " + std::to_string(g.nranks) + " ranks joined";
    if (c->aborted) return ncclInvalidUsage;
    if (!g.failure.empty()) {
        c->last_error = g.failure;
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

Comm *as_comm(void *handle) { return static_cast<Comm *>(handle); }

} // namespace

EXPORT ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = 22304;
    return ncclSuccess;
}

EXPORT const char *ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

EXPORT const char *ncclGetLastError(void *handle) {
    static thread_local std::string text;
    std::lock_guard<std::mutex> lock(mutex);
    text = handle ? as_comm(handle)->last_error : "";
    return text.c_str();
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ncclInvalidArgument;
    static std::mt19937_64 rng(std::random_device{}());
    static std::mutex id_mutex;
    std::lock_guard<std::mutex> lock(id_mutex);
    memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "simgpu-%016llx", (unsigned long long)rng());
    return ncclSuccess;
}

static ncclResult_t init_rank(void **out, int nranks, ncclUniqueId id, int rank, bool blocking) {
    if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    sim::Context *ctx = sim::current_context();
    if (!ctx) ctx = sim::device(0).primary; /* as the runtime's current device 0 */
    std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
    std::unique_lock<std::mutex> lock(mutex);
    Group &g = groups[key];
    if (g.ranks.empty()) {
        g.id = key;
        g.nranks = nranks;
        g.ranks.assign(nranks, nullptr);
    }
    if (g.nranks != nranks) return ncclInvalidArgument;
    if (g.ranks[rank]) return ncclInvalidUsage;
    auto *c = new Comm{&g, rank, ctx->device->ordinal, ctx, blocking};
    for (Comm *other : g.ranks)
        if (other && other->device == c->device)
            g.failure = "duplicate GPU detected: ranks " + std::to_string(other->rank) + " and " + std::to_string(rank) + " are both on device " +
                        std::to_string(c->device);
    g.ranks[rank] = c;
    g.joined++;
    changed.notify_all();
    *out = c;
    if (blocking) return rendezvous(lock, c);
    c->async = ncclInProgress;
    std::thread([c] {
        std::unique_lock<std::mutex> l(mutex);
        ncclResult_t r = rendezvous(l, c);
        c->async = r;
    }).detach();
    return ncclInProgress;
}

EXPORT ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) { return init_rank(comm, nranks, id, rank, true); }

EXPORT ncclResult_t ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, const ConfigHead *config) {
    bool blocking = true;
    if (config) {
        if (config->magic != kConfigMagic) return ncclInvalidArgument;
        if (config->blocking != INT_MIN) blocking = config->blocking != 0;
    }
    return init_rank(comm, nranks, id, rank, blocking);
}

EXPORT ncclResult_t ncclCommGetAsyncError(void *handle, ncclResult_t *error) {
    if (!handle || !error) return ncclInvalidArgument;
    std::lock_guard<std::mutex> lock(mutex);
    Comm *c = as_comm(handle);
    if (c->destroyed) sim::violation("ncclCommGetAsyncError on a destroyed communicator (rank %d)", c->rank);
    if (c->async == ncclInProgress && c->pending && peers_caught_up(c)) {
        c->pending = 0;
        c->async = ncclSuccess;
    }
    if (c->async == ncclSuccess && c->group->peer_aborted) {
        c->async = ncclRemoteError;
        c->last_error = "a peer aborted its communicator";
    }
    *error = c->async;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommUserRank(void *handle, int *rank) {
    if (!handle || !rank) return ncclInvalidArgument;
    *rank = as_comm(handle)->rank;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommCount(void *handle, int *count) {
    if (!handle || !count) return ncclInvalidArgument;
    *count = as_comm(handle)->group->nranks;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommCuDevice(void *handle, int *device) {
    if (!handle || !device) return ncclInvalidArgument;
    *device = as_comm(handle)->device;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupStart() {
    group_depth++;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupEnd() {
    if (group_depth == 0) return ncclInvalidUsage;
    if (--group_depth > 0) return ncclSuccess;
    std::vector<Pending> pending;
    pending.swap(group_pending);
    std::unique_lock<std::mutex> lock(mutex);
    ncclResult_t result = ncclSuccess;
    std::vector<Comm *> used;
    for (const Pending &p : pending) {
        if (p.comm->aborted) sim::violation("ncclGroupEnd: a collective of rank %d's communicator, which was aborted inside the group", p.comm->rank);
        enqueue_collective(p, p.comm->issued++);
        if (std::find(used.begin(), used.end(), p.comm) == used.end()) used.push_back(p.comm);
    }
    for (Comm *c : used) {
        ncclResult_t r = finish(c, lock);
        c->inside = std::thread::id();
        if (r != ncclSuccess && result == ncclSuccess) result = r;
    }
    return result;
}

EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, void *handle, void *stream_handle) {
    if (!handle) return ncclInvalidArgument;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    enter(c, "ncclAllReduce");
    auto fail = [&](ncclResult_t r, std::string why) {
        c->last_error = std::move(why);
        leave(c);
        return r;
    };
    if (c->async != ncclSuccess && c->async != ncclInProgress) return fail(c->async, "the communicator has an asynchronous error");
    if (dtype < ncclInt8 || dtype > ncclBfloat16 || op < ncclSum || op > ncclAvg) return fail(ncclInvalidArgument, "bad type or op");
    sim::Stream *stream = sim::resolve_stream(stream_handle, c->ctx);
    if (!stream) return fail(ncclInvalidArgument, "the stream is not of the communicator's device");
    size_t bytes = count * dtype_size(dtype);
    std::string why;
    for (const void *buf : {send, (const void *)recv})
        if (bytes && !sim::find_live((uint64_t)(uintptr_t)buf, bytes, c->device, &why))
            sim::violation("ncclAllReduce of rank %d: %s", c->rank, why.c_str());
    /* Every rank must issue the same collectives in the same order. */
    Group &g = *c->group;
    uint64_t index = c->issued + (group_depth > 0 ? std::count_if(group_pending.begin(), group_pending.end(), [&](const Pending &p) { return p.comm == c; }) : 0);
    Signature sig{count, dtype, op};
    if (index < g.sequence.size()) {
        if (g.sequence[index].second != sig)
            sim::violation("collective #%llu differs between ranks: rank %d issued %s, rank %d issues %s", (unsigned long long)index,
                           g.sequence[index].first, describe(g.sequence[index].second).c_str(), c->rank, describe(sig).c_str());
    } else {
        g.sequence.emplace_back(c->rank, sig);
    }
    Pending p{c, send, recv, count, dtype, op, stream};
    if (group_depth > 0) {
        group_pending.push_back(p);
        return ncclSuccess;
    }
    enqueue_collective(p, c->issued++);
    ncclResult_t r = finish(c, lock);
    leave(c);
    return r;
}

/* Waits (host) for the communicator's collectives to leave their streams. */
static void drain(Comm *c, std::unique_lock<std::mutex> &lock) {
    std::vector<sim::Stream *> streams = c->streams;
    lock.unlock();
    for (sim::Stream *s : streams) sim::host_wait(s);
    lock.lock();
}

EXPORT ncclResult_t ncclCommFinalize(void *handle) {
    if (!handle) return ncclInvalidArgument;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    enter(c, "ncclCommFinalize");
    if (c->blocking) {
        drain(c, lock);
        leave(c);
        return ncclSuccess;
    }
    /* Non-blocking: returns at once; ncclCommGetAsyncError says when the collectives are done. */
    c->async = ncclInProgress;
    c->pending = 0;
    leave(c);
    std::thread([c] {
        std::unique_lock<std::mutex> l(mutex);
        drain(c, l);
        if (c->async == ncclInProgress) c->async = ncclSuccess;
    }).detach();
    return ncclInProgress;
}

EXPORT ncclResult_t ncclCommDestroy(void *handle) {
    if (!handle) return ncclSuccess;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    enter(c, "ncclCommDestroy");
    /* A collective still waiting for a peer that failed never ends: reported as a hang. */
    drain(c, lock);
    c->destroyed = true;
    c->inside = std::thread::id();
    return ncclSuccess;
}

/* The one call allowed while another thread is inside the communicator. */
EXPORT ncclResult_t ncclCommAbort(void *handle) {
    if (!handle) return ncclSuccess;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    if (c->destroyed || c->aborted) sim::violation("ncclCommAbort on a communicator already %s (rank %d)", c->destroyed ? "destroyed" : "aborted", c->rank);
    c->aborted = true;
    c->group->peer_aborted = true;
    changed.notify_all();
    /* Its pending collectives end (they read the flag); the handle is dead from here. */
    drain(c, lock);
    return ncclSuccess;
}
