/* ccl.c -- collectives between processes: rounds through a shared-memory segment, or through
 * sockets between machines (see ccl.h). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define CCL_MAGIC 0x5350434cu /* "SPCL" */
#define CCL_VERSION 2u
#define CCL_LINE 64u
#define CCL_ALIGN(x) (((x) + CCL_LINE - 1) / CCL_LINE * CCL_LINE)

enum {
    KIND_ALLREDUCE = SPY_CCL_KIND_ALLREDUCE,
    KIND_ALLGATHER = SPY_CCL_KIND_ALLGATHER,
    KIND_REDUCE_SCATTER = SPY_CCL_KIND_REDUCE_SCATTER,
    KIND_BROADCAST = SPY_CCL_KIND_BROADCAST,
    KIND_ALLTOALL,
    KIND_BARRIER
};
static const char *const KIND_NAMES[] = {"", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                         "all_to_all", "barrier"};

typedef struct ccl_header {
    uint32_t magic, version, nranks, ready; /* ready: 1 once the creator has sized the segment */
    uint64_t slot_bytes;
    uint32_t aborted;
    char reason[236];
} ccl_header;

/* One rank's control block: its two sequence numbers on lines of their own (the peers spin
 * on them), then the descriptor of its current call, its process id and its clock (when its
 * card is ready for the call: see spy_ccl_set_clock). */
typedef struct ccl_rank {
    uint64_t arrive;
    uint8_t pad0[CCL_LINE - 8];
    uint64_t done;
    uint8_t pad1[CCL_LINE - 8];
    uint64_t desc[5]; /* kind, total size, dtype, op, root (or the caller's tag) */
    int64_t pid;
    double clock;
    uint8_t pad2[CCL_LINE - 56];
} ccl_rank;
_Static_assert(sizeof(ccl_rank) == 3 * CCL_LINE, "ccl_rank is three cache lines");

struct spy_ccl {
    uint8_t *base;
    size_t map_bytes;
    ccl_header *hdr;
    ccl_rank *ranks;
    uint8_t *slots;
    uint32_t rank, nranks;
    uint64_t slot_bytes, timeout_ns, round;
    double clock, clock_max; /* this rank's clock for the next call; the latest of every rank's at the last */
    /* Between machines (spy_ccl_open_tcp) the segment is this process's own memory, every
     * rank's slot a copy that a round receives: */
    int *fds;                /* per rank the socket to it (-1: this rank); NULL: a shared segment */
    uint8_t *send_mid;       /* per rank: a frame to it is half sent (no abort frame may follow it) */
};

/* A round's message between machines: this frame, then `bytes` of the sender's slot (of an
 * abort: its reason). */
#define CCL_FRAME_DATA 0x54414450u  /* "PDAT" */
#define CCL_FRAME_ABORT 0x54524241u /* "ABRT" */
typedef struct ccl_frame {
    uint32_t magic, rank;
    uint64_t round;
    uint64_t desc[5];
    double clock;
    uint64_t bytes;
} ccl_frame;

static size_t segment_bytes(uint32_t nranks, uint64_t slot_bytes)
{
    return CCL_ALIGN(sizeof(ccl_header)) + (size_t)nranks * sizeof(ccl_rank) + (size_t)nranks * slot_bytes;
}

static uint8_t *slot_of(const spy_ccl *c, uint32_t rank) { return c->slots + (size_t)rank * c->slot_bytes; }

/* Where the header, the ranks' records and the slots lie in a group's segment: the same
 * layout whether the segment is shared memory or (over TCP) this rank's own copy. */
static void lay_out(spy_ccl *c, void *base, uint32_t rank, uint32_t nranks, uint64_t slot_bytes,
                    uint64_t timeout_ns)
{
    c->base = base;
    c->hdr = base;
    c->ranks = (ccl_rank *)(c->base + CCL_ALIGN(sizeof(ccl_header)));
    c->slots = (uint8_t *)(c->ranks + nranks);
    c->rank = rank;
    c->nranks = nranks;
    c->slot_bytes = slot_bytes;
    c->timeout_ns = timeout_ns;
}

static void write_header(spy_ccl *c)
{
    c->hdr->magic = CCL_MAGIC;
    c->hdr->version = CCL_VERSION;
    c->hdr->nranks = c->nranks;
    c->hdr->slot_bytes = c->slot_bytes;
}

