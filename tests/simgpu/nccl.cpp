/* NCCL on the software GPU: unique ids, rendezvous with a timeout, all-reduce, reduce-scatter and
 * reduce summed in rank order (so every rank gets the same bits, and a reduce-scatter's or a
 * reduce's elements are the all-reduce's), all-gather, point-to-point send and receive, group
 * calls collected per thread, blocking and non-blocking communicators, ncclCommSplit, abort that
 * wakes every waiter. Misuse is a violation, never a hang: two threads inside one communicator, ranks whose
 * collective sequences differ (kind, count, type, op, root), a send whose receive differs (count,
 * type) or never comes, send and receive buffers that overlap other than in place, use of an
 * aborted or destroyed communicator, a collective whose peers never come. */
#include <chrono>
#include <climits>
#include <algorithm>
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

/* The collectives modelled; `count` is what the call's count argument means for each: the
 * all-reduce's and the reduce's elements, the reduce-scatter's receive count, the all-gather's
 * send count. */
enum Kind { kAllReduce, kReduceScatter, kAllGather, kReduce };

const char *kind_name(int kind) {
    switch (kind) {
    case kAllReduce: return "ncclAllReduce";
    case kReduceScatter: return "ncclReduceScatter";
    case kAllGather: return "ncclAllGather";
    default: return "ncclReduce";
    }
}

struct Signature {
    int kind;
    size_t count;
    int dtype, op, root; /* op and root only where the call takes them (else 0) */
    bool operator!=(const Signature &o) const {
        return kind != o.kind || count != o.count || dtype != o.dtype || op != o.op || root != o.root;
    }
};

/* One point-to-point message: the n-th send from one rank to another pairs with the n-th receive
 * of the other from the one (NCCL's order per pair of ranks). */
struct Message {
    bool sent = false, received = false; /* each side issued */
    size_t count = 0;
    int dtype = 0;
    const void *data = nullptr; /* the send buffer, once the sender's stream reached it */
    bool copied = false;
};

/* The messages from one rank to another, by their index in that order. */
struct Channel {
    uint64_t sends = 0, receives = 0;
    std::map<uint64_t, Message> messages;
};

/* One ncclCommSplit of a communicator's ranks (the n-th of each rank pairs with the n-th of the
 * others): each rank's color and key, kept until every rank has read them. */
struct SplitRound {
    std::vector<std::pair<int, int>> picks;
    int arrived = 0, left = 0;
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
    std::map<std::pair<int, int>, Channel> channels; /* (from, to) */
    std::map<uint64_t, SplitRound> splits;
};

struct Comm {
    Group *group;
    int rank, device;
    sim::Context *ctx;
    bool blocking;
    bool aborted = false, destroyed = false;
    ncclResult_t async = ncclSuccess;
    uint64_t issued = 0;
    uint64_t splits = 0; /* ncclCommSplit calls so far */
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
    Signature sig;
    sim::Stream *stream;
};
thread_local int group_depth = 0;
thread_local std::vector<Pending> group_pending;

/* A send or receive of one rank, as issued (its message's index in its channel). */
struct P2p {
    Comm *comm;
    bool send;
    int peer;
    uint64_t index;
    const void *send_buf;
    void *recv_buf;
    size_t bytes;
    sim::Stream *stream;
};
thread_local std::vector<P2p> group_p2p;

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

/* Bytes a rank's send and receive buffers span in a collective of `nranks` ranks (a reduce's
 * receive buffer is only the root's). */
size_t send_bytes(const Signature &s, int nranks) { return s.count * dtype_size(s.dtype) * (s.kind == kReduceScatter ? nranks : 1); }
size_t recv_bytes(const Signature &s, int nranks, int rank) {
    if (s.kind == kReduce && rank != s.root) return 0;
    return s.count * dtype_size(s.dtype) * (s.kind == kAllGather ? nranks : 1);
}

