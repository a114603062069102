/* ccl.h -- collectives between cards (ccl.c), included by spyre.h: through shared memory
 * between the processes of one machine, through sockets between machines.
 *
 * The ranks of a group share one POSIX shared-memory segment: a header, one control block
 * per rank (two sequence numbers and the descriptor of its current call) and one slot of
 * slot_bytes per rank. A collective is a series of rounds; in round r each rank waits until
 * every rank has finished reading round r-1 (done >= r-1), copies its part into its own
 * slot, publishes arrive = r, waits until every rank has arrived, reads what it needs from
 * the others' slots and publishes done = r. No lock, no system call on the data path; a
 * message larger than a slot takes several rounds.
 *
 * Every rank computes a reduction in rank order from the same slots, so every rank gets
 * the same bits. fp16 and bf16 accumulate in fp32.
 *
 * The ranks must call the same collectives in the same order with the same arguments. The
 * call's descriptor (kind, size, dtype, op, root) is compared across ranks at each round: a
 * mismatch is SPY_E_CCL_MISMATCH on every rank. A wait gives up after the group's timeout
 * (SPY_E_CCL_TIMEOUT) or as soon as a peer process has exited or the group was aborted
 * (SPY_E_CCL_PEER); after any failure the group is aborted and refuses every later call,
 * so that no rank waits for one that left. */
#ifndef SPYRE_CCL_H
#define SPYRE_CCL_H

typedef struct spy_ccl spy_ccl;

/* element types of reductions */
#define SPY_CCL_F32 0
#define SPY_CCL_F16 1
#define SPY_CCL_BF16 2
#define SPY_CCL_F64 3
#define SPY_CCL_I32 4
#define SPY_CCL_I64 5

/* reductions */
#define SPY_CCL_SUM 0
#define SPY_CCL_PROD 1
#define SPY_CCL_MAX 2
#define SPY_CCL_MIN 3
#define SPY_CCL_AVG 4 /* floating-point types only */

#define SPY_CCL_MAX_RANKS 64

/* Open rank `rank` of `nranks` on the segment `name` (a POSIX shm name, "/..."). With
 * `create` the segment is made (it must not exist) and sized; the other ranks open it after
 * it was made. `timeout_ns` bounds every wait. The segment's name can be unlinked once every
 * rank has opened it (spy_ccl_unlink): the mapping stays. */
spy_status spy_ccl_open(const char *name, uint32_t rank, uint32_t nranks, uint64_t slot_bytes, int32_t create,
                        uint64_t timeout_ns, spy_ccl **out);
/* Open rank `rank` of `nranks` whose peers are on other machines: fds[j] is a connected
 * stream socket to rank j (fds[rank] unused). The group takes the sockets (closed by
 * spy_ccl_close, or by this call when it fails). A round is then a frame to every peer and
 * one from each (its descriptor, clock and slot's bytes) instead of the shared slots; a
 * peer whose connection ends is SPY_E_CCL_PEER, and an abort is a frame telling the peers
 * why before the sockets shut. */
spy_status spy_ccl_open_tcp(uint32_t rank, uint32_t nranks, const int32_t *fds, uint64_t slot_bytes,
                            uint64_t timeout_ns, spy_ccl **out);
/* 1 for a group between machines (spy_ccl_open_tcp), 0 for one shared-memory ring. */
int32_t spy_ccl_is_tcp(const spy_ccl *c);
spy_status spy_ccl_unlink(const char *name);
/* Unmap. Peers still in a collective see SPY_E_CCL_PEER once this process exits. */
void spy_ccl_close(spy_ccl *c);
/* Abort the group: every rank's current and later calls fail with SPY_E_CCL_PEER. */
void spy_ccl_abort(spy_ccl *c, const char *reason);
uint64_t spy_ccl_rounds(const spy_ccl *c);
/* Put an aborted group on one machine back in service (a failed step on one rank, say):
 * this rank's rounds and counters go to `round`, the largest spy_ccl_rounds of any rank, and
 * rank 0 clears the abort. Every rank must be out of the ring when any rank calls it, and
 * must call it before any rank's next call (the caller's barrier, outside the ring, on both
 * sides). A group between machines cannot be rearmed: an abort shut its sockets. */
spy_status spy_ccl_rearm(spy_ccl *c, uint64_t round);
/* The number of ranks of the group. */
uint32_t spy_ccl_size(const spy_ccl *c);

/* out[i] = op over ranks of in[i], i < count (in and out may be the same buffer). `tag`
 * is compared across ranks like the size (the caller's word for how the elements are laid
 * out: a card's storage layout, say). */
spy_status spy_ccl_allreduce(spy_ccl *c, const void *in, void *out, uint64_t count, uint32_t dtype, uint32_t op,
                             uint64_t tag);
/* out = rank 0's in, then rank 1's, ...: nranks * nbytes bytes, by chunks of `chunk` bytes:
 * chunk k of rank j's in is chunk k*nranks + j of out (chunk = nbytes: one block per rank).
 * A card storage's sticks are stored stick-major, so the rows of nranks storages that share
 * their row length interleave so, a stick column at a time. */
spy_status spy_ccl_allgather(spy_ccl *c, const void *in, void *out, uint64_t nbytes, uint64_t chunk);
/* The reverse, reduced: in holds nranks * count elements, out[i] (i < count) is op over ranks
 * of their element (k*nranks + rank)*chunk + i%chunk of in, k = i / chunk (chunk = count:
 * in is nranks blocks of count elements and out the reduction of the blocks `rank`). */
spy_status spy_ccl_reduce_scatter(spy_ccl *c, const void *in, void *out, uint64_t count, uint64_t chunk,
                                  uint32_t dtype, uint32_t op);
/* Every rank's buf becomes root's. */
spy_status spy_ccl_broadcast(spy_ccl *c, void *buf, uint64_t nbytes, uint32_t root);
/* in and out hold nranks blocks of block_bytes; out block j = rank j's in block `rank`. */
spy_status spy_ccl_alltoall(spy_ccl *c, const void *in, void *out, uint64_t block_bytes);
spy_status spy_ccl_barrier(spy_ccl *c);

#endif /* SPYRE_CCL_H */