spy_status spy_ccl_open(const char *name, uint32_t rank, uint32_t nranks, uint64_t slot_bytes, int32_t create,
                        uint64_t timeout_ns, spy_ccl **out)
{
    if (!name || name[0] != '/' || !out || nranks == 0 || nranks > SPY_CCL_MAX_RANKS || rank >= nranks ||
        slot_bytes == 0 || slot_bytes % CCL_LINE || slot_bytes > (1ull << 32) || timeout_ns == 0)
        return spy_fail(SPY_E_INVALID_ARG, -1,
                        "ccl open: name must start with '/', rank < nranks <= %d, slot_bytes a positive multiple "
                        "of %u up to 4 GiB, a positive timeout (rank %u of %u, slot %llu bytes)",
                        SPY_CCL_MAX_RANKS, CCL_LINE, rank, nranks, (unsigned long long)slot_bytes);
    *out = NULL;
    size_t bytes = segment_bytes(nranks, slot_bytes);
    int fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0)
        return spy_fail(SPY_E_INVALID_ARG, -1, "ccl open: shm_open(%s) failed: %s", name, strerror(errno));
    if (create && ftruncate(fd, (off_t)bytes) != 0) {
        int err = errno;
        close(fd);
        shm_unlink(name);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "ccl open: sizing %s to %zu bytes failed: %s", name, bytes,
                        strerror(err));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != bytes) {
        close(fd);
        return spy_fail(SPY_E_INVALID_ARG, -1,
                        "ccl open: %s is %lld bytes, not the %zu of %u ranks with %llu-byte slots", name,
                        (long long)st.st_size, bytes, nranks, (unsigned long long)slot_bytes);
    }
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "ccl open: mapping %s failed: %s", name, strerror(errno));
    spy_ccl *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(base, bytes);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "ccl open: out of host memory");
    }
    lay_out(c, base, rank, nranks, slot_bytes, timeout_ns);
    c->map_bytes = bytes;
    if (create) {
        write_header(c);
        __atomic_store_n(&c->hdr->ready, 1u, __ATOMIC_RELEASE);
    } else if (__atomic_load_n(&c->hdr->ready, __ATOMIC_ACQUIRE) != 1u || c->hdr->magic != CCL_MAGIC ||
               c->hdr->version != CCL_VERSION || c->hdr->nranks != nranks || c->hdr->slot_bytes != slot_bytes) {
        spy_ccl_close(c);
        return spy_fail(SPY_E_INVALID_ARG, -1, "ccl open: %s is not a group of %u ranks with %llu-byte slots", name,
                        nranks, (unsigned long long)slot_bytes);
    }
    __atomic_store_n(&c->ranks[rank].pid, (int64_t)getpid(), __ATOMIC_RELEASE);
    *out = c;
    return SPY_OK;
}

spy_status spy_ccl_open_tcp(uint32_t rank, uint32_t nranks, const int32_t *fds, uint64_t slot_bytes,
                            uint64_t timeout_ns, spy_ccl **out)
{
    bool ok = fds && out && nranks > 0 && nranks <= SPY_CCL_MAX_RANKS && rank < nranks && slot_bytes &&
              slot_bytes % CCL_LINE == 0 && slot_bytes <= (1ull << 32) && timeout_ns;
    for (uint32_t j = 0; ok && j < nranks; j++)
        ok = j == rank || fds[j] >= 0;
    if (fds)
        for (uint32_t j = 0; j < nranks && j < SPY_CCL_MAX_RANKS && !ok; j++)
            if (j != rank && fds[j] >= 0)
                close(fds[j]); /* the group takes the sockets, also when it is refused */
    if (!ok)
        return spy_fail(SPY_E_INVALID_ARG, -1,
                        "ccl open (tcp): rank < nranks <= %d, a socket to every other rank, slot_bytes a positive "
                        "multiple of %u up to 4 GiB, a positive timeout (rank %u of %u)",
                        SPY_CCL_MAX_RANKS, CCL_LINE, rank, nranks);
    *out = NULL;
    size_t bytes = segment_bytes(nranks, slot_bytes);
    spy_ccl *c = calloc(1, sizeof *c);
    uint8_t *base = calloc(1, bytes);
    int *own = malloc(nranks * sizeof *own);
    uint8_t *mid = calloc(nranks, 1);
    if (!c || !base || !own || !mid) {
        for (uint32_t j = 0; j < nranks; j++)
            if (j != rank)
                close(fds[j]);
        free(c), free(base), free(own), free(mid);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "ccl open (tcp): out of host memory for %zu bytes", bytes);
    }
    for (uint32_t j = 0; j < nranks; j++) {
        own[j] = j == rank ? -1 : fds[j];
        if (own[j] >= 0)
            fcntl(own[j], F_SETFL, fcntl(own[j], F_GETFL) | O_NONBLOCK);
    }
    lay_out(c, base, rank, nranks, slot_bytes, timeout_ns);
    c->fds = own;
    c->send_mid = mid;
    write_header(c);
    c->ranks[rank].pid = (int64_t)getpid();
    *out = c;
    return SPY_OK;
}

int32_t spy_ccl_is_tcp(const spy_ccl *c) { return c && c->fds ? 1 : 0; }

spy_status spy_ccl_unlink(const char *name)
{
    if (!name)
        return spy_fail(SPY_E_INVALID_ARG, -1, "ccl unlink: no name");
    if (shm_unlink(name) != 0 && errno != ENOENT)
        return spy_fail(SPY_E_INVALID_ARG, -1, "ccl unlink: %s: %s", name, strerror(errno));
    return SPY_OK;
}