/* The sum (or other op) of every rank's `n` elements in rank order. */
template <typename T> std::vector<T> combined(const Collective &c, size_t n, int op) {
    std::vector<T> sum(n);
    memcpy(sum.data(), c.send[0], n * sizeof(T));
    for (size_t r = 1; r < c.send.size(); ++r) {
        const T *in = static_cast<const T *>(c.send[r]);
        for (size_t i = 0; i < n; ++i) sum[i] = combine(sum[i], in[i], op);
    }
    return sum;
}

/* A reduction over every rank in rank order: the all-reduce writes it to every rank, the
 * reduce-scatter rank r's part r to rank r, the reduce to the root. The whole result is
 * computed before any receive buffer is written, as in-place receive buffers alias the sends. */
template <typename T> void reduce(Collective &c, const Signature &s) {
    size_t nranks = c.send.size();
    switch (s.kind) {
    case kAllReduce: {
        std::vector<T> sum = combined<T>(c, s.count, s.op);
        for (void *out : c.recv) memcpy(out, sum.data(), s.count * sizeof(T));
        break;
    }
    case kReduceScatter: {
        std::vector<T> sum = combined<T>(c, nranks * s.count, s.op);
        for (size_t r = 0; r < nranks; ++r) memcpy(c.recv[r], sum.data() + r * s.count, s.count * sizeof(T));
        break;
    }
    case kReduce: {
        std::vector<T> sum = combined<T>(c, s.count, s.op);
        memcpy(c.recv[s.root], sum.data(), s.count * sizeof(T));
        break;
    }
    default: sim::violation("%s is not a reduction", kind_name(s.kind));
    }
}

/* Every rank's send buffer, in rank order, to every rank. */
void gather(Collective &c, const Signature &s) {
    size_t nranks = c.send.size(), bytes = s.count * dtype_size(s.dtype);
    std::vector<char> all(nranks * bytes);
    for (size_t r = 0; r < nranks; ++r) memcpy(all.data() + r * bytes, c.send[r], bytes);
    for (void *out : c.recv) memcpy(out, all.data(), all.size());
}

void run(Collective &c, const Signature &s) {
    if (s.kind == kAllGather) return gather(c, s);
    switch (s.dtype) {
    case ncclFloat32: reduce<float>(c, s); break;
    case ncclFloat64: reduce<double>(c, s); break;
    case ncclUint64: reduce<uint64_t>(c, s); break;
    case ncclInt64: reduce<int64_t>(c, s); break;
    case ncclUint32: reduce<uint32_t>(c, s); break;
    case ncclInt32: reduce<int32_t>(c, s); break;
    default: sim::violation("%s: type %d is not modelled", kind_name(s.kind), s.dtype);
    }
}