void spy_ccl_close(spy_ccl *c)
{
    if (!c)
        return;
    if (c->fds) {
        for (uint32_t j = 0; j < c->nranks; j++)
            if (c->fds[j] >= 0)
                close(c->fds[j]);
        free(c->fds);
        free(c->send_mid);
        free(c->base);
    } else {
        munmap(c->base, c->map_bytes);
    }
    free(c);
}

uint64_t spy_ccl_rounds(const spy_ccl *c) { return c ? c->round : 0; }

uint32_t spy_ccl_size(const spy_ccl *c) { return c ? c->nranks : 0; }

void spy_ccl_set_clock(spy_ccl *c, double clock)
{
    if (c)
        c->clock = clock;
}

double spy_ccl_clock(const spy_ccl *c) { return c ? c->clock_max : 0.0; }

/* Between machines an abort is a frame to every peer (to those a frame is not half sent to:
 * it would land inside that frame), then the sockets shut: a peer waiting for this rank reads
 * the reason, or the end of its stream. */
static void tcp_tell_peers(spy_ccl *c)
{
    size_t len = strnlen(c->hdr->reason, sizeof c->hdr->reason);
    ccl_frame f = {CCL_FRAME_ABORT, c->rank, c->round, {0}, 0.0, len};
    for (uint32_t j = 0; j < c->nranks; j++) {
        int fd = c->fds[j];
        if (fd < 0)
            continue;
        if (!c->send_mid[j]) {
            uint8_t msg[sizeof f + sizeof c->hdr->reason];
            memcpy(msg, &f, sizeof f);
            memcpy(msg + sizeof f, c->hdr->reason, len);
            (void)!send(fd, msg, sizeof f + len, MSG_DONTWAIT | MSG_NOSIGNAL);
        }
        shutdown(fd, SHUT_RDWR);
    }
}

void spy_ccl_abort(spy_ccl *c, const char *reason)
{
    if (!c)
        return;
    uint32_t expected = 0;
    if (__atomic_compare_exchange_n(&c->hdr->aborted, &expected, 2u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        snprintf(c->hdr->reason, sizeof c->hdr->reason, "rank %u: %s", c->rank, reason ? reason : "aborted");
        __atomic_store_n(&c->hdr->aborted, 1u, __ATOMIC_RELEASE);
        if (c->fds)
            tcp_tell_peers(c);
    }
}

spy_status spy_ccl_rearm(spy_ccl *c, uint64_t round)
{
    if (!c || round < c->round)
        return spy_fail(SPY_E_INVALID_ARG, -1, "ccl rearm: the round to resume from (%llu) is before this rank's (%llu)",
                        (unsigned long long)round, (unsigned long long)(c ? c->round : 0));
    if (c->fds)
        return spy_fail(SPY_E_CCL_PEER, -1, "ccl rearm: a group between machines cannot be rearmed (its sockets are shut)");
    c->round = round;
    __atomic_store_n(&c->ranks[c->rank].arrive, round, __ATOMIC_RELEASE);
    __atomic_store_n(&c->ranks[c->rank].done, round, __ATOMIC_RELEASE);
    if (c->rank == 0) {
        c->hdr->reason[0] = '\0';
        __atomic_store_n(&c->hdr->aborted, 0u, __ATOMIC_RELEASE);
    }
    return SPY_OK;
}

static spy_status aborted_error(const spy_ccl *c)
{
    /* the reason is written before aborted becomes 1; 2 means it is being written */
    while (__atomic_load_n(&c->hdr->aborted, __ATOMIC_ACQUIRE) == 2u)
        sched_yield();
    char reason[sizeof c->hdr->reason];
    memcpy(reason, c->hdr->reason, sizeof reason);
    reason[sizeof reason - 1] = '\0';
    return spy_fail(SPY_E_CCL_PEER, -1, "the process group was aborted (%s)", reason);
}

/* A peer's process has exited (it will never arrive): gone, or a zombie its launcher has
 * not reaped yet. */
static bool peer_gone(const spy_ccl *c, uint32_t j)
{
    int64_t pid = __atomic_load_n(&c->ranks[j].pid, __ATOMIC_ACQUIRE);
    if (pid <= 0)
        return false;
    if (kill((pid_t)pid, 0) != 0)
        return errno == ESRCH;
    char path[64], stat[128];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = '\0';
    const char *close_paren = strrchr(stat, ')'); /* "pid (comm) S ..." */
    return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

/* A wait spins, then yields the core, and after CCL_YIELDS turns naps between looks: a
 * rank that waits long for its peers (ranks still compiling, more processes than cores)
 * does not take the cores they need. */
#define CCL_YIELDS 4096u
static const struct timespec CCL_NAP = {0, 200000}; /* 0.2 ms */

/* Wait until every rank's counter (arrive or done, by `which`) reaches `target`. */
static spy_status wait_all(spy_ccl *c, int which, uint64_t target, uint32_t kind)
{
    uint64_t start = 0;
    for (uint32_t j = 0; j < c->nranks; j++) {
        uint64_t *counter = which ? &c->ranks[j].done : &c->ranks[j].arrive;
        for (uint32_t spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) < target; spins++) {
            if (__atomic_load_n(&c->hdr->aborted, __ATOMIC_ACQUIRE))
                return aborted_error(c);
            if (spins < 64)
                continue;
            if (spins < CCL_YIELDS)
                sched_yield(); /* the peer may need this core */
            else
                nanosleep(&CCL_NAP, NULL); /* a long wait (more ranks than cores): leave the cores to them */
            if (spins % 256 && spins < CCL_YIELDS)
                continue;
            uint64_t now = spy_now_ns();
            if (!start)
                start = now;
            if (peer_gone(c, j)) {
                /* it may have reached the round and then exited between the two looks */
                if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= target)
                    break;
                spy_ccl_abort(c, "a peer exited");
                return spy_fail(SPY_E_CCL_PEER, -1, "%s: rank %u (pid %lld) exited before it reached round %llu",
                                KIND_NAMES[kind], j, (long long)c->ranks[j].pid, (unsigned long long)target);
            }
            if (now - start > c->timeout_ns) {
                spy_ccl_abort(c, "a collective timed out");
                return spy_fail(SPY_E_CCL_TIMEOUT, -1,
                                "%s: rank %u did not reach round %llu within the timeout of %.3f s (rank %u waited)",
                                KIND_NAMES[kind], j, (unsigned long long)target, (double)c->timeout_ns * 1e-9,
                                c->rank);
            }
        }
    }
    return SPY_OK;
}

static spy_status tcp_fail(spy_ccl *c, spy_status s, uint32_t j, const char *what)
{
    char why[160];
    snprintf(why, sizeof why, "rank %u %s in round %llu", j, what, (unsigned long long)c->round);
    spy_ccl_abort(c, why);
    return spy_fail(s, -1, "%s", why);
}

/* One round between machines: send every peer this rank's frame and the first `used` bytes
 * of its slot, receive theirs into their slots' copies, all at once (non-blocking sockets
 * under poll: large messages both ways would fill the sockets' buffers otherwise). */
static spy_status tcp_exchange(spy_ccl *c, uint64_t used)
{
    uint32_t me = c->rank;
    ccl_frame mine = {CCL_FRAME_DATA, me, c->round, {0}, c->clock, used};
    memcpy(mine.desc, c->ranks[me].desc, sizeof mine.desc);
    ccl_frame in[SPY_CCL_MAX_RANKS];
    uint64_t sent[SPY_CCL_MAX_RANKS] = {0}, got[SPY_CCL_MAX_RANKS] = {0};
    static _Thread_local char reasons[SPY_CCL_MAX_RANKS][sizeof((ccl_header *)0)->reason]; /* of abort frames */
    struct pollfd pfd[SPY_CCL_MAX_RANKS];
    uint32_t who[SPY_CCL_MAX_RANKS];
    const uint64_t out_total = sizeof mine + used;
    uint64_t start = spy_now_ns();
    for (;;) {
        nfds_t np = 0;
        for (uint32_t j = 0; j < c->nranks; j++) {
            if (j == me)
                continue;
            bool out = sent[j] < out_total;
            bool inn = got[j] < sizeof(ccl_frame) || got[j] < sizeof(ccl_frame) + in[j].bytes;
            if (out || inn) {
                pfd[np] = (struct pollfd){c->fds[j], (short)((out ? POLLOUT : 0) | (inn ? POLLIN : 0)), 0};
                who[np++] = j;
            }
        }
        if (!np)
            break;
        if (__atomic_load_n(&c->hdr->aborted, __ATOMIC_ACQUIRE))
            return aborted_error(c);
        if (spy_now_ns() - start > c->timeout_ns)
            return tcp_fail(c, SPY_E_CCL_TIMEOUT, who[0], "did not reach the collective within the group's timeout");
        if (poll(pfd, np, 100) < 0 && errno != EINTR)
            return tcp_fail(c, SPY_E_CCL_PEER, who[0], "could not be waited for (poll failed)");
        for (nfds_t k = 0; k < np; k++) {
            uint32_t j = who[k];
            short ev = pfd[k].revents;
            if ((ev & POLLOUT) && sent[j] < out_total) {
                const uint8_t *from = sent[j] < sizeof mine ? (const uint8_t *)&mine + sent[j]
                                                             : slot_of(c, me) + (sent[j] - sizeof mine);
                uint64_t left = sent[j] < sizeof mine ? sizeof mine - sent[j] : out_total - sent[j];
                ssize_t n = send(c->fds[j], from, left, MSG_DONTWAIT | MSG_NOSIGNAL);
                if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    sent[j] = out_total; /* its end is shut: read on, for its abort frame or its end */
                else if (n > 0)
                    sent[j] += (uint64_t)n;
                c->send_mid[j] = sent[j] > 0 && sent[j] < out_total;
            }
            if (!(ev & (POLLIN | POLLHUP | POLLERR)))
                continue;
            uint8_t *to;
            uint64_t left;
            if (got[j] < sizeof(ccl_frame)) {
                to = (uint8_t *)&in[j] + got[j];
                left = sizeof(ccl_frame) - got[j];
            } else {
                uint64_t at = got[j] - sizeof(ccl_frame);
                to = (in[j].magic == CCL_FRAME_ABORT ? (uint8_t *)reasons[j] : slot_of(c, j)) + at;
                left = in[j].bytes - at;
            }
            ssize_t n = left ? recv(c->fds[j], to, left, MSG_DONTWAIT) : 0;
            if (left && n == 0)
                return tcp_fail(c, SPY_E_CCL_PEER, j, "closed its connection (its process exited or left the group)");
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                return tcp_fail(c, SPY_E_CCL_PEER, j, "closed its connection (reset: its process exited?)");
            if (n > 0)
                got[j] += (uint64_t)n;
            if (got[j] == sizeof(ccl_frame) && n > 0) { /* a frame just arrived: check it */
                bool abort = in[j].magic == CCL_FRAME_ABORT;
                if ((!abort && in[j].magic != CCL_FRAME_DATA) || in[j].rank != j ||
                    in[j].bytes > (abort ? sizeof reasons[j] - 1 : c->slot_bytes) ||
                    (!abort && in[j].round != c->round))
                    return tcp_fail(c, SPY_E_CCL_PEER, j, "sent a malformed frame");
            }
            if (got[j] >= sizeof(ccl_frame) && in[j].magic == CCL_FRAME_ABORT &&
                got[j] == sizeof(ccl_frame) + in[j].bytes) {
                reasons[j][in[j].bytes] = '\0';
                spy_ccl_abort(c, reasons[j]); /* its reason, passed on to the other peers */
                memcpy(c->hdr->reason, reasons[j], in[j].bytes + 1);
                return aborted_error(c);
            }
        }
    }
    for (uint32_t j = 0; j < c->nranks; j++) {
        if (j == me)
            continue;
        c->send_mid[j] = 0;
        memcpy(c->ranks[j].desc, in[j].desc, sizeof in[j].desc);
        c->ranks[j].clock = in[j].clock;
    }
    return SPY_OK;
}