std::string describe(const Signature &s) {
    std::string text = std::string(kind_name(s.kind)) + "(count " + std::to_string(s.count) + ", type " + std::to_string(s.dtype);
    if (s.kind != kAllGather) text += ", op " + std::to_string(s.op);
    if (s.kind == kReduce) text += ", root " + std::to_string(s.root);
    return text + ")";
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
    size_t in = send_bytes(p.sig, g->nranks), out = recv_bytes(p.sig, g->nranks, c->rank);
    char what[160];
    snprintf(what, sizeof what, "%s #%llu of rank %d (group %.8s)", kind_name(p.sig.kind), (unsigned long long)index, c->rank, g->id.c_str());
    sim::Op op;
    op.what = what;
    op.footprint = [p, in, out, g](sim::Footprint &f) {
        f.access((uint64_t)(uintptr_t)p.send, in, false);
        if (out) f.access((uint64_t)(uintptr_t)p.recv, out, true);
        /* Every peer device in this process reads and writes these buffers. */
        for (Comm *peer : g->ranks)
            if (peer && peer->device != p.comm->device) {
                f.peer_access((uint64_t)(uintptr_t)p.send, in, peer->device);
                if (out) f.peer_access((uint64_t)(uintptr_t)p.recv, out, peer->device);
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
            run(col, p.sig);
            col.done = true;
            changed.notify_all();
        }
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(sim::config().timeout_s);
        bool ok = changed.wait_until(lock, deadline, [&] { return col.done || c->aborted || g->peer_aborted; });
        if (!ok) {
            std::string missing;
            for (int r = 0; r < g->nranks; ++r)
                if (!col.send[r]) missing += " " + std::to_string(r);
            sim::violation("%s waited %u s for ranks%s: a hang", describe(p.sig).c_str(), sim::config().timeout_s, missing.c_str());
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

/* Joins rank `rank` of the `nranks` of group `key` on `ctx`'s device. */
static ncclResult_t join(void **out, int nranks, const std::string &key, int rank, bool blocking, sim::Context *ctx) {
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

static ncclResult_t init_rank(void **out, int nranks, ncclUniqueId id, int rank, bool blocking) {
    if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    sim::Context *ctx = sim::current_context();
    if (!ctx) ctx = sim::device(0).primary; /* as the runtime's current device 0 */
    return join(out, nranks, std::string(id.internal, strnlen(id.internal, sizeof id.internal)), rank, blocking, ctx);
}

/* Whether `config` (may be null) asks for a blocking communicator; false with `bad` set for a
 * config that is not one. */
static bool blocking_of(const ConfigHead *config, bool *bad) {
    *bad = config && config->magic != kConfigMagic;
    return !config || config->blocking == INT_MIN || config->blocking != 0;
}

EXPORT ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) { return init_rank(comm, nranks, id, rank, true); }

EXPORT ncclResult_t ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, const ConfigHead *config) {
    bool bad;
    bool blocking = blocking_of(config, &bad);
    if (bad) return ncclInvalidArgument;
    return init_rank(comm, nranks, id, rank, blocking);
}

/* NCCL_SPLIT_NOCOLOR: the rank joins no new communicator. */
constexpr int kSplitNoColor = -1;

/* Collective over `handle`'s ranks, each with its color and key: the ranks of one color form a new
 * group, ranked by key, then by their rank in the parent, on the parent's devices. Waits (host)
 * for every rank's color; the new group's rendezvous is blocking or not as `config` says. */
EXPORT ncclResult_t ncclCommSplit(void *handle, int color, int key, void **newcomm, const ConfigHead *config) {
    bool bad;
    bool blocking = blocking_of(config, &bad);
    if (!handle || !newcomm || bad || (color < 0 && color != kSplitNoColor)) return ncclInvalidArgument;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    enter(c, "ncclCommSplit");
    Group &g = *c->group;
    uint64_t round = c->splits++;
    SplitRound &s = g.splits[round];
    if (s.picks.empty()) s.picks.assign(g.nranks, {kSplitNoColor, 0});
    s.picks[c->rank] = {color, key};
    s.arrived++;
    changed.notify_all();
    *newcomm = nullptr;
    std::vector<std::pair<int, int>> members; /* (key, parent rank) of this color */
    if (color != kSplitNoColor) {
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(sim::config().timeout_s);
        if (!changed.wait_until(lock, deadline, [&] { return s.arrived == g.nranks || c->aborted || g.peer_aborted; }))
            sim::violation("ncclCommSplit #%llu of rank %d waited %u s for its peers: a hang", (unsigned long long)round, c->rank, sim::config().timeout_s);
        if (c->aborted || g.peer_aborted) {
            leave(c);
            return ncclRemoteError;
        }
        for (int r = 0; r < g.nranks; ++r)
            if (s.picks[r].first == color) members.push_back({s.picks[r].second, r});
        std::sort(members.begin(), members.end());
    }
    std::string id = g.id + "/" + std::to_string(round) + "/" + std::to_string(color);
    if (++s.left == g.nranks) g.splits.erase(round);
    leave(c);
    if (color == kSplitNoColor) return ncclSuccess;
    int rank = int(std::find(members.begin(), members.end(), std::make_pair(key, c->rank)) - members.begin());
    sim::Context *ctx = c->ctx;
    lock.unlock();
    return join(newcomm, int(members.size()), id, rank, blocking, ctx);
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

namespace {

std::string describe_message(bool send, int from, int to, uint64_t index, size_t count, int dtype) {
    char text[160];
    snprintf(text, sizeof text, "%s #%llu from rank %d to rank %d (count %zu, type %d)", send ? "ncclSend" : "ncclRecv", (unsigned long long)index, from,
             to, count, dtype);
    return text;
}

/* One rank's sends and receives of a group (or one call), as one stream operation: its sends are
 * posted first, then each receive waits for its message and copies it, then the operation waits
 * until its own sends were copied (so their buffers stay untouched until then). Every rank posts
 * before it waits, so the exchanges of a group never deadlock. */
void enqueue_p2p(Comm *c, std::vector<P2p> ops) {
    Group *g = c->group;
    sim::Stream *stream = ops[0].stream;
    for (const P2p &p : ops)
        if (p.stream != stream) sim::violation("rank %d's sends and receives of one group are on different streams", c->rank);
    char what[160];
    snprintf(what, sizeof what, "ncclSend/ncclRecv x%zu of rank %d (group %.8s)", ops.size(), c->rank, g->id.c_str());
    sim::Op op;
    op.what = what;
    op.footprint = [ops, g, c](sim::Footprint &f) {
        for (const P2p &p : ops) {
            uint64_t at = (uint64_t)(uintptr_t)(p.send ? p.send_buf : p.recv_buf);
            f.access(at, p.bytes, !p.send);
            for (Comm *peer : g->ranks)
                if (peer && peer->device != c->device && peer->rank == p.peer) f.peer_access(at, p.bytes, peer->device);
        }
    };
    op.run = [ops, g, c] {
        std::unique_lock<std::mutex> lock(mutex);
        auto message = [&](const P2p &p) -> Message & {
            std::pair<int, int> key = p.send ? std::make_pair(c->rank, p.peer) : std::make_pair(p.peer, c->rank);
            return g->channels[key].messages[p.index];
        };
        auto wait = [&](const P2p &p, const std::function<bool()> &ready) {
            auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(sim::config().timeout_s);
            bool ok = changed.wait_until(lock, deadline, [&] { return ready() || c->aborted || g->peer_aborted; });
            if (!ok) {
                const Message &m = message(p);
                sim::violation("%s waited %u s for its %s: a hang", describe_message(p.send, p.send ? c->rank : p.peer, p.send ? p.peer : c->rank, p.index, m.count, m.dtype).c_str(),
                               sim::config().timeout_s, p.send ? "receive" : "send");
            }
            return ready();
        };
        bool failed = false;
        for (const P2p &p : ops)
            if (p.send) message(p).data = p.send_buf;
        changed.notify_all();
        for (const P2p &p : ops) {
            if (p.send || failed) continue;
            if (!wait(p, [&] { return message(p).data != nullptr; })) {
                failed = true;
                continue;
            }
            Message &m = message(p);
            memcpy(p.recv_buf, m.data, p.bytes);
            m.copied = true;
            changed.notify_all();
        }
        for (const P2p &p : ops)
            if (p.send && !failed && !wait(p, [&] { return message(p).copied; })) failed = true;
        if (failed && !c->aborted) {
            c->async = ncclRemoteError;
            c->last_error = "a peer aborted its communicator";
        }
        /* A message is done once its receiver copied it and its sender saw that. */
        for (const P2p &p : ops) {
            if (!p.send) continue;
            Channel &ch = g->channels[std::make_pair(c->rank, p.peer)];
            auto it = ch.messages.find(p.index);
            if (it != ch.messages.end() && it->second.copied) ch.messages.erase(it);
        }
    };
    if (std::find(c->streams.begin(), c->streams.end(), stream) == c->streams.end()) c->streams.push_back(stream);
    sim::enqueue(stream, std::move(op));
}

/* Issues one send or receive of rank `handle` (collected while a group is open). Its message must
 * match the other side's of the same index, checked as soon as both are issued. */
ncclResult_t p2p(bool send, const void *send_buf, void *recv_buf, size_t count, int dtype, int peer, void *handle, void *stream_handle) {
    const char *call = send ? "ncclSend" : "ncclRecv";
    if (!handle) return ncclInvalidArgument;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    enter(c, call);
    auto fail = [&](ncclResult_t r, std::string why) {
        c->last_error = std::move(why);
        leave(c);
        return r;
    };
    if (c->async != ncclSuccess && c->async != ncclInProgress) return fail(c->async, "the communicator has an asynchronous error");
    if (dtype < ncclInt8 || dtype > ncclBfloat16) return fail(ncclInvalidArgument, "bad type");
    Group &g = *c->group;
    if (peer < 0 || peer >= g.nranks) return fail(ncclInvalidArgument, "bad peer");
    sim::Stream *stream = sim::resolve_stream(stream_handle, c->ctx);
    if (!stream) return fail(ncclInvalidArgument, "the stream is not of the communicator's device");
    size_t bytes = count * dtype_size(dtype);
    std::string why;
    const void *buf = send ? send_buf : recv_buf;
    if (bytes && !sim::find_live((uint64_t)(uintptr_t)buf, bytes, c->device, &why)) sim::violation("%s of rank %d: buffer: %s", call, c->rank, why.c_str());
    int from = send ? c->rank : peer, to = send ? peer : c->rank;
    Channel &ch = g.channels[std::make_pair(from, to)];
    uint64_t index = send ? ch.sends++ : ch.receives++;
    Message &m = ch.messages[index];
    bool other = send ? m.received : m.sent;
    if (other && (m.count != count || m.dtype != dtype))
        sim::violation("%s does not match %s", describe_message(send, from, to, index, count, dtype).c_str(),
                       describe_message(!send, from, to, index, m.count, m.dtype).c_str());
    (send ? m.sent : m.received) = true;
    m.count = count;
    m.dtype = dtype;
    P2p p{c, send, peer, index, send_buf, recv_buf, bytes, stream};
    if (group_depth > 0) {
        group_p2p.push_back(p);
        return ncclSuccess;
    }
    enqueue_p2p(c, {p});
    leave(c);
    return ncclSuccess;
}

} // namespace

EXPORT ncclResult_t ncclSend(const void *send, size_t count, int dtype, int peer, void *handle, void *stream) {
    return p2p(true, send, nullptr, count, dtype, peer, handle, stream);
}

EXPORT ncclResult_t ncclRecv(void *recv, size_t count, int dtype, int peer, void *handle, void *stream) {
    return p2p(false, nullptr, recv, count, dtype, peer, handle, stream);
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
    std::vector<P2p> p2ps;
    p2ps.swap(group_p2p);
    std::unique_lock<std::mutex> lock(mutex);
    ncclResult_t result = ncclSuccess;
    std::vector<Comm *> used;
    /* Each communicator's sends and receives of the group: one stream operation. */
    std::vector<Comm *> exchanging;
    for (const P2p &p : p2ps)
        if (std::find(exchanging.begin(), exchanging.end(), p.comm) == exchanging.end()) exchanging.push_back(p.comm);
    for (Comm *c : exchanging) {
        if (c->aborted) sim::violation("ncclGroupEnd: a send or receive of rank %d's communicator, which was aborted inside the group", c->rank);
        std::vector<P2p> mine;
        for (const P2p &p : p2ps)
            if (p.comm == c) mine.push_back(p);
        enqueue_p2p(c, mine);
        if (std::find(used.begin(), used.end(), c) == used.end()) c->inside = std::thread::id();
    }
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

namespace {

/* NCCL's rule for a receive buffer that overlaps the send buffer: only the in-place layout
 * (recvbuff == sendbuff; a reduce-scatter's recvbuff == sendbuff + rank * recvcount; an
 * all-gather's sendbuff == recvbuff + rank * sendcount) is defined. */
void check_in_place(const Pending &p, int nranks, int rank) {
    size_t in = send_bytes(p.sig, nranks), out = recv_bytes(p.sig, nranks, rank);
    uint64_t send = (uint64_t)(uintptr_t)p.send, recv = (uint64_t)(uintptr_t)p.recv;
    if (!in || !out || send + in <= recv || recv + out <= send) return;
    size_t part = p.sig.count * dtype_size(p.sig.dtype) * rank;
    bool in_place = p.sig.kind == kReduceScatter ? recv == send + part : p.sig.kind == kAllGather ? send == recv + part : recv == send;
    if (!in_place)
        sim::violation("%s of rank %d: the receive buffer [%#llx, +%zu) overlaps the send buffer [%#llx, +%zu) but is not in place (%s)",
                       kind_name(p.sig.kind), rank, (unsigned long long)recv, out, (unsigned long long)send, in,
                       p.sig.kind == kReduceScatter ? "recvbuff must be sendbuff + rank * recvcount"
                       : p.sig.kind == kAllGather   ? "sendbuff must be recvbuff + rank * sendcount"
                                                    : "recvbuff must be sendbuff");
}

/* Issues one collective of rank `handle` (collected while a group is open). */
ncclResult_t collective(const void *send, void *recv, Signature sig, void *handle, void *stream_handle) {
    const char *call = kind_name(sig.kind);
    if (!handle) return ncclInvalidArgument;
    Comm *c = as_comm(handle);
    std::unique_lock<std::mutex> lock(mutex);
    enter(c, call);
    auto fail = [&](ncclResult_t r, std::string why) {
        c->last_error = std::move(why);
        leave(c);
        return r;
    };
    if (c->async != ncclSuccess && c->async != ncclInProgress) return fail(c->async, "the communicator has an asynchronous error");
    if (sig.dtype < ncclInt8 || sig.dtype > ncclBfloat16 || sig.op < ncclSum || sig.op > ncclAvg) return fail(ncclInvalidArgument, "bad type or op");
    if (sig.root < 0 || sig.root >= c->group->nranks) return fail(ncclInvalidArgument, "bad root");
    sim::Stream *stream = sim::resolve_stream(stream_handle, c->ctx);
    if (!stream) return fail(ncclInvalidArgument, "the stream is not of the communicator's device");
    Group &g = *c->group;
    Pending p{c, send, recv, sig, stream};
    std::string why;
    size_t in = send_bytes(sig, g.nranks), out = recv_bytes(sig, g.nranks, c->rank);
    if (in && !sim::find_live((uint64_t)(uintptr_t)send, in, c->device, &why)) sim::violation("%s of rank %d: send buffer: %s", call, c->rank, why.c_str());
    if (out && !sim::find_live((uint64_t)(uintptr_t)recv, out, c->device, &why))
        sim::violation("%s of rank %d: receive buffer: %s", call, c->rank, why.c_str());
    check_in_place(p, g.nranks, c->rank);
    /* Every rank must issue the same collectives in the same order. */
    uint64_t index = c->issued + (group_depth > 0 ? std::count_if(group_pending.begin(), group_pending.end(), [&](const Pending &q) { return q.comm == c; }) : 0);
    if (index < g.sequence.size()) {
        if (g.sequence[index].second != sig)
            sim::violation("collective #%llu differs between ranks: rank %d issued %s, rank %d issues %s", (unsigned long long)index,
                           g.sequence[index].first, describe(g.sequence[index].second).c_str(), c->rank, describe(sig).c_str());
    } else {
        g.sequence.emplace_back(c->rank, sig);
    }
    if (group_depth > 0) {
        group_pending.push_back(p);
        return ncclSuccess;
    }
    enqueue_collective(p, c->issued++);
    ncclResult_t r = finish(c, lock);
    leave(c);
    return r;
}

} // namespace

EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, void *handle, void *stream) {
    return collective(send, recv, Signature{kAllReduce, count, dtype, op, 0}, handle, stream);
}

EXPORT ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, int dtype, int op, void *handle, void *stream) {
    return collective(send, recv, Signature{kReduceScatter, recvcount, dtype, op, 0}, handle, stream);
}

EXPORT ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, int dtype, void *handle, void *stream) {
    return collective(send, recv, Signature{kAllGather, sendcount, dtype, ncclSum, 0}, handle, stream);
}

EXPORT ncclResult_t ncclReduce(const void *send, void *recv, size_t count, int dtype, int op, int root, void *handle, void *stream) {
    return collective(send, recv, Signature{kReduce, count, dtype, op, root}, handle, stream);
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