/* Begin a round: wait until the peers are done with this rank's slot, describe the call. */
static spy_status round_begin(spy_ccl *c, const uint64_t desc[5])
{
    if (__atomic_load_n(&c->hdr->aborted, __ATOMIC_ACQUIRE))
        return aborted_error(c);
    c->round++;
    /* between machines the peers read a copy of this slot: it is free again at once */
    spy_status s = c->fds ? SPY_OK : wait_all(c, 1, c->round - 1, (uint32_t)desc[0]);
    if (s != SPY_OK)
        return s;
    memcpy(c->ranks[c->rank].desc, desc, sizeof c->ranks[c->rank].desc);
    c->ranks[c->rank].clock = c->clock;
    return SPY_OK;
}

/* Publish this rank's slot (its first `used` bytes), wait for every rank's and compare their
 * descriptors. */
static spy_status round_exchange(spy_ccl *c, uint64_t used)
{
    const uint64_t *mine = c->ranks[c->rank].desc;
    spy_status s;
    if (c->fds) {
        s = tcp_exchange(c, used);
    } else {
        __atomic_store_n(&c->ranks[c->rank].arrive, c->round, __ATOMIC_RELEASE);
        s = wait_all(c, 0, c->round, (uint32_t)mine[0]);
    }
    if (s != SPY_OK)
        return s;
    for (uint32_t j = 0; j < c->nranks; j++) {
        const uint64_t *theirs = c->ranks[j].desc;
        if (memcmp(theirs, mine, sizeof c->ranks[j].desc) != 0) {
            char why[200];
            snprintf(why, sizeof why,
                     "mismatched collectives: rank %u called %s(size %llu, dtype %llu, op %llu, root %llu), rank %u "
                     "called %s(size %llu, dtype %llu, op %llu, root/tag %llu)",
                     c->rank, KIND_NAMES[mine[0] <= KIND_BARRIER ? mine[0] : 0], (unsigned long long)mine[1],
                     (unsigned long long)mine[2], (unsigned long long)mine[3], (unsigned long long)mine[4], j,
                     KIND_NAMES[theirs[0] <= KIND_BARRIER ? theirs[0] : 0], (unsigned long long)theirs[1],
                     (unsigned long long)theirs[2], (unsigned long long)theirs[3], (unsigned long long)theirs[4]);
            spy_ccl_abort(c, why);
            return spy_fail(SPY_E_CCL_MISMATCH, -1, "%s", why);
        }
    }
    double latest = c->ranks[0].clock;
    for (uint32_t j = 1; j < c->nranks; j++)
        if (c->ranks[j].clock > latest)
            latest = c->ranks[j].clock;
    c->clock_max = latest;
    return SPY_OK;
}

static void round_end(spy_ccl *c) { __atomic_store_n(&c->ranks[c->rank].done, c->round, __ATOMIC_RELEASE); }

static uint32_t elem_size(uint32_t dtype)
{
    switch (dtype) {
    case SPY_CCL_F16: case SPY_CCL_BF16: return 2;
    case SPY_CCL_F32: case SPY_CCL_I32: return 4;
    case SPY_CCL_F64: case SPY_CCL_I64: return 8;
    }
    return 0;
}

uint32_t spy_ccl_elem_size(uint32_t dtype) { return elem_size(dtype); }

static spy_status check_reduction(const char *what, uint32_t dtype, uint32_t op)
{
    if (!elem_size(dtype))
        return spy_fail(SPY_E_INVALID_ARG, -1, "%s: unknown element type %u", what, dtype);
    if (op > SPY_CCL_AVG || (op == SPY_CCL_AVG && (dtype == SPY_CCL_I32 || dtype == SPY_CCL_I64)))
        return spy_fail(SPY_E_INVALID_ARG, -1, "%s: reduction %u is not defined for element type %u", what, op,
                        dtype);
    return SPY_OK;
}

static double combine_f(double a, double b, uint32_t op)
{
    switch (op) {
    case SPY_CCL_PROD: return a * b;
    case SPY_CCL_MAX: return (a != a || a > b) ? a : b; /* NaN wins, as torch's max */
    case SPY_CCL_MIN: return (a != a || a < b) ? a : b;
    default: return a + b;
    }
}

static int64_t combine_i(int64_t a, int64_t b, uint32_t op)
{
    switch (op) {
    case SPY_CCL_PROD: return (int64_t)((uint64_t)a * (uint64_t)b);
    case SPY_CCL_MAX: return a > b ? a : b;
    case SPY_CCL_MIN: return a < b ? a : b;
    default: return (int64_t)((uint64_t)a + (uint64_t)b);
    }
}

#define CCL_BLOCK 1024 /* elements reduced at a time: the accumulator stays in L1 */

/* acc[0..n) = the n elements at p as floats (doubles for F64; int64 for integers). */
static void load_block(const uint8_t *p, uint64_t n, uint32_t dtype, double *accd, float *accf, int64_t *acci)
{
    switch (dtype) {
    case SPY_CCL_F16: {
        uint16_t h[CCL_BLOCK];
        memcpy(h, p, n * 2);
        spy_f16_to_f32_n(h, accf, n);
        break;
    }
    case SPY_CCL_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + i * 2, 2);
            accf[i] = spy_bf16_to_f32(h);
        }
        break;
    case SPY_CCL_F32: memcpy(accf, p, n * 4); break;
    case SPY_CCL_F64: memcpy(accd, p, n * 8); break;
    case SPY_CCL_I32:
        for (uint64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, p + i * 4, 4);
            acci[i] = v;
        }
        break;
    default: memcpy(acci, p, n * 8); break;
    }
}

static void combine_block_f(float *acc, const float *v, uint64_t n, uint32_t op)
{
    switch (op) {
    case SPY_CCL_PROD: for (uint64_t i = 0; i < n; i++) acc[i] *= v[i]; break;
    case SPY_CCL_MAX: for (uint64_t i = 0; i < n; i++) acc[i] = (acc[i] != acc[i] || acc[i] > v[i]) ? acc[i] : v[i]; break;
    case SPY_CCL_MIN: for (uint64_t i = 0; i < n; i++) acc[i] = (acc[i] != acc[i] || acc[i] < v[i]) ? acc[i] : v[i]; break;
    default: for (uint64_t i = 0; i < n; i++) acc[i] += v[i]; break;
    }
}

/* out[0..n) = op over ranks j of the n elements at byte `off` of slot j, in rank order;
 * fp16 and bf16 accumulate in fp32, integers in int64 (wrapping), doubles in double. */
static void reduce_slots(const spy_ccl *c, uint64_t off, uint64_t n, uint32_t dtype, uint32_t op, void *out)
{
    uint32_t p = c->nranks, es = elem_size(dtype);
    float accf[CCL_BLOCK], vf[CCL_BLOCK];
    double accd[CCL_BLOCK], vd[CCL_BLOCK];
    int64_t acci[CCL_BLOCK], vi[CCL_BLOCK];
    for (uint64_t b = 0; b < n; b += CCL_BLOCK) {
        uint64_t m = n - b < CCL_BLOCK ? n - b : CCL_BLOCK;
        uint8_t *dst = (uint8_t *)out + b * es;
        load_block(slot_of(c, 0) + off + b * es, m, dtype, accd, accf, acci);
        for (uint32_t j = 1; j < p; j++) {
            load_block(slot_of(c, j) + off + b * es, m, dtype, vd, vf, vi);
            if (dtype == SPY_CCL_F16 || dtype == SPY_CCL_BF16 || dtype == SPY_CCL_F32)
                combine_block_f(accf, vf, m, op);
            else if (dtype == SPY_CCL_F64)
                for (uint64_t i = 0; i < m; i++) accd[i] = combine_f(accd[i], vd[i], op);
            else
                for (uint64_t i = 0; i < m; i++) acci[i] = combine_i(acci[i], vi[i], op);
        }
        if (op == SPY_CCL_AVG && dtype == SPY_CCL_F64)
            for (uint64_t i = 0; i < m; i++) accd[i] /= (double)p;
        else if (op == SPY_CCL_AVG)
            for (uint64_t i = 0; i < m; i++) accf[i] /= (float)p;
        switch (dtype) {
        case SPY_CCL_F16: {
            uint16_t h[CCL_BLOCK];
            spy_f32_to_f16_n(accf, h, m);
            memcpy(dst, h, m * 2);
            break;
        }
        case SPY_CCL_BF16:
            for (uint64_t i = 0; i < m; i++) {
                uint16_t h = spy_f32_to_bf16(accf[i]);
                memcpy(dst + i * 2, &h, 2);
            }
            break;
        case SPY_CCL_F32: memcpy(dst, accf, m * 4); break;
        case SPY_CCL_F64: memcpy(dst, accd, m * 8); break;
        case SPY_CCL_I32:
            for (uint64_t i = 0; i < m; i++) {
                int32_t r = (int32_t)(uint32_t)(uint64_t)acci[i];
                memcpy(dst + i * 4, &r, 4);
            }
            break;
        default: memcpy(dst, acci, m * 8); break;
        }
    }
}

static spy_status check_group(const spy_ccl *c, const char *what, const void *a, const void *b, uint64_t nbytes)
{
    if (!c)
        return spy_fail(SPY_E_INVALID_ARG, -1, "%s: no group", what);
    if (nbytes && (!a || !b))
        return spy_fail(SPY_E_INVALID_ARG, -1, "%s: a null buffer", what);
    return SPY_OK;
}

spy_status spy_ccl_allreduce(spy_ccl *c, const void *in, void *out, uint64_t count, uint32_t dtype, uint32_t op,
                             uint64_t tag)
{
    spy_status s = check_reduction("all_reduce", dtype, op);
    if (s == SPY_OK)
        s = check_group(c, "all_reduce", in, out, count);
    if (s != SPY_OK)
        return s;
    uint64_t es = elem_size(dtype), per_round = c->slot_bytes / es, desc[5] = {KIND_ALLREDUCE, count, dtype, op, tag};
    uint64_t done = 0;
    do { /* a round even for count 0: the descriptors are still compared */
        uint64_t n = count - done < per_round ? count - done : per_round;
        if ((s = round_begin(c, desc)) != SPY_OK)
            return s;
        memcpy(slot_of(c, c->rank), (const uint8_t *)in + done * es, n * es);
        if ((s = round_exchange(c, n * es)) != SPY_OK)
            return s;
        reduce_slots(c, 0, n, dtype, op, (uint8_t *)out + done * es);
        round_end(c);
        done += n;
    } while (done < count);
    return SPY_OK;
}

/* Bytes [first, first + n) of a rank's part, split in chunks of `chunk` bytes, copied to
 * where rank j's chunks go in a whole of nranks parts: chunk k of rank j at (k*nranks + j).
 * `to_whole` copies part -> whole, else whole -> part. */
static void chunked_copy(uint8_t *whole, uint8_t *part, uint64_t first, uint64_t n, uint64_t chunk,
                         uint32_t nranks, uint32_t j, bool to_whole)
{
    while (n) {
        uint64_t k = first / chunk, w = first % chunk, m = chunk - w < n ? chunk - w : n;
        uint8_t *at = whole + (k * nranks + j) * chunk + w;
        if (to_whole)
            memcpy(at, part, m);
        else
            memcpy(part, at, m);
        part += m;
        first += m;
        n -= m;
    }
}

static spy_status check_chunk(const char *what, uint64_t total, uint64_t chunk)
{
    if (total && (chunk == 0 || total % chunk))
        return spy_fail(SPY_E_INVALID_ARG, -1, "%s: chunks of %llu bytes do not divide %llu bytes", what,
                        (unsigned long long)chunk, (unsigned long long)total);
    return SPY_OK;
}

spy_status spy_ccl_allgather(spy_ccl *c, const void *in, void *out, uint64_t nbytes, uint64_t chunk)
{
    spy_status s = check_group(c, "all_gather", in, out, nbytes);
    if (s == SPY_OK)
        s = check_chunk("all_gather", nbytes, chunk);
    if (s != SPY_OK)
        return s;
    uint64_t desc[5] = {KIND_ALLGATHER, nbytes, 0, 0, chunk}, done = 0;
    do {
        uint64_t n = nbytes - done < c->slot_bytes ? nbytes - done : c->slot_bytes;
        if ((s = round_begin(c, desc)) != SPY_OK)
            return s;
        memcpy(slot_of(c, c->rank), (const uint8_t *)in + done, n);
        if ((s = round_exchange(c, n)) != SPY_OK)
            return s;
        for (uint32_t j = 0; j < c->nranks; j++)
            chunked_copy(out, slot_of(c, j), done, n, chunk, c->nranks, j, true);
        round_end(c);
        done += n;
    } while (done < nbytes);
    return SPY_OK;
}

spy_status spy_ccl_reduce_scatter(spy_ccl *c, const void *in, void *out, uint64_t count, uint64_t chunk,
                                  uint32_t dtype, uint32_t op)
{
    spy_status s = check_reduction("reduce_scatter", dtype, op);
    if (s == SPY_OK)
        s = check_group(c, "reduce_scatter", in, out, count);
    if (s == SPY_OK)
        s = check_chunk("reduce_scatter", count, chunk);
    if (s != SPY_OK)
        return s;
    /* each round carries a piece of every rank's block: nranks pieces per slot */
    uint64_t es = elem_size(dtype), per_round = c->slot_bytes / es / c->nranks;
    uint64_t desc[5] = {KIND_REDUCE_SCATTER, count, dtype, op, chunk}, done = 0;
    if (per_round == 0)
        return spy_fail(SPY_E_INVALID_ARG, -1, "reduce_scatter: slots of %llu bytes are too small for %u ranks",
                        (unsigned long long)c->slot_bytes, c->nranks);
    do {
        uint64_t n = count - done < per_round ? count - done : per_round;
        if ((s = round_begin(c, desc)) != SPY_OK)
            return s;
        for (uint32_t j = 0; j < c->nranks; j++)
            chunked_copy((uint8_t *)(uintptr_t)in, slot_of(c, c->rank) + j * n * es, done * es, n * es, chunk * es,
                         c->nranks, j, false);
        if ((s = round_exchange(c, c->nranks * n * es)) != SPY_OK)
            return s;
        reduce_slots(c, c->rank * n * es, n, dtype, op, (uint8_t *)out + done * es);
        round_end(c);
        done += n;
    } while (done < count);
    return SPY_OK;
}

spy_status spy_ccl_broadcast(spy_ccl *c, void *buf, uint64_t nbytes, uint32_t root)
{
    spy_status s = check_group(c, "broadcast", buf, buf, nbytes);
    if (s != SPY_OK)
        return s;
    if (root >= c->nranks)
        return spy_fail(SPY_E_INVALID_ARG, -1, "broadcast: root %u of a group of %u", root, c->nranks);
    uint64_t desc[5] = {KIND_BROADCAST, nbytes, 0, 0, root}, done = 0;
    do {
        uint64_t n = nbytes - done < c->slot_bytes ? nbytes - done : c->slot_bytes;
        if ((s = round_begin(c, desc)) != SPY_OK)
            return s;
        if (c->rank == root)
            memcpy(slot_of(c, root), (uint8_t *)buf + done, n);
        if ((s = round_exchange(c, c->rank == root ? n : 0)) != SPY_OK)
            return s;
        if (c->rank != root)
            memcpy((uint8_t *)buf + done, slot_of(c, root), n);
        round_end(c);
        done += n;
    } while (done < nbytes);
    return SPY_OK;
}

spy_status spy_ccl_alltoall(spy_ccl *c, const void *in, void *out, uint64_t block_bytes)
{
    spy_status s = check_group(c, "all_to_all", in, out, block_bytes);
    if (s != SPY_OK)
        return s;
    uint64_t per_round = c->slot_bytes / c->nranks, desc[5] = {KIND_ALLTOALL, block_bytes, 0, 0, 0}, done = 0;
    do {
        uint64_t n = block_bytes - done < per_round ? block_bytes - done : per_round;
        if ((s = round_begin(c, desc)) != SPY_OK)
            return s;
        for (uint32_t j = 0; j < c->nranks; j++)
            memcpy(slot_of(c, c->rank) + j * n, (const uint8_t *)in + j * block_bytes + done, n);
        if ((s = round_exchange(c, c->nranks * n)) != SPY_OK)
            return s;
        for (uint32_t j = 0; j < c->nranks; j++)
            memcpy((uint8_t *)out + j * block_bytes + done, slot_of(c, j) + c->rank * n, n);
        round_end(c);
        done += n;
    } while (done < block_bytes);
    return SPY_OK;
}

spy_status spy_ccl_barrier(spy_ccl *c)
{
    spy_status s = check_group(c, "barrier", NULL, NULL, 0);
    if (s != SPY_OK)
        return s;
    uint64_t desc[5] = {KIND_BARRIER, 0, 0, 0, 0};
    if ((s = round_begin(c, desc)) != SPY_OK || (s = round_exchange(c, 0)) != SPY_OK)
        return s;
    round_end(c);
    return SPY_OK;
}

spy_status spy_ccl_sync(spy_ccl *c, const uint64_t desc[5])
{
    spy_status s = check_group(c, "collective", NULL, NULL, 0);
    if (s != SPY_OK)
        return s;
    if ((s = round_begin(c, desc)) != SPY_OK || (s = round_exchange(c, 0)) != SPY_OK)
        return s;
    round_end(c);
    return SPY_OK;
}
