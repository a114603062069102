/* test_native.c -- tests of the native runtime in C, run plain and under ASan/UBSan.
 *
 * They drive the public API only (spyre.h): allocation, validation of hostile programs,
 * functional arithmetic, the cost model on hand-computed figures, plans, faults. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h" /* the builder's common part (graph.c) is tested here too */

static int failures;
static const char *current;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d [%s]: %s (last error: %s)\n", __FILE__, __LINE__, current,  \
                    #cond, spy_last_error());                                                      \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define CHECK_OK(expr) CHECK((expr) == SPY_OK)
#define NEAR(a, b, rel) (fabs((double)(a) - (double)(b)) <= (rel) * fabs((double)(b)) + 1e-9)

static spy_profile test_profile(void)
{
    spy_profile p = {0};
    p.num_cores = 32;
    p.corelets_per_core = 2;
    p.scratchpad_bytes = 2u << 20;
    p.dram_bytes = 1ull << 30;
    p.stick_bytes = 128;
    p.dram_burst_bytes = 64;
    p.clock_ghz = 1.5;
    p.pt_macs_per_ns = 1536;
    p.pt_utilization = 0.75;
    p.pt_fp32_ratio = 0.25;
    p.pt_gran_m = 8;
    p.pt_gran_n = 64;
    p.pt_gran_k = 1;
    p.pt_latency_ns = 50;
    p.sfu_elems_per_cycle = 128;
    p.sfu_transcendental_cycles = 4;
    p.sfu_fp32_ratio = 1;
    p.sfu_latency_ns = 20;
    p.dram_bytes_per_ns = 150;
    p.core_dma_bytes_per_ns = 48;
    p.dma_latency_ns = 500;
    p.pcie_bytes_per_ns = 50;
    p.pcie_latency_ns = 1000;
    p.pcie_descriptor_ns = 2;
    p.ring_bytes_per_cycle = 128;
    p.ring_hop_ns = 10;
    p.barrier_ns = 100;
    p.job_launch_ns = 2000;
    return p;
}

/* ---- a tiny program builder ---- */
typedef struct prog {
    spy_slot slots[16];
    uint32_t nslots;
    spy_cmd cmds[256];
    uint32_t ncmds;
    uint32_t deps[512];
    uint32_t ndeps;
    spy_instr instrs[64];
    uint32_t ninstrs;
    spy_desc descs[64];
    uint32_t ndescs;
} prog;

static uint32_t slot(prog *p, uint32_t kind, uint64_t extent)
{
    p->slots[p->nslots].kind = kind;
    p->slots[p->nslots].extent = extent;
    return p->nslots++;
}

static spy_cmd *cmd(prog *p, uint8_t op, uint16_t core)
{
    spy_cmd *c = &p->cmds[p->ncmds++];
    memset(c, 0, sizeof *c);
    c->op = op;
    c->core = core;
    c->dep_begin = p->ndeps;
    return c;
}

static void dep(prog *p, spy_cmd *c, uint32_t on)
{
    p->deps[p->ndeps++] = on;
    c->ndeps++;
}

static spy_cmd *dma(prog *p, uint8_t op, uint16_t core, uint32_t src_slot, uint64_t src_off,
                    uint32_t dst_slot, uint64_t dst_off, uint32_t bytes)
{
    spy_cmd *c = cmd(p, op, core);
    c->u.dma.src_slot = src_slot;
    c->u.dma.dst_slot = dst_slot;
    c->u.dma.src_off = src_off;
    c->u.dma.dst_off = dst_off;
    c->u.dma.run_bytes = bytes;
    return c;
}

/* Encode into an 8-byte aligned buffer; the caller frees it. */
static void *encode(const prog *p, uint64_t *len)
{
    uint64_t deps_bytes = ((uint64_t)p->ndeps * 4 + 7) & ~7ull;
    uint64_t n = sizeof(spy_job_header) + p->nslots * sizeof(spy_slot) + p->ncmds * sizeof(spy_cmd) +
                 deps_bytes + p->ninstrs * sizeof(spy_instr) + p->ndescs * sizeof(spy_desc);
    uint8_t *b = aligned_alloc(8, (n + 7) & ~7ull);
    memset(b, 0, n);
    spy_job_header h = {SPY_JOB_MAGIC, SPY_JOB_VERSION, p->ncmds, p->ndeps, p->ninstrs, p->nslots,
                        p->ndescs, 0, n, {0, 0, 0}};
    uint64_t o = 0;
    memcpy(b, &h, sizeof h);
    o += sizeof h;
    memcpy(b + o, p->slots, p->nslots * sizeof(spy_slot));
    o += p->nslots * sizeof(spy_slot);
    memcpy(b + o, p->cmds, p->ncmds * sizeof(spy_cmd));
    o += p->ncmds * sizeof(spy_cmd);
    memcpy(b + o, p->deps, p->ndeps * 4);
    o += deps_bytes;
    memcpy(b + o, p->instrs, p->ninstrs * sizeof(spy_instr));
    o += p->ninstrs * sizeof(spy_instr);
    memcpy(b + o, p->descs, p->ndescs * sizeof(spy_desc));
    *len = n;
    return b;
}

static char run_error[512];

/* Upload with spy_mem_write, commit and launch; run_error keeps the launch's message. */
static spy_status run(spy_device *d, const prog *p, const uint64_t *bind, double *end)
{
    uint64_t len, addr;
    void *blob = encode(p, &len);
    spy_status s = spy_malloc(d, len, SPY_MEM_CONTROL, &addr);
    if (s == SPY_OK)
        s = spy_mem_write(d, addr, blob, len);
    free(blob);
    if (s == SPY_OK)
        s = spy_program_commit(d, addr, NULL);
    if (s == SPY_OK)
        s = spy_launch(d, addr, bind, p->nslots, 0, end);
    snprintf(run_error, sizeof run_error, "%s", spy_last_error());
    spy_free(d, addr);
    return s;
}

static spy_status validate(spy_device *d, const prog *p)
{
    uint64_t len;
    void *blob = encode(p, &len);
    spy_status s = spy_job_validate(d, blob, len, NULL);
    free(blob);
    return s;
}

/* ---- tests ---- */

static void test_allocator(void)
{
    current = "allocator";
    spy_profile pr = test_profile();
    pr.dram_bytes = 1 << 20;
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    spy_mem_stats st;
    uint64_t a, b, c;
    CHECK_OK(spy_malloc(d, 100, SPY_MEM_DATA, &a));
    CHECK(a % 128 == 0);
    CHECK_OK(spy_malloc(d, 1000, SPY_MEM_DATA, &b));
    CHECK_OK(spy_mem_stats_get(d, &st));
    CHECK(st.allocated == 128 + 1024);
    CHECK(spy_malloc(d, 2u << 20, SPY_MEM_DATA, &c) == SPY_E_OOM);
    CHECK(strstr(spy_last_error(), "requested 2097152 bytes") != NULL);
    CHECK(spy_free(d, a + 1) == SPY_E_BAD_ADDRESS);
    CHECK_OK(spy_free(d, a));
    CHECK_OK(spy_free(d, b));
    CHECK(spy_free(d, b) == SPY_E_BAD_ADDRESS); /* double free is refused */
    CHECK_OK(spy_mem_stats_get(d, &st));
    CHECK(st.allocated == 0 && st.reserved == 128 + 1024);
    CHECK_OK(spy_empty_cache(d));
    CHECK_OK(spy_mem_stats_get(d, &st));
    CHECK(st.reserved == 0 && st.largest_free == pr.dram_bytes && st.fragmentation == 0);
    /* peaks outlive what they measured until reset; accumulated counts until reset */
    CHECK(st.peak_reserved == 128 + 1024 && st.peak_allocated == 128 + 1024);
    CHECK(st.total_allocs == 2 && st.total_frees == 2 && st.num_ooms == 1);
    CHECK_OK(spy_mem_reset_peak(d));
    CHECK_OK(spy_mem_reset_accumulated(d));
    CHECK_OK(spy_mem_stats_get(d, &st));
    CHECK(st.peak_reserved == 0 && st.peak_allocated == 0 && st.data_peak == 0);
    CHECK(st.total_allocs == 0 && st.total_frees == 0 && st.num_ooms == 0);
    /* the whole card can be allocated once the cache is empty */
    CHECK_OK(spy_malloc(d, pr.dram_bytes, SPY_MEM_DATA, &c));
    CHECK_OK(spy_free(d, c));
    for (int i = 0; i < 10000; i++) {
        uint64_t x, y;
        CHECK_OK(spy_malloc(d, (uint64_t)(i % 97) * 64 + 1, SPY_MEM_DATA, &x));
        CHECK_OK(spy_malloc(d, 4096, SPY_MEM_DATA, &y));
        CHECK_OK(spy_free(d, x));
        CHECK_OK(spy_free(d, y));
    }
    CHECK_OK(spy_mem_stats_get(d, &st));
    CHECK(st.allocated == 0 && st.num_allocs == 0);
    CHECK_OK(spy_empty_cache(d));
    CHECK_OK(spy_mem_stats_get(d, &st));
    CHECK(st.largest_free == pr.dram_bytes);
    /* another device with the same ordinal has an address window of its own */
    spy_device *e;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &e));
    CHECK(spy_device_instance(e) > spy_device_instance(d));
    CHECK_OK(spy_malloc(d, 128, SPY_MEM_DATA, &a));
    CHECK_OK(spy_malloc(e, 128, SPY_MEM_DATA, &b));
    CHECK(a != b);
    CHECK(a >> SPY_ADDRESS_WINDOW_SHIFT == (SPY_ADDRESS_BASE >> SPY_ADDRESS_WINDOW_SHIFT) + spy_device_instance(d));
    CHECK(b >> SPY_ADDRESS_WINDOW_SHIFT == (SPY_ADDRESS_BASE >> SPY_ADDRESS_WINDOW_SHIFT) + spy_device_instance(e));
    CHECK(spy_free(e, a) == SPY_E_BAD_ADDRESS); /* one device's address is not the other's */
    CHECK_OK(spy_free(d, a));
    CHECK_OK(spy_free(e, b));
    spy_device_close(e);
    spy_device_close(d);
}

static void test_validation(void)
{
    current = "validation";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    prog p;

    memset(&p, 0, sizeof p); /* DRAM range past the slot */
    uint32_t s0 = slot(&p, SPY_SLOT_DRAM, 4096);
    dma(&p, SPY_OP_LOAD, 0, s0, 4000, 0, 0, 128);
    CHECK(validate(d, &p) == SPY_E_BAD_ADDRESS);
    CHECK(spy_last_error_command() == 0);

    memset(&p, 0, sizeof p); /* scratchpad overflow */
    s0 = slot(&p, SPY_SLOT_DRAM, 4096);
    dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, pr.scratchpad_bytes - 64, 128);
    CHECK(validate(d, &p) == SPY_E_SCRATCHPAD);

    memset(&p, 0, sizeof p); /* a strided pattern whose last run leaves the scratchpad */
    s0 = slot(&p, SPY_SLOT_DRAM, 1 << 20);
    spy_cmd *c = dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 128);
    c->u.dma.ndims = 1;
    c->u.dma.count[0] = 100000;
    c->u.dma.src_stride[0] = 0;
    c->u.dma.dst_stride[0] = 128;
    CHECK(validate(d, &p) == SPY_E_SCRATCHPAD);

    memset(&p, 0, sizeof p); /* dependency cycle */
    s0 = slot(&p, SPY_SLOT_DRAM, 4096);
    spy_cmd *c0 = dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 128);
    dep(&p, c0, 1);
    spy_cmd *c1 = dma(&p, SPY_OP_LOAD, 1, s0, 0, 0, 0, 128);
    dep(&p, c1, 0);
    CHECK(validate(d, &p) == SPY_E_CYCLE);

    memset(&p, 0, sizeof p); /* engine order: depends on a later command of its own engine */
    s0 = slot(&p, SPY_SLOT_DRAM, 4096);
    c0 = dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 128);
    dep(&p, c0, 1);
    dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 128, 128);
    CHECK(validate(d, &p) == SPY_E_CYCLE);

    memset(&p, 0, sizeof p); /* commands sharing dependency entries: more edges than entries */
    for (int i = 0; i < 200; i++) {
        c = cmd(&p, SPY_OP_BARRIER, SPY_CORE_CARD);
        c->dep_begin = 0;
        c->ndeps = i == 0 ? 0 : i == 1 ? 1 : 2;
    }
    p.deps[0] = 0;
    p.deps[1] = 1;
    p.ndeps = 2;
    CHECK_OK(validate(d, &p));
    {
        double end = 0;
        CHECK_OK(run(d, &p, NULL, &end));
        CHECK(end > 0);
    }
    p.deps[0] = 200; /* ... a dependency out of range is still refused */
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    p.deps[0] = 0; /* ... and a cycle through the shared entries is still found */
    p.deps[p.ndeps++] = 199;
    p.cmds[1].dep_begin = 2; /* command 1 waits for 199, which waits for 1 */
    CHECK(validate(d, &p) == SPY_E_CYCLE);

    memset(&p, 0, sizeof p); /* unknown opcode, bad core, self dependency */
    s0 = slot(&p, SPY_SLOT_DRAM, 4096);
    cmd(&p, 99, 0);
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    p.ncmds = 0;
    dma(&p, SPY_OP_LOAD, 32, s0, 0, 0, 0, 128);
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    p.ncmds = 0;
    c = dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 128);
    dep(&p, c, 0);
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);

    memset(&p, 0, sizeof p); /* host slot used as DRAM */
    s0 = slot(&p, SPY_SLOT_HOST, 4096);
    dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 128);
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);

    memset(&p, 0, sizeof p); /* matmul C outside the scratchpad */
    c = cmd(&p, SPY_OP_MATMUL, 0);
    c->u.mm = (spy_matmul){.a_off = 0, .b_off = 0, .c_off = (uint32_t)pr.scratchpad_bytes - 16,
                           .m = 8, .n = 8, .k = 8, .lda = 8, .ldb = 8, .ldc = 8,
                           .a_dtype = SPY_DT_F16, .b_dtype = SPY_DT_F16};
    CHECK(validate(d, &p) == SPY_E_SCRATCHPAD);

    /* typed scratchpad operands on a whole element only: C is fp32, A and B fp16 */
    c->u.mm.c_off = 8193;
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    CHECK(strstr(spy_last_error(), "offset 8193 is not a multiple of its 4-byte elements") != NULL);
    c->u.mm.c_off = 8194;
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    c->u.mm.c_off = 8192;
    c->u.mm.b_off = 1;
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    c->u.mm.b_off = 2;
    CHECK_OK(validate(d, &p));
    memset(&p, 0, sizeof p); /* an SFU source at an odd offset */
    p.instrs[0] = (spy_instr){.op = SPY_SFU_NEG, .rows = 1, .cols = 8,
                              .dst = {.kind = SPY_OPND_TILE, .dtype = SPY_DT_F16, .pitch = 8, .v.off = 0},
                              .src = {{.kind = SPY_OPND_TILE, .dtype = SPY_DT_F16, .pitch = 8, .v.off = 257}}};
    p.ninstrs = 1;
    c = cmd(&p, SPY_OP_SFU, 0);
    c->u.sfu.ninstrs = 1;
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    p.instrs[0].src[0].v.off = 258;
    CHECK_OK(validate(d, &p));
    p.instrs[0].src[0].dtype = SPY_DT_F32; /* 258 is no whole fp32 */
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    p.instrs[0].src[0].dtype = SPY_DT_U8; /* bytes go anywhere */
    p.instrs[0].src[0].v.off = 259;
    CHECK_OK(validate(d, &p));

    /* a truncated or corrupted block */
    memset(&p, 0, sizeof p);
    s0 = slot(&p, SPY_SLOT_DRAM, 4096);
    dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 128);
    uint64_t len;
    uint8_t *blob = encode(&p, &len);
    CHECK(spy_job_validate(d, blob, len - 8, NULL) == SPY_E_BAD_PROGRAM);
    ((spy_job_header *)(void *)blob)->ncmds = 1u << 30;
    CHECK(spy_job_validate(d, blob, len, NULL) == SPY_E_BAD_PROGRAM);
    free(blob);
    spy_device_close(d);
}

/* A hostile program cannot write outside a live allocation: neighbours stay intact. */
static void test_no_stray_writes(void)
{
    current = "no stray writes";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    uint64_t a, b, c;
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &a));
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &b));
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &c));
    uint8_t canary[256];
    memset(canary, 0xAB, sizeof canary);
    CHECK_OK(spy_mem_write(d, a, canary, 256));
    CHECK_OK(spy_mem_write(d, c, canary, 256));
    /* slot extent larger than the allocation it is bound to: refused at launch */
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t s0 = slot(&p, SPY_SLOT_DRAM, 1024);
    dma(&p, SPY_OP_STORE, 0, 0, 0, s0, 512, 128);
    uint64_t bind = b;
    CHECK(run(d, &p, &bind, NULL) == SPY_E_BAD_ADDRESS);
    /* binding to an address that is no allocation at all */
    bind = a + 1000000;
    CHECK(run(d, &p, &bind, NULL) == SPY_E_BAD_ADDRESS);
    uint8_t back[256];
    CHECK_OK(spy_mem_read(d, a, back, 256));
    CHECK(memcmp(back, canary, 256) == 0);
    CHECK_OK(spy_mem_read(d, c, back, 256));
    CHECK(memcmp(back, canary, 256) == 0);
    spy_device_close(d);
}

/* H2D -> LOAD -> SFU -> MATMUL -> STORE -> D2H, checked against a host computation. */
static void test_functional(void)
{
    current = "functional";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    enum { M = 8, K = 64, N = 16 };
    float a[M * K], b[K * N], out[M * N];
    for (int i = 0; i < M * K; i++)
        a[i] = (float)((i * 7) % 13) / 8.0f;
    for (int i = 0; i < K * N; i++)
        b[i] = (float)((i * 5) % 11) / 4.0f - 1.0f;
    uint64_t da, db, dc;
    CHECK_OK(spy_malloc(d, sizeof a, SPY_MEM_DATA, &da));
    CHECK_OK(spy_malloc(d, sizeof b, SPY_MEM_DATA, &db));
    CHECK_OK(spy_malloc(d, sizeof out, SPY_MEM_DATA, &dc));
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t ha = slot(&p, SPY_SLOT_HOST, sizeof a), hb = slot(&p, SPY_SLOT_HOST, sizeof b);
    uint32_t sa = slot(&p, SPY_SLOT_DRAM, sizeof a), sb = slot(&p, SPY_SLOT_DRAM, sizeof b);
    uint32_t sc = slot(&p, SPY_SLOT_DRAM, sizeof out), hc = slot(&p, SPY_SLOT_HOST, sizeof out);
    dma(&p, SPY_OP_H2D, SPY_CORE_CARD, ha, 0, sa, 0, sizeof a);                 /* 0 */
    dma(&p, SPY_OP_H2D, SPY_CORE_CARD, hb, 0, sb, 0, sizeof b);                 /* 1 */
    spy_cmd *c = dma(&p, SPY_OP_LOAD, 3, sa, 0, 0, 0, sizeof a);                /* 2 */
    dep(&p, c, 0);
    c = dma(&p, SPY_OP_LOAD, 3, sb, 0, 0, 4096, sizeof b);                      /* 3 */
    dep(&p, c, 1);
    /* A <- A * 2 + 1 on the SFU, in place */
    spy_instr *in = &p.instrs[p.ninstrs++];
    memset(in, 0, sizeof *in);
    in->op = SPY_SFU_MUL;
    in->rows = M;
    in->cols = K;
    in->dst = (spy_operand){SPY_OPND_TILE, SPY_DT_F32, 0, K, {.off = 0}};
    in->src[0] = in->dst;
    in->src[1] = (spy_operand){SPY_OPND_IMM, SPY_DT_F32, 0, 0, {.imm_f = 2.0}};
    in = &p.instrs[p.ninstrs++];
    memset(in, 0, sizeof *in);
    in->op = SPY_SFU_ADD;
    in->rows = M;
    in->cols = K;
    in->dst = (spy_operand){SPY_OPND_TILE, SPY_DT_F32, 0, K, {.off = 0}};
    in->src[0] = in->dst;
    in->src[1] = (spy_operand){SPY_OPND_IMM, SPY_DT_F32, 0, 0, {.imm_f = 1.0}};
    c = cmd(&p, SPY_OP_SFU, 3);                                                  /* 4 */
    c->u.sfu.instr_begin = 0;
    c->u.sfu.ninstrs = 2;
    dep(&p, c, 2);
    c = cmd(&p, SPY_OP_MATMUL, 3);                                               /* 5 */
    c->u.mm = (spy_matmul){.a_off = 0, .b_off = 4096, .c_off = 16384, .m = M, .n = N, .k = K,
                           .lda = K, .ldb = N, .ldc = N, .a_dtype = SPY_DT_F32, .b_dtype = SPY_DT_F32};
    dep(&p, c, 3);
    dep(&p, c, 4);
    c = dma(&p, SPY_OP_STORE, 3, 0, 16384, sc, 0, sizeof out);                  /* 6 */
    dep(&p, c, 5);
    c = dma(&p, SPY_OP_D2H, SPY_CORE_CARD, sc, 0, hc, 0, sizeof out);           /* 7 */
    dep(&p, c, 6);
    uint64_t bind[6] = {(uint64_t)(uintptr_t)a, (uint64_t)(uintptr_t)b, da, db, dc,
                        (uint64_t)(uintptr_t)out};
    memset(out, 0, sizeof out);
    double end = 0;
    CHECK_OK(run(d, &p, bind, &end));
    CHECK(end > 0);
    int bad = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (double)(a[i * K + k] * 2 + 1) * b[k * N + j];
            if (fabs(s - out[i * N + j]) > 1e-4 * (1 + fabs(s)))
                bad++;
        }
    CHECK(bad == 0);

    /* the same stream in timing mode takes the same device time */
    spy_device *t;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 1, &t));
    uint64_t ta, tb, tc;
    CHECK_OK(spy_malloc(t, sizeof a, SPY_MEM_DATA, &ta));
    CHECK_OK(spy_malloc(t, sizeof b, SPY_MEM_DATA, &tb));
    CHECK_OK(spy_malloc(t, sizeof out, SPY_MEM_DATA, &tc));
    uint64_t tbind[6] = {bind[0], bind[1], ta, tb, tc, bind[5]};
    double tend = 0;
    double fstart = end; /* functional job started after launch latency too */
    (void)fstart;
    CHECK_OK(run(t, &p, tbind, &tend));
    spy_counters fc, tcn;
    CHECK_OK(spy_counters_get(d, &fc));
    CHECK_OK(spy_counters_get(t, &tcn));
    CHECK(fc.device_busy_ns == tcn.device_busy_ns);
    if (fc.device_busy_ns != tcn.device_busy_ns)
        fprintf(stderr, "functional %.3f ns, timing %.3f ns\n", fc.device_busy_ns, tcn.device_busy_ns);
    spy_device_close(t);
    spy_device_close(d);
}

static double one_job_busy(spy_device *d, const prog *p, const uint64_t *bind)
{
    spy_counters before, after;
    spy_counters_get(d, &before);
    CHECK_OK(run(d, p, bind, NULL));
    spy_counters_get(d, &after);
    return after.device_busy_ns - before.device_busy_ns;
}

static void test_cost_model(void)
{
    current = "cost model";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    uint64_t big;
    CHECK_OK(spy_malloc(d, 64u << 20, SPY_MEM_DATA, &big));
    prog p;
    /* one core loading 1 MiB: port bound at 48 B/ns */
    memset(&p, 0, sizeof p);
    uint32_t s0 = slot(&p, SPY_SLOT_DRAM, 64u << 20);
    dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 1u << 20);
    double t = one_job_busy(d, &p, &big);
    CHECK(NEAR(t, 500 + (1u << 20) / 48.0, 0.01));
    /* all 32 cores load 1 MiB at once: DRAM bound at 150 B/ns shared */
    memset(&p, 0, sizeof p);
    s0 = slot(&p, SPY_SLOT_DRAM, 64u << 20);
    for (uint16_t c = 0; c < 32; c++)
        dma(&p, SPY_OP_LOAD, c, s0, (uint64_t)c << 20, 0, 0, 1u << 20);
    t = one_job_busy(d, &p, &big);
    CHECK(NEAR(t, 500 + 32.0 * (1u << 20) / 150.0, 0.01));
    /* a compute-bound matmul tile: 256x256x512 fp16 */
    memset(&p, 0, sizeof p);
    spy_cmd *c = cmd(&p, SPY_OP_MATMUL, 0);
    c->u.mm = (spy_matmul){.a_off = 0, .b_off = 262144, .c_off = 786432, .m = 256, .n = 256,
                           .k = 512, .lda = 512, .ldb = 256, .ldc = 256, .a_dtype = SPY_DT_F16,
                           .b_dtype = SPY_DT_F16};
    t = one_job_busy(d, &p, NULL);
    CHECK(NEAR(t, 50 + 256.0 * 256 * 512 / (1536 * 0.75), 0.01));
    /* an odd-shaped tile pays for the padding of the arrays */
    c->u.mm.m = 1;
    c->u.mm.n = 100;
    t = one_job_busy(d, &p, NULL);
    CHECK(NEAR(t, 50 + 8.0 * 128 * 512 / (1536 * 0.75), 0.01));
    /* a PCIe transfer of 4 MiB */
    memset(&p, 0, sizeof p);
    uint32_t h = slot(&p, SPY_SLOT_HOST, 4u << 20);
    s0 = slot(&p, SPY_SLOT_DRAM, 4u << 20);
    dma(&p, SPY_OP_H2D, SPY_CORE_CARD, h, 0, s0, 0, 4u << 20);
    static uint8_t host[1];
    uint64_t bind[2] = {(uint64_t)(uintptr_t)host, big};
    t = one_job_busy(d, &p, bind);
    CHECK(NEAR(t, 1000 + 2 + (4u << 20) / 50.0, 0.01));
    spy_device_close(d);
}

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Busy work on the calling thread until its CPU clock has advanced by ns. */
static void spin_cpu_ns(uint64_t ns)
{
    uint64_t t0 = thread_cpu_ns();
    volatile uint64_t x = 0;
    while (thread_cpu_ns() - t0 < ns)
        x = x + 1;
}

struct spinner {
    spy_device *d;
    uint64_t ns;
};

static void *spin_on_device(void *arg)
{
    struct spinner *sp = arg;
    (void)spy_host_clock_ns(sp->d); /* the thread's first call: its CPU time counts from here */
    struct timespec nap = {0, 10000000};
    nanosleep(&nap, NULL); /* asleep: not counted */
    spin_cpu_ns(sp->ns);
    (void)spy_host_clock_ns(sp->d);
    return NULL;
}

/* The host clock is the CPU time of the threads that call into the device, each counted from
 * its first call: another thread's work moves it when that thread calls; sleeping does not. */
static void test_host_clock_threads(void)
{
    current = "host clock threads";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    spin_cpu_ns(1000000); /* before the thread's next call: counted then */
    uint64_t h0 = spy_host_clock_ns(d);
    CHECK(h0 >= 1000000);
    struct spinner sp = {d, 3000000};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, spin_on_device, &sp) == 0);
    CHECK(pthread_join(t, NULL) == 0); /* blocked: not CPU time of this thread */
    uint64_t h1 = spy_host_clock_ns(d);
    CHECK(h1 - h0 >= 3000000);
    /* wall time would count the 10 ms nap twice (the spinner's, and this thread's wait);
     * the slack is for a virtual machine's stolen time, which counts as the spinner's */
    CHECK(h1 - h0 < 3000000 + 7000000);
    spy_device_close(d);
}

/* The device's own clock (spy_clock.work_ns) counts each job's launch latency and run and
 * nothing of the time the device sits idle waiting for the host; spy_synchronize_until
 * waits for a point of the timeline, never past the device's finish. */
static void test_clocks(void)
{
    current = "clocks";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    uint64_t big;
    CHECK_OK(spy_malloc(d, 32u << 20, SPY_MEM_DATA, &big));
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t s0 = slot(&p, SPY_SLOT_DRAM, 32u << 20);
    for (uint16_t c = 0; c < 32; c++)
        dma(&p, SPY_OP_LOAD, c, s0, (uint64_t)c << 20, 0, 0, 1u << 20);
    double job = pr.job_launch_ns + 500 + 32.0 * (1u << 20) / 150.0;
    spy_clock c0, c1, c2;
    CHECK_OK(spy_clock_read(d, &c0));
    CHECK(c0.work_ns == 0 && c0.finish_ns == 0);
    CHECK_OK(run(d, &p, &big, NULL));
    CHECK_OK(spy_clock_read(d, &c1));
    CHECK(NEAR(c1.work_ns - c0.work_ns, job, 1e-9));
    CHECK(c1.finish_ns >= c1.work_ns);
    /* the host sleeps 2 ms: off the CPU, so the host clock does not count it (its wall twin
     * does) and the card does not idle for it */
    struct timespec nap = {0, 2000000};
    nanosleep(&nap, NULL);
    CHECK_OK(run(d, &p, &big, NULL));
    CHECK_OK(spy_clock_read(d, &c2));
    CHECK(NEAR(c2.work_ns - c1.work_ns, job, 1e-9));
    CHECK(c2.host_wall_ns >= c1.host_wall_ns + 2000000);
    CHECK(c2.host_ns - c1.host_ns < 2000000);
    /* the host works 2 ms of CPU time: the host clock counts it, and the timeline grows by
     * that much more, the work clock not */
    spin_cpu_ns(2000000);
    CHECK_OK(run(d, &p, &big, NULL));
    spy_clock c3;
    CHECK_OK(spy_clock_read(d, &c3));
    CHECK(c3.host_ns >= c2.host_ns + 2000000);
    CHECK(c3.host_wall_ns >= c2.host_wall_ns + 2000000);
    CHECK(NEAR(c3.work_ns - c2.work_ns, job, 1e-9));
    CHECK(c3.finish_ns - (double)c2.host_ns >= job + 2e6);
    c2 = c3;
    /* waiting for a point the device passed long ago costs nothing */
    spy_counters k0, k1;
    CHECK_OK(spy_counters_get(d, &k0));
    CHECK_OK(spy_synchronize_until(d, c1.finish_ns));
    CHECK_OK(spy_counters_get(d, &k1));
    CHECK(k1.wait_ns == k0.wait_ns);
    /* waiting for a point beyond the finish waits for the finish only */
    CHECK_OK(spy_synchronize_until(d, c2.finish_ns + 1e12));
    CHECK_OK(spy_clock_read(d, &c1));
    CHECK(c1.host_ns >= (uint64_t)c2.finish_ns);
    CHECK_OK(spy_counters_get(d, &k1));
    CHECK(k1.wait_ns - k0.wait_ns <= (uint64_t)ceil(c2.finish_ns));
    CHECK(spy_synchronize_until(d, NAN) == SPY_E_INVALID_ARG);
    CHECK(spy_clock_read(d, NULL) == SPY_E_INVALID_ARG);
    CHECK(spy_clock_read(NULL, &c1) == SPY_E_INVALID_ARG);
    spy_device_close(d);
}

/* A committed program launched again in timing mode is charged the duration of its first
 * run without its commands being walked again -- unless the trace records commands or a
 * fault is armed, which both need the walk. */
static void test_timing_reuses_a_jobs_duration(void)
{
    current = "timing reuses a job's duration";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    uint64_t big, addr, len;
    CHECK_OK(spy_malloc(d, 32u << 20, SPY_MEM_DATA, &big));
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t s0 = slot(&p, SPY_SLOT_DRAM, 32u << 20);
    for (uint16_t c = 0; c < 32; c++)
        dma(&p, SPY_OP_LOAD, c, s0, (uint64_t)c << 20, 0, 0, 1u << 20);
    void *blob = encode(&p, &len);
    CHECK_OK(spy_malloc(d, len, SPY_MEM_CONTROL, &addr));
    CHECK_OK(spy_mem_write(d, addr, blob, len));
    free(blob);
    CHECK_OK(spy_program_commit(d, addr, NULL));
    double busy[5];
    spy_counters c0, c1;
    for (int i = 0; i < 5; i++) {
        if (i == 2)
            CHECK_OK(spy_trace_enable(d, 1, 1));
        if (i == 3) {
            CHECK_OK(spy_trace_enable(d, 1, 0));
            CHECK_OK(spy_fault_inject(d, SPY_FAULT_DMA, 4));
            CHECK(spy_launch(d, addr, &big, 1, 0, NULL) == SPY_E_DMA);
        }
        uint64_t events = spy_trace_count(d);
        CHECK_OK(spy_counters_get(d, &c0));
        CHECK_OK(spy_launch(d, addr, &big, 1, 0, NULL));
        CHECK_OK(spy_counters_get(d, &c1));
        busy[i] = c1.device_busy_ns - c0.device_busy_ns;
        CHECK(c1.jobs == c0.jobs + 1 && c1.commands == c0.commands + 32);
        if (i == 2) /* every command, the job and the launch */
            CHECK(spy_trace_count(d) == events + 34);
        if (i == 4) /* the job and the launch */
            CHECK(spy_trace_count(d) == events + 2);
    }
    CHECK(NEAR(busy[0], 500 + 32.0 * (1u << 20) / 150.0, 0.01));
    for (int i = 1; i < 5; i++)
        CHECK(NEAR(busy[i], busy[0], 1e-12));
    spy_device_close(d);
}

static void test_gather_and_faults(void)
{
    current = "gather and faults";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    uint64_t table, idx;
    CHECK_OK(spy_malloc(d, 10 * 128, SPY_MEM_DATA, &table));
    CHECK_OK(spy_malloc(d, 128, SPY_MEM_DATA, &idx));
    int64_t rows[2] = {3, 12};
    CHECK_OK(spy_mem_write(d, idx, rows, sizeof rows));
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t st = slot(&p, SPY_SLOT_DRAM, 10 * 128), si = slot(&p, SPY_SLOT_DRAM, 128);
    dma(&p, SPY_OP_LOAD, 0, si, 0, 0, 0, 16);
    spy_cmd *c = cmd(&p, SPY_OP_GATHER, 0);
    c->u.gather = (spy_gather){.table_slot = st, .idx_off = 0, .idx_dtype = SPY_DT_I64, .nidx = 2,
                               .table_off = 0, .row_stride = 128, .limit = 10, .lx_off = 1024,
                               .lx_pitch = 128, .run_bytes = 128};
    dep(&p, c, 0);
    uint64_t bind[2] = {table, idx};
    CHECK(run(d, &p, bind, NULL) == SPY_E_INDEX);
    CHECK(strstr(run_error, "index 12") != NULL);
    rows[1] = 9;
    CHECK_OK(spy_mem_write(d, idx, rows, sizeof rows));
    CHECK_OK(run(d, &p, bind, NULL));
    /* injected faults surface typed and the next call works */
    CHECK_OK(spy_fault_inject(d, SPY_FAULT_DMA, 0));
    CHECK(run(d, &p, bind, NULL) == SPY_E_DMA);
    CHECK_OK(run(d, &p, bind, NULL));
    CHECK_OK(spy_fault_inject(d, SPY_FAULT_COMMAND, 1));
    CHECK(run(d, &p, bind, NULL) == SPY_E_COMMAND_FAULT);
    CHECK_OK(run(d, &p, bind, NULL));
    CHECK_OK(spy_fault_inject(d, SPY_FAULT_LOST, 0));
    CHECK(run(d, &p, bind, NULL) == SPY_E_DEVICE_LOST);
    uint64_t x;
    CHECK(spy_malloc(d, 128, SPY_MEM_DATA, &x) == SPY_E_DEVICE_LOST);
    CHECK(spy_mem_read(d, idx, rows, sizeof rows) == SPY_E_DEVICE_LOST);
    CHECK(spy_mem_write(d, idx, rows, sizeof rows) == SPY_E_DEVICE_LOST);
    CHECK(strstr(spy_last_error(), "lost; reset it") != NULL);
    uint64_t before = spy_device_epoch(d);
    CHECK_OK(spy_device_reset(d));
    CHECK(spy_device_epoch(d) == before + 1);
    CHECK_OK(spy_malloc(d, 128, SPY_MEM_DATA, &x));
    /* table was allocated before the reset: freeing it in its epoch leaves a newer
     * allocation at the same address alone */
    CHECK(x == table);
    CHECK_OK(spy_free_epoch(d, table, before));
    spy_mem_stats ms;
    CHECK_OK(spy_mem_stats_get(d, &ms));
    CHECK(ms.num_allocs == 1);
    CHECK_OK(spy_free_epoch(d, x, before + 1)); /* freed in the epoch it was made in */
    CHECK(spy_free_epoch(d, x, before + 1) == SPY_E_BAD_ADDRESS);
    CHECK_OK(spy_mem_stats_get(d, &ms));
    CHECK(ms.num_allocs == 0);
    spy_device_close(d);
}

static void test_plan(void)
{
    current = "plan";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    /* a job copying 256 bytes from slot 0 to slot 1 through the scratchpad */
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t s0 = slot(&p, SPY_SLOT_DRAM, 256), s1 = slot(&p, SPY_SLOT_DRAM, 256);
    dma(&p, SPY_OP_LOAD, 0, s0, 0, 0, 0, 256);
    spy_cmd *c = dma(&p, SPY_OP_STORE, 0, 0, 0, s1, 0, 256);
    dep(&p, c, 0);
    uint64_t plen;
    uint8_t *job = encode(&p, &plen);
    /* plan: job0 copies binding0 -> arena+0, job1 copies arena+0 -> binding1 */
    uint64_t total = sizeof(spy_plan_header) + 2 * sizeof(spy_plan_job) + 4 * sizeof(spy_reloc) +
                     3 * sizeof(spy_layout);
    uint64_t off0 = total, off1 = total + plen;
    total += 2 * plen;
    uint8_t *blob = aligned_alloc(8, total);
    memset(blob, 0, total);
    spy_plan_header h = {SPY_PLAN_MAGIC, SPY_PLAN_VERSION, 2, 4, 3, 0, total, {0}}; /* no groups */
    memcpy(blob, &h, sizeof h);
    spy_plan_job jobs[2] = {{off0, plen, 0, 2, 0, 0}, {off1, plen, 2, 2, 0, 0}};
    memcpy(blob + sizeof h, jobs, sizeof jobs);
    spy_reloc rel[4] = {{0, 0, 0}, {2, 0, 512}, {2, 0, 512}, {1, 0, 0}};
    memcpy(blob + sizeof h + sizeof jobs, rel, sizeof rel);
    /* binding 0 must be a storage of 2 rows of 32 floats; the others are not checked */
    spy_layout lay[3] = {{2, 32, 4, pr.stick_bytes}, {0, 0, 0, 0}, {0, 0, 0, 0}};
    memcpy(blob + sizeof h + sizeof jobs + sizeof rel, lay, sizeof lay);
    memcpy(blob + off0, job, plen);
    memcpy(blob + off1, job, plen);
    spy_plan *plan;
    CHECK_OK(spy_plan_create(d, blob, total, &plan));
    uint64_t ext;
    CHECK_OK(spy_plan_binding_extent(plan, 2, &ext));
    CHECK(ext == 768);
    uint64_t in, out, arena;
    CHECK_OK(spy_malloc_layout(d, 256, SPY_MEM_DATA, &lay[0], &in));
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &out));
    CHECK_OK(spy_malloc(d, 1024, SPY_MEM_DATA, &arena));
    uint8_t data[256], back[256];
    for (int i = 0; i < 256; i++)
        data[i] = (uint8_t)i;
    CHECK_OK(spy_mem_write(d, in, data, 256));
    spy_counters c0, c1;
    spy_counters_get(d, &c0);
    uint64_t bind[3] = {in, out, arena};
    CHECK_OK(spy_plan_launch(plan, bind, 3, 0, NULL));
    spy_counters_get(d, &c1);
    CHECK(c1.native_calls - c0.native_calls == 1);
    CHECK(c1.jobs - c0.jobs == 2);
    CHECK_OK(spy_mem_read(d, out, back, 256));
    CHECK(memcmp(back, data, 256) == 0);
    /* an arena too small for the relocated extents is refused before anything runs */
    uint64_t small;
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &small));
    bind[2] = small;
    CHECK(spy_plan_launch(plan, bind, 3, 0, NULL) == SPY_E_BAD_ADDRESS);
    bind[2] = arena;
    /* a storage of the same bytes in another layout, or none, is refused before any job */
    spy_layout other = {1, 64, 4, pr.stick_bytes};
    uint64_t in2, in3;
    CHECK_OK(spy_malloc_layout(d, 256, SPY_MEM_DATA, &other, &in2));
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &in3));
    spy_counters_get(d, &c0);
    bind[0] = in2;
    CHECK(spy_plan_launch(plan, bind, 3, 0, NULL) == SPY_E_LAYOUT);
    CHECK(strstr(spy_last_error(), "plan binding 0") != NULL);
    bind[0] = in3;
    CHECK(spy_plan_launch(plan, bind, 3, 0, NULL) == SPY_E_LAYOUT);
    spy_counters_get(d, &c1);
    CHECK(c1.jobs == c0.jobs);
    bind[0] = in;
    CHECK_OK(spy_plan_launch(plan, bind, 3, 0, NULL));
    spy_plan_destroy(plan);
    /* two jobs naming one program share its resident copy (uploaded and committed once),
     * each on its own relocations; the copy is freed once, with the plan */
    spy_plan_job *shared = (spy_plan_job *)(void *)(blob + sizeof h);
    shared[1].prog_off = off0;
    spy_mem_stats before_share;
    CHECK_OK(spy_mem_stats_get(d, &before_share));
    spy_counters_get(d, &c0);
    CHECK_OK(spy_plan_create(d, blob, total, &plan));
    spy_counters_get(d, &c1);
    CHECK(c1.bytes_h2d - c0.bytes_h2d == plen);
    spy_mem_stats with_share;
    CHECK_OK(spy_mem_stats_get(d, &with_share));
    CHECK(with_share.num_allocs == before_share.num_allocs + 1);
    memset(back, 0, sizeof back);
    CHECK_OK(spy_mem_write(d, out, back, 256));
    CHECK_OK(spy_plan_launch(plan, bind, 3, 0, NULL));
    CHECK_OK(spy_mem_read(d, out, back, 256));
    CHECK(memcmp(back, data, 256) == 0);
    spy_plan_destroy(plan);
    CHECK_OK(spy_mem_stats_get(d, &with_share));
    CHECK(with_share.num_allocs == before_share.num_allocs);
    shared[1].prog_off = off1;
    /* a plan made on a lost device is refused and leaves nothing behind (LeakSanitizer) */
    CHECK_OK(spy_plan_create(d, blob, total, &plan));
    CHECK_OK(spy_fault_inject(d, SPY_FAULT_LOST, 0));
    CHECK(spy_plan_launch(plan, bind, 3, 0, NULL) == SPY_E_DEVICE_LOST);
    spy_plan *none = NULL;
    CHECK(spy_plan_create(d, blob, total, &none) == SPY_E_DEVICE_LOST && !none);
    spy_plan_destroy(plan);
    CHECK_OK(spy_device_reset(d));
    /* a malformed binding layout is refused when the plan is made */
    spy_layout *pl = (spy_layout *)(void *)(blob + sizeof h + sizeof jobs + sizeof rel);
    pl[1].itemsize = 3;
    pl[1].rows = pl[1].row_len = 1;
    pl[1].stick_bytes = pr.stick_bytes;
    CHECK(spy_plan_create(d, blob, total, &plan) == SPY_E_BAD_PROGRAM);
    pl[1] = (spy_layout){0, 0, 0, 0};
    /* hostile plan blocks */
    spy_plan_header *hh = (spy_plan_header *)(void *)blob;
    hh->nrelocs = 1u << 30;
    CHECK(spy_plan_create(d, blob, total, &plan) == SPY_E_BAD_PROGRAM);
    hh->nrelocs = 4;
    spy_plan_job *pj = (spy_plan_job *)(void *)(blob + sizeof h);
    pj[1].prog_off = total - 8;
    CHECK(spy_plan_create(d, blob, total, &plan) == SPY_E_BAD_PROGRAM);
    pj[1].prog_off = off1;
    spy_reloc *pr2 = (spy_reloc *)(void *)(blob + sizeof h + sizeof jobs);
    pr2[3].binding = 7;
    CHECK(spy_plan_create(d, blob, total, &plan) == SPY_E_BAD_PROGRAM);
    pr2[3].binding = 1;
    CHECK_OK(spy_plan_create(d, blob, total, &plan));
    spy_plan_destroy(plan);
    /* a job with a host slot (a valid D2H program): plans bind device memory only */
    memset(&p, 0, sizeof p);
    s0 = slot(&p, SPY_SLOT_DRAM, 256);
    uint32_t hs = slot(&p, SPY_SLOT_HOST, 256);
    dma(&p, SPY_OP_D2H, SPY_CORE_CARD, s0, 0, hs, 0, 256);
    dep(&p, cmd(&p, SPY_OP_BARRIER, SPY_CORE_CARD), 0); /* the size of the copy job */
    uint64_t hlen;
    uint8_t *hjob = encode(&p, &hlen);
    CHECK_OK(spy_job_validate(d, hjob, hlen, NULL));
    CHECK(hlen == plen);
    memcpy(blob + off1, hjob, hlen);
    free(hjob);
    CHECK(spy_plan_create(d, blob, total, &plan) == SPY_E_BAD_PROGRAM);
    CHECK(strstr(spy_last_error(), "plan job 1 slot 1 is a host slot") != NULL);
    /* a job the validator refuses: the message names the job, then the command */
    spy_cmd *bad = (spy_cmd *)(void *)(blob + off0 + sizeof(spy_job_header) + 2 * sizeof(spy_slot));
    bad->u.dma.src_off = 1 << 20;
    CHECK(spy_plan_create(d, blob, total, &plan) == SPY_E_BAD_ADDRESS);
    CHECK(strncmp(spy_last_error(), "plan job 0: command 0: source range [1048576, +256)", 51) == 0);
    CHECK(spy_last_error_command() == 0);
    spy_mem_stats ms;
    CHECK_OK(spy_mem_stats_get(d, &ms));
    CHECK(ms.control == 0); /* failed plan creations leave nothing behind */
    free(blob);
    free(job);
    spy_device_close(d);
}

static void test_sfu(void)
{
    current = "sfu";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    enum { R = 3, C = 5 };
    float x[R * C];
    for (int i = 0; i < R * C; i++)
        x[i] = (float)(i % 7) - 3.0f;
    uint64_t dx, dy;
    CHECK_OK(spy_malloc(d, 4096, SPY_MEM_DATA, &dx));
    CHECK_OK(spy_malloc(d, 4096, SPY_MEM_DATA, &dy));
    CHECK_OK(spy_mem_write(d, dx, x, sizeof x));
    prog p;
    memset(&p, 0, sizeof p);
    uint32_t sx = slot(&p, SPY_SLOT_DRAM, 4096), sy = slot(&p, SPY_SLOT_DRAM, 4096);
    dma(&p, SPY_OP_LOAD, 0, sx, 0, 0, 0, sizeof x);
    /* row max (softmax pattern) into ROW at 1024, then x - max, exp, row sum, divide */
    spy_operand tile = {SPY_OPND_TILE, SPY_DT_F32, 0, C, {.off = 0}};
    spy_operand row = {SPY_OPND_ROW, SPY_DT_F32, 0, 1, {.off = 1024}};
    spy_operand row2 = {SPY_OPND_ROW, SPY_DT_F32, 0, 1, {.off = 2048}};
    spy_instr ins[5];
    memset(ins, 0, sizeof ins);
    ins[0] = (spy_instr){.op = SPY_SFU_RMAX, .rows = R, .cols = C, .dst = row, .src = {tile}};
    ins[1] = (spy_instr){.op = SPY_SFU_SUB, .rows = R, .cols = C, .dst = tile, .src = {tile, row}};
    ins[2] = (spy_instr){.op = SPY_SFU_EXP, .rows = R, .cols = C, .dst = tile, .src = {tile}};
    ins[3] = (spy_instr){.op = SPY_SFU_RSUM, .rows = R, .cols = C, .dst = row2, .src = {tile}};
    ins[4] = (spy_instr){.op = SPY_SFU_DIV, .rows = R, .cols = C, .dst = tile, .src = {tile, row2}};
    memcpy(p.instrs, ins, sizeof ins);
    p.ninstrs = 5;
    spy_cmd *c = cmd(&p, SPY_OP_SFU, 0);
    c->u.sfu.ninstrs = 5;
    dep(&p, c, 0);
    c = dma(&p, SPY_OP_STORE, 0, 0, 0, sy, 0, sizeof x);
    dep(&p, c, 1);
    uint64_t bind[2] = {dx, dy};
    CHECK_OK(run(d, &p, bind, NULL));
    float y[R * C];
    CHECK_OK(spy_mem_read(d, dy, y, sizeof y));
    for (int r = 0; r < R; r++) {
        float m = x[r * C], s = 0;
        for (int k = 1; k < C; k++)
            m = fmaxf(m, x[r * C + k]);
        for (int k = 0; k < C; k++)
            s += expf(x[r * C + k] - m);
        for (int k = 0; k < C; k++)
            CHECK(fabsf(y[r * C + k] - expf(x[r * C + k] - m) / s) < 1e-6f);
    }
    /* an extra operand on a unary op is rejected */
    p.instrs[2].src[1] = row;
    CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
    spy_device_close(d);
}

/* The SFU op table drives validation and cost: every opcode in it (and only those) is
 * accepted with its arity, and costs its class's cycles per element. */
static void test_sfu_table(void)
{
    current = "sfu table";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    const spy_sfu_op *ops;
    uint32_t nops;
    CHECK_OK(spy_sfu_ops(&ops, &nops));
    CHECK(nops > 0);
    CHECK(spy_sfu_ops(NULL, &nops) == SPY_E_INVALID_ARG);
    const spy_sfu_op *by_opcode[256] = {0};
    for (uint32_t k = 0; k < nops; k++) {
        CHECK(ops[k].name != NULL && ops[k].opcode < 256);
        CHECK(k == 0 || ops[k].opcode > ops[k - 1].opcode); /* opcode order, no repeats */
        CHECK(ops[k].arity >= 1 && ops[k].arity <= 3);
        by_opcode[ops[k].opcode] = &ops[k];
    }
    CHECK(by_opcode[SPY_SFU_SELECT] && by_opcode[SPY_SFU_SELECT]->arity == 3);
    CHECK(by_opcode[SPY_SFU_EXP] && by_opcode[SPY_SFU_EXP]->cost == SPY_SFU_COST_TRANSCENDENTAL);
    CHECK(by_opcode[SPY_SFU_RSUM] && by_opcode[SPY_SFU_RSUM]->kind == SPY_SFU_KIND_REDUCE);
    spy_operand tile = {SPY_OPND_TILE, SPY_DT_F32, 0, 16, {.off = 0}};
    spy_operand row = {SPY_OPND_ROW, SPY_DT_F32, 0, 1, {.off = 4096}};
    spy_operand imm = {SPY_OPND_IMM, SPY_DT_F32, 0, 0, {.imm_f = 1.0}};
    for (uint32_t code = 0; code < 256; code++) {
        const spy_sfu_op *op = by_opcode[code];
        prog p;
        memset(&p, 0, sizeof p);
        spy_instr *ins = &p.instrs[0];
        p.ninstrs = 1;
        ins->op = (uint8_t)code;
        ins->rows = 4;
        ins->cols = 16;
        ins->dst = op && op->kind == SPY_SFU_KIND_REDUCE ? row : tile;
        uint32_t arity = op ? op->arity : 1;
        for (uint32_t a = 0; a < arity; a++)
            ins->src[a] = op && op->kind == SPY_SFU_KIND_IOTA ? imm : tile;
        cmd(&p, SPY_OP_SFU, 0)->u.sfu.ninstrs = 1;
        if (!op) {
            CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
            continue;
        }
        CHECK(validate(d, &p) == SPY_OK);
        double per = op->cost == SPY_SFU_COST_TRANSCENDENTAL ? pr.sfu_transcendental_cycles : 1.0;
        double t = one_job_busy(d, &p, NULL);
        CHECK(NEAR(t, pr.sfu_latency_ns + 64 * per / pr.sfu_elems_per_cycle / pr.clock_ghz, 1e-9));
        if (arity < 3) { /* one operand too many */
            ins->src[arity] = tile;
            CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
            ins->src[arity].kind = SPY_OPND_NONE;
        }
        if (arity > 1) { /* one too few */
            ins->src[arity - 1].kind = SPY_OPND_NONE;
            CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
            ins->src[arity - 1] = tile;
        }
        if (op->aux_max < 255) {
            ins->aux = (uint8_t)(op->aux_max + 1);
            CHECK(validate(d, &p) == SPY_E_BAD_COMMAND);
        }
    }
    spy_device_close(d);
}

/* An SFU instruction with an fp32 destination or source in the scratchpad runs at
 * sfu_fp32_ratio of the element rate; one on fp16 operands (an fp32 immediate included)
 * at the full rate. */
static void test_sfu_fp32_rate(void)
{
    current = "sfu fp32 rate";
    spy_profile pr = test_profile();
    pr.sfu_fp32_ratio = 0.5;
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    spy_operand h = {SPY_OPND_TILE, SPY_DT_F16, 0, 16, {.off = 0}};
    spy_operand f = {SPY_OPND_TILE, SPY_DT_F32, 0, 16, {.off = 4096}};
    spy_operand imm = {SPY_OPND_IMM, SPY_DT_F32, 0, 0, {.imm_f = 2.0}};
    struct {
        uint8_t op;
        spy_operand dst, src0, src1;
        double per, ratio;
    } cases[] = {
        {SPY_SFU_EXP, h, h, {0}, 4, 1},     /* fp16 throughout */
        {SPY_SFU_EXP, f, f, {0}, 4, 0.5},   /* fp32 throughout */
        {SPY_SFU_EXP, f, h, {0}, 4, 0.5},   /* widening: the destination is fp32 */
        {SPY_SFU_EXP, h, f, {0}, 4, 0.5},   /* narrowing: a source is fp32 */
        {SPY_SFU_ADD, h, h, imm, 1, 1},     /* an fp32 immediate is no stream of elements */
        {SPY_SFU_ADD, h, h, f, 1, 0.5},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        prog p;
        memset(&p, 0, sizeof p);
        spy_instr *ins = &p.instrs[0];
        p.ninstrs = 1;
        ins->op = cases[i].op;
        ins->rows = 4;
        ins->cols = 16;
        ins->dst = cases[i].dst;
        ins->src[0] = cases[i].src0;
        ins->src[1] = cases[i].src1;
        cmd(&p, SPY_OP_SFU, 0)->u.sfu.ninstrs = 1;
        double t = one_job_busy(d, &p, NULL);
        double rate = pr.sfu_elems_per_cycle * cases[i].ratio;
        CHECK(NEAR(t, pr.sfu_latency_ns + 64 * cases[i].per / rate / pr.clock_ghz, 1e-9));
    }
    spy_device_close(d);
}

static void set_figure(spy_profile *p, const spy_figure *f, double v)
{
    char *at = (char *)p + f->offset;
    if (f->type == SPY_FIGURE_U32) {
        uint32_t x = (uint32_t)v;
        memcpy(at, &x, sizeof x);
    } else if (f->type == SPY_FIGURE_U64) {
        uint64_t x = (uint64_t)v;
        memcpy(at, &x, sizeof x);
    } else {
        memcpy(at, &v, sizeof v);
    }
}

/* Every declared figure (spy_profile's fields are made from the same declaration) is
 * range-checked from its declaration. */
static void test_profile_figures(void)
{
    current = "profile figures";
    const spy_figure *fig;
    uint32_t n;
    CHECK_OK(spy_profile_figures(&fig, &n));
    CHECK(n > 0 && fig[n - 1].offset + (fig[n - 1].type == SPY_FIGURE_U32 ? 4 : 8) == sizeof(spy_profile));
    spy_profile good = test_profile();
    CHECK_OK(spy_profile_check(&good));
    CHECK(spy_profile_check(NULL) == SPY_E_INVALID_ARG);
    for (uint32_t i = 0; i < n; i++) {
        const spy_figure *f = &fig[i];
        CHECK(f->field && f->key && f->unit && f->scale > 0);
        CHECK(i == 0 || f->offset > fig[i - 1].offset); /* in the order of the fields */
        spy_profile p = good;
        set_figure(&p, f, 0);
        CHECK((spy_profile_check(&p) == SPY_OK) == (f->sign == SPY_FIGURE_NONNEGATIVE));
        if (f->sign == SPY_FIGURE_POSITIVE)
            CHECK(strstr(spy_last_error(), f->field) != NULL);
        if (f->type == SPY_FIGURE_F64) {
            set_figure(&p, f, -1);
            CHECK(spy_profile_check(&p) == SPY_E_PROFILE);
            set_figure(&p, f, NAN);
            CHECK(spy_profile_check(&p) == SPY_E_PROFILE);
            set_figure(&p, f, INFINITY);
            CHECK(spy_profile_check(&p) == SPY_E_PROFILE);
        }
        if (isfinite(f->max)) {
            set_figure(&p, f, f->max);
            CHECK_OK(spy_profile_check(&p));
            set_figure(&p, f, f->type == SPY_FIGURE_F64 ? f->max * 1.5 : f->max * 2);
            CHECK(spy_profile_check(&p) == SPY_E_PROFILE);
            CHECK(strstr(spy_last_error(), f->field) != NULL);
        }
    }
    spy_profile p = good;
    p.stick_bytes = 96;
    CHECK(spy_profile_check(&p) == SPY_E_PROFILE);
    spy_device *d;
    CHECK(spy_device_open(&p, SPY_MODE_TIMING, 0, &d) == SPY_E_PROFILE); /* the open checks */
}

/* The start of a DLPack DLManagedTensor (the ABI spyre.h names). */
typedef struct dl_view {
    void *data;
    int32_t device_type, device_id, ndim;
    uint8_t code, bits;
    uint16_t lanes;
    int64_t *shape, *strides;
} dl_view;

static uint64_t live_allocs(spy_device *d)
{
    spy_mem_stats st;
    CHECK_OK(spy_mem_stats_get(d, &st));
    return st.num_allocs;
}

/* Stick layouts recorded with allocations, several allocations in one call, and DLPack
 * wraps of several allocations. */
static void test_layouts(void)
{
    current = "layouts";
    spy_profile pr = test_profile();
    pr.dram_bytes = 1 << 20;
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    uint64_t n;
    spy_layout big = {1024, 256, 2, 128}; /* (1024, 256) fp16 is stored as (4, 1024, 64) */
    CHECK_OK(spy_layout_bytes(&big, &n));
    CHECK(n == 4 * 1024 * 128);
    spy_layout empty = {0, 1, 4, 128}, odd = {3, 65, 2, 128};
    CHECK_OK(spy_layout_bytes(&empty, &n));
    CHECK(n == 128);
    CHECK_OK(spy_layout_bytes(&odd, &n));
    CHECK(n == 3 * 2 * 128);
    spy_layout bad[] = {{4, 4, 3, 128}, {4, 4, 2, 96}, {4, 0, 2, 128}, {4, 4, 8, 4},
                        {1ull << 62, 1ull << 40, 1, 128}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(spy_layout_bytes(&bad[i], &n) == SPY_E_INVALID_ARG);

    /* one allocation with its layout; the record goes with it */
    uint64_t a, b, plain;
    spy_layout got;
    CHECK_OK(spy_malloc_layout(d, 4 * 1024 * 128, SPY_MEM_DATA, &big, &a));
    CHECK_OK(spy_layout_of(d, a, &got));
    CHECK(memcmp(&got, &big, sizeof got) == 0);
    CHECK(spy_layout_of(d, a + 128, &got) == SPY_E_BAD_ADDRESS);
    CHECK_OK(spy_malloc(d, 256, SPY_MEM_DATA, &plain));
    CHECK(spy_layout_of(d, plain, &got) == SPY_E_BAD_ADDRESS);
    CHECK(spy_malloc_layout(d, 4 * 1024 * 128 - 1, SPY_MEM_DATA, &big, &b) == SPY_E_INVALID_ARG);
    CHECK(spy_malloc_layout(d, 1 << 19, SPY_MEM_CONTROL, &big, &b) == SPY_E_INVALID_ARG);
    spy_layout other_sticks = {4, 4, 2, 64};
    CHECK(spy_malloc_layout(d, 4096, SPY_MEM_DATA, &other_sticks, &b) == SPY_E_INVALID_ARG);
    CHECK_OK(spy_free(d, a));
    CHECK(spy_layout_of(d, a, &got) == SPY_E_BAD_ADDRESS);
    CHECK_OK(spy_malloc(d, 4 * 1024 * 128, SPY_MEM_DATA, &b)); /* the cached block again */
    CHECK(b == a && spy_layout_of(d, b, &got) == SPY_E_BAD_ADDRESS);
    CHECK_OK(spy_free(d, b));
    CHECK_OK(spy_free(d, plain));
    CHECK_OK(spy_empty_cache(d));

    /* several at once, sized by their layouts */
    spy_layout three[3] = {odd, empty, odd};
    uint64_t addrs[3];
    CHECK_OK(spy_malloc_many(d, 3, NULL, three, addrs));
    CHECK(live_allocs(d) == 3);
    for (int i = 0; i < 3; i++) {
        CHECK_OK(spy_layout_of(d, addrs[i], &got));
        CHECK(memcmp(&got, &three[i], sizeof got) == 0);
        CHECK_OK(spy_free(d, addrs[i]));
    }
    uint64_t sizes[2] = {4096, 8192};
    CHECK_OK(spy_malloc_many(d, 2, sizes, NULL, addrs));
    CHECK(spy_layout_of(d, addrs[1], &got) == SPY_E_BAD_ADDRESS);
    CHECK_OK(spy_free(d, addrs[0]));
    CHECK_OK(spy_free(d, addrs[1]));
    CHECK_OK(spy_malloc_many(d, 0, NULL, NULL, NULL));
    CHECK(spy_malloc_many(d, 1, NULL, NULL, addrs) == SPY_E_INVALID_ARG);
    /* all or nothing: the third does not fit, the first two are given back */
    spy_mem_stats before, after;
    CHECK_OK(spy_mem_stats_get(d, &before));
    uint64_t too_much[3] = {256 << 10, 256 << 10, 2 << 20};
    CHECK(spy_malloc_many(d, 3, too_much, NULL, addrs) == SPY_E_OOM);
    CHECK(strstr(spy_last_error(), "allocation 2 of 3") != NULL);
    CHECK_OK(spy_mem_stats_get(d, &after));
    CHECK(after.num_allocs == before.num_allocs && after.allocated == before.allocated);
    CHECK(after.total_allocs == before.total_allocs && after.peak_allocated == before.peak_allocated);
    CHECK(after.num_ooms == before.num_ooms + 1);
    /* a malformed layout is refused before anything is allocated */
    spy_layout mixed[2] = {odd, bad[0]};
    CHECK(spy_malloc_many(d, 2, NULL, mixed, addrs) == SPY_E_INVALID_ARG);
    CHECK(strstr(spy_last_error(), "allocation 1 of 2") != NULL);
    CHECK_OK(spy_mem_stats_get(d, &after));
    CHECK(after.total_allocs == before.total_allocs);

    /* a step's outputs: allocated, recorded and wrapped in one call */
    int64_t shape[2] = {3, 65}, strides[2] = {65, 1};
    spy_dlpack_tensor t[2] = {{shape, strides, 2, 2, 16, 0}, {NULL, NULL, 0, 2, 32, 0}};
    spy_layout outs[2] = {odd, empty};
    void *m[2];
    CHECK_OK(spy_dlpack_new_many(d, 2, outs, t, 12, addrs, m));
    CHECK(spy_dlpack_live(d) == 2 && live_allocs(d) == 2);
    const dl_view *v = m[0];
    CHECK(v->data == (void *)(uintptr_t)addrs[0] && v->device_type == 12 && v->ndim == 2);
    CHECK(v->code == 2 && v->bits == 16 && v->lanes == 1 && v->shape[1] == 65 && v->strides[0] == 65);
    CHECK_OK(spy_layout_of(d, addrs[1], &got));
    spy_dlpack_release(m[0]);
    CHECK(spy_layout_of(d, addrs[0], &got) == SPY_E_BAD_ADDRESS); /* the deleter freed both */
    spy_dlpack_release(m[1]);
    CHECK(spy_dlpack_live(d) == 0 && live_allocs(d) == 0);
    spy_layout huge[2] = {odd, {1 << 20, 64, 2, 128}};
    CHECK(spy_dlpack_new_many(d, 2, huge, t, 12, addrs, m) == SPY_E_OOM);
    CHECK(spy_dlpack_live(d) == 0 && live_allocs(d) == 0);
    spy_dlpack_tensor bad_tensor = {shape, strides, 65, 2, 16, 0};
    CHECK(spy_dlpack_new_many(d, 1, outs, &bad_tensor, 12, addrs, m) == SPY_E_INVALID_ARG);

    /* wrapping allocations made before: all or nothing */
    CHECK_OK(spy_malloc_many(d, 2, sizes, NULL, addrs));
    uint64_t wrong[2] = {addrs[0], addrs[1] + 128};
    CHECK(spy_dlpack_wrap_many(d, 2, wrong, t, 12, m) == SPY_E_BAD_ADDRESS);
    CHECK(spy_dlpack_live(d) == 0 && live_allocs(d) == 2);
    CHECK_OK(spy_dlpack_wrap_many(d, 2, addrs, t, 12, m));
    spy_dlpack_release(m[0]);
    spy_dlpack_release(m[1]);
    CHECK(spy_free(d, addrs[0]) == SPY_E_BAD_ADDRESS && live_allocs(d) == 0);

    /* a deleter that runs after a reset frees nothing */
    CHECK_OK(spy_device_reset(d));
    CHECK_OK(spy_dlpack_new_many(d, 1, outs, t, 12, addrs, m));
    CHECK_OK(spy_device_reset(d));
    CHECK_OK(spy_malloc(d, 768, SPY_MEM_DATA, &b));
    CHECK(b == addrs[0]); /* the same address, a new allocation */
    spy_dlpack_release(m[0]);
    CHECK(live_allocs(d) == 1);
    spy_device_close(d);
}

/* The native builder: what it builds the validator accepts; a corrupt record is refused
 * whole, naming its field, and leaves nothing allocated (ASan checks the frees). */
static void test_builder(void)
{
    current = "builder";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    uint64_t extents[2] = {4u << 20, 3u << 20};
    spy_copy_range ranges[2] = {{0, 1, 128, 0, 3u << 20}, {1, 0, 0, 0, 0}};
    spy_copy_record rec = {32, 128, 256u << 10, 2u << 20, 2, 2, extents, ranges};
    spy_built b;
    CHECK_OK(spy_build_copy(&rec, &b));
    spy_job_info info;
    CHECK(b.data && ((uintptr_t)b.data & 7) == 0);
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    CHECK(info.ncmds == 64 && info.total_bytes == b.bytes);
    spy_built_free(&b);
    CHECK(b.data == NULL && b.bytes == 0);
    spy_built_free(&b); /* twice: nothing to free */

    ranges[0].src_off = (4u << 20) - 64; /* runs past its slot */
    CHECK(spy_build_copy(&rec, &b) == SPY_E_BAD_ADDRESS && b.data == NULL);
    CHECK(strstr(spy_last_error(), "ranges[0].src_off") != NULL);
    ranges[0].src_off = UINT64_MAX - 8; /* and past 2^64 */
    CHECK(spy_build_copy(&rec, &b) == SPY_E_BAD_ADDRESS);
    ranges[0].src_off = 0;
    ranges[0].dst_slot = 2;
    CHECK(spy_build_copy(&rec, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "ranges[0].dst_slot"));
    ranges[0].dst_slot = 1;
    rec.chunk_max = 2u << 20; /* two chunks outside the scratchpad */
    CHECK(spy_build_copy(&rec, &b) == SPY_E_SCRATCHPAD && strstr(spy_last_error(), "chunk_max"));
    rec.chunk_max = 128;
    extents[0] = extents[1] = 1ull << 40;
    ranges[0].nbytes = 1ull << 40; /* 2^33 chunks: counts overflow */
    CHECK(spy_build_copy(&rec, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "ranges[0]"));
    CHECK(spy_build_copy(NULL, &b) == SPY_E_INVALID_ARG);

    spy_transfer_record t = {0};
    t.direction = SPY_OP_D2H;
    t.ndims = 2;
    t.layout = (spy_layout){16, 70, 2, 128};
    t.offset = 5;
    t.sizes[0] = 60, t.sizes[1] = 16;
    t.strides[0] = 1, t.strides[1] = 70;
    CHECK_OK(spy_build_transfer(&t, &b));
    spy_transfer *tg;
    CHECK_OK(spy_transfer_create(d, b.data, b.bytes, &tg));
    spy_transfer_destroy(tg);
    spy_built_free(&b);
    t.sizes[1] = 17; /* one column past the storage */
    CHECK(spy_build_transfer(&t, &b) == SPY_E_BAD_ADDRESS && b.data == NULL);
    t.sizes[1] = 16;
    t.direction = SPY_OP_LOAD;
    CHECK(spy_build_transfer(&t, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "direction"));
    t.direction = SPY_OP_H2D;
    t.ndims = SPY_TRANSFER_MAX_DIMS + 1;
    CHECK(spy_build_transfer(&t, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "ndims"));

    /* a graph in blocks: ordered by key (stably), dependencies renumbered */
    spy_cmd cmds[3] = {{0}};
    for (int i = 0; i < 3; i++)
        cmds[i].op = SPY_OP_BARRIER, cmds[i].core = SPY_CORE_CARD;
    int64_t keys[3] = {5, 1, 1}, after[3] = {0, 0, 2}, before[3] = {2, 1, 1};
    spy_graph_record g = {0, 0, 0, 0, 3, 3, NULL, cmds, keys, after, before, NULL, NULL};
    CHECK_OK(spy_build_graph(&g, &b));
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    const spy_cmd *out = (const spy_cmd *)(b.data + sizeof(spy_job_header));
    const uint32_t *dl = (const uint32_t *)(out + 3);
    CHECK(out[0].ndeps == 0 && out[1].ndeps == 1 && out[2].ndeps == 2 && out[2].dep_begin == 1);
    CHECK(dl[0] == 0 && dl[1] == 1 && dl[2] == 0);
    spy_built_free(&b);
    before[1] = 3; /* names no command */
    CHECK(spy_build_graph(&g, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "before[1]") && !b.data);

    /* the same graph under construction (graph.c): appended, then encoded alike */
    spy_graph gr;
    spy_graph_init(&gr);
    uint64_t first, second;
    spy_cmd *c = spy_graph_add(&gr, 1, 5, &first);
    CHECK(c && first == 0);
    c->op = SPY_OP_BARRIER, c->core = SPY_CORE_CARD;
    c = spy_graph_add(&gr, 2, 1, &second);
    CHECK(c && second == 1);
    c[0].op = c[1].op = SPY_OP_BARRIER, c[0].core = c[1].core = SPY_CORE_CARD;
    spy_graph_depend(&gr, 0, 2);
    spy_graph_depend(&gr, 0, 1);
    spy_graph_depend(&gr, 2, 1);
    spy_built b2 = {0};
    CHECK_OK(spy_graph_encode(&gr, &b2));
    before[1] = 1;
    CHECK_OK(spy_build_graph(&g, &b));
    CHECK(b.bytes == b2.bytes && !memcmp(b.data, b2.data, b.bytes));
    spy_built_free(&b);
    spy_built_free(&b2);
    ((uint32_t *)gr.pairs.data)[3] = 3; /* a pair naming no command: refused, nothing built */
    CHECK(spy_graph_encode(&gr, &b2) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "names no command") && !b2.data);
    gr.cmds.failed = true; /* a failed append: the encode says so and builds nothing */
    CHECK(spy_graph_encode(&gr, &b2) == SPY_E_HOST_NOMEM && !b2.data);
    spy_graph_free(&gr);

    /* runs of dependencies, in room reserved: every pair of the runs, each waiting command's in turn */
    spy_graph_init(&gr);
    spy_graph_reserve(&gr, 4, 4);
    c = spy_graph_add(&gr, 4, 0, &first);
    CHECK(c && gr.cmds.cap >= 4 && gr.pairs.cap >= 4);
    for (int i = 0; i < 4; i++)
        c[i].op = SPY_OP_BARRIER, c[i].core = SPY_CORE_CARD;
    spy_graph_depend_runs(&gr, 2, 2, 0, 2);
    const uint32_t *pairs = gr.pairs.data; /* (after, before) */
    CHECK(gr.pairs.len == 4 && pairs[2] == 2 && pairs[3] == 1 && pairs[4] == 3 && pairs[5] == 0);
    CHECK_OK(spy_graph_encode(&gr, &b2));
    CHECK_OK(spy_job_validate(d, b2.data, b2.bytes, &info));
    out = (const spy_cmd *)(b2.data + sizeof(spy_job_header));
    CHECK(out[3].ndeps == 2 && out[3].dep_begin == 2);
    spy_built_free(&b2);
    spy_graph_free(&gr);
    spy_device_close(d);
}

/* A matmul of 64 x 128 x 256 in fp16 on a group of 2 x 2 x 2 cores (two K slices), its
 * tiles in the scratchpad as the Python layer would place them. */
static uint32_t mm_m_size[2] = {32, 32}, mm_n_size[2] = {64, 64};
static uint64_t mm_k_slice[2] = {128, 128};
static spy_layout mm_slots[3] = {{64, 256, 2, 128}, {256, 128, 2, 128}, {64, 128, 2, 128}};
static spy_mm_tiles mm_store = {{2, 0, 0, {0, 128, 1}}, {40960, 45056}, 64, 2, 0, 0};
static spy_mm_instr mm_round; /* the accumulator rounded into the staging tile */

static spy_matmul_record mm_record(void)
{
    spy_operand acc = {SPY_OPND_TILE, SPY_DT_F32, 0, 64, {.off = 24576}};
    mm_round.ins = (spy_instr){SPY_SFU_MOV, 0, 0, 0, 0, 0, {SPY_OPND_TILE, SPY_DT_F16, 0, 64, {.off = 40960}},
                               {acc, {0}, {0}}};
    mm_round.v1[0] = 45056, mm_round.v1[1] = 24576;
    spy_matmul_record r = {
        .num_cores = 32, .stick_bytes = 128, .scratchpad_bytes = 2u << 20,
        .batch = 1, .m = 64, .n = 128, .k = 256, .in_dtype = SPY_DT_F16,
        .groups = 4, .pk = 2, .pm = 2, .pn = 2, .m_tiles = 2, .n_tiles = 2, .tk = 64, .nbuf = 2,
        .m_size = mm_m_size, .n_size = mm_n_size, .k_slice = mm_k_slice,
        .a_lx = {0, 4096}, .b_lx = {8192, 16384}, .acc_lx = 24576, .recv_lx = 32768,
        .a_pitch = 64, .b_pitch = 64, .c_pitch = 64,
        .nslots = 3, .nstores = 1, .ninstrs = 1, .slots = mm_slots,
        .a = {0, 0, 0, {0, 256, 1}}, .b = {1, 0, 0, {0, 128, 1}}, .stores = &mm_store, .program = &mm_round,
    };
    return r;
}

/* The matmul builder: what it builds the validator accepts and the card runs; a corrupt
 * record is refused whole with a message naming its field, nothing built, nothing leaked. */
static void test_matmul_builder(void)
{
    current = "matmul builder";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    spy_matmul_record r = mm_record();
    spy_built b = {0};
    spy_job_info info;
    CHECK_OK(spy_build_matmul(&r, &b));
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    /* 8 chunks of A and 8 of B, each loaded by one core and sent to the other of its grid row
     * or column; 16 matmuls (8 cores, 2 K chunks each); split-K: 4 sends and adds; per tile a
     * program and a store. One program of each kind (one tile shape, one staging slot). */
    const spy_job_header *h = (const spy_job_header *)b.data;
    CHECK(info.ncmds == 16 + 16 + 16 + 4 + 4 + 4 + 4 && h->nslots == 3 && h->ninstrs == 1 + 1);
    const spy_cmd *cmd = (const spy_cmd *)((const spy_slot *)(h + 1) + 3);
    for (uint32_t i = 1; i < info.ncmds; i++) /* no command waits for a later one */
        for (uint32_t x = 0; x < cmd[i].ndeps; x++)
            CHECK(((const uint32_t *)(cmd + info.ncmds))[cmd[i].dep_begin + x] < i);
    uint64_t addr[3];
    for (int i = 0; i < 3; i++) {
        uint64_t bytes;
        CHECK_OK(spy_layout_bytes(&mm_slots[i], &bytes));
        CHECK_OK(spy_malloc(d, bytes, SPY_MEM_DATA, &addr[i]));
    }
    uint64_t at;
    CHECK_OK(spy_malloc(d, b.bytes, SPY_MEM_CONTROL, &at));
    CHECK_OK(spy_mem_write(d, at, b.data, b.bytes));
    CHECK_OK(spy_program_commit(d, at, &info));
    double end;
    CHECK_OK(spy_launch(d, at, addr, 3, 0, &end));
    CHECK(end > 0);
    spy_built_free(&b);

    r.a_lx[1] = (2u << 20) - 1024; /* an A tile past the scratchpad's end */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_SCRATCHPAD && strstr(spy_last_error(), "a_lx[1]") && !b.data);
    r = mm_record();
    mm_round.v1[0] = 2u << 20; /* the program's destination in slot 1 */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_SCRATCHPAD && strstr(spy_last_error(), "program[0].dst") && !b.data);
    r = mm_record();
    r.a.offset = 1; /* the last element of A one past its storage */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_BAD_ADDRESS && strstr(spy_last_error(), "a.offset") && !b.data);
    r = mm_record();
    mm_k_slice[0] = 256, mm_k_slice[1] = 0; /* an empty K slice */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "k_slice[1]") && !b.data);
    mm_k_slice[0] = mm_k_slice[1] = 128;
    r = mm_record();
    mm_m_size[1] = 31; /* tiles that do not add up to M */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "m_size") && !b.data);
    mm_m_size[1] = 32;
    r.batch = 1u << 31; /* 2^31 blocks (the views broadcast): more commands than a block holds */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "makes more than") && !b.data);
    r = mm_record();
    r.pm = 3; /* groups x pk x pm x pn over the card's cores */
    CHECK(spy_build_matmul(&r, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "num_cores") && !b.data);
    CHECK(spy_build_matmul(NULL, &b) == SPY_E_INVALID_ARG);
    r = mm_record();
    r.batch = 0; /* nothing to compute: the slots alone */
    CHECK_OK(spy_build_matmul(&r, &b));
    CHECK(((const spy_job_header *)b.data)->ncmds == 0 && ((const spy_job_header *)b.data)->nslots == 3);
    spy_built_free(&b);
    spy_device_close(d);
}

/* ---- the loop builder (build_loop.c): y = x + 1 over 37 x 96 fp32, tiles of two rows on four cores ---- */

#define LOOP_ROWS 37
#define LOOP_COLS 96

typedef struct loop_case {
    spy_loop_record rec;
    spy_loop_access acc[2];
    spy_loop_tile tiles[(LOOP_ROWS + 1) / 2];
    spy_loop_stage stage;
    spy_loop_instr instrs[2];
    uint64_t extents[2];
} loop_case;

static void loop_case_init(loop_case *c)
{
    memset(c, 0, sizeof *c);
    spy_layout lay = {LOOP_ROWS, LOOP_COLS, 4, 128};
    uint64_t bytes;
    spy_layout_bytes(&lay, &bytes);
    uint32_t region = 2 * LOOP_COLS * 4; /* two rows of 96 floats: a whole number of sticks */
    for (int i = 0; i < 2; i++) {
        spy_loop_access *a = &c->acc[i];
        a->op = i ? SPY_OP_STORE : SPY_OP_LOAD;
        a->kind = SPY_OPND_TILE;
        a->slot = (uint32_t)i;
        a->layout = lay;
        a->itemsize = 4;
        a->lx_pitch = LOOP_COLS;
        a->lx_off[0] = (uint32_t)(2 * i) * region;
        a->lx_off[1] = (uint32_t)(2 * i + 1) * region;
        a->coeffs[0] = LOOP_COLS;
        a->coeffs[1] = 1;
        c->extents[i] = bytes;
    }
    uint32_t n = 0, boxes = (LOOP_ROWS + 1) / 2;
    for (uint32_t core = 0; core < 4; core++) /* round-robin boxes, in per-core order */
        for (uint32_t b = core; b < boxes; b += 4, n++) {
            c->tiles[n].core = core;
            c->tiles[n].start = 2 * b;
            c->tiles[n].size = 2 * b + 2 <= LOOP_ROWS ? 2 : 1;
        }
    for (int p = 0; p < 2; p++) {
        spy_instr *x = &c->instrs[p].instr;
        c->instrs[p].tile_rows = 1;
        x->op = SPY_SFU_ADD;
        x->cols = LOOP_COLS;
        x->dst = (spy_operand){SPY_OPND_TILE, SPY_DT_F32, 0, LOOP_COLS, {.off = c->acc[1].lx_off[p]}};
        x->src[0] = (spy_operand){SPY_OPND_TILE, SPY_DT_F32, 0, LOOP_COLS, {.off = c->acc[0].lx_off[p]}};
        x->src[1] = (spy_operand){SPY_OPND_IMM, SPY_DT_F32, 0, 0, {.imm_f = 1.0}};
    }
    c->stage = (spy_loop_stage){{0, 1}, 1, 0};
    spy_loop_record *r = &c->rec;
    r->num_cores = 4;
    r->stick_bytes = 128;
    r->scratchpad_bytes = 2u << 20;
    r->lx_bytes = 4 * region;
    r->nvars = 2;
    r->nrow = 1;
    r->block = 0;
    r->rows_per_tile = 2;
    r->levels = 1;
    r->nslots = 2;
    r->naccesses = 2;
    r->ntiles = n;
    r->ninstrs = 2;
    r->sizes[0] = LOOP_ROWS;
    r->sizes[1] = LOOP_COLS;
    r->slot_extent = c->extents;
    r->accesses = c->acc;
    r->tiles = c->tiles;
    r->stages = &c->stage;
    r->instrs = c->instrs;
}

static uint64_t stick_offset(uint64_t row, uint64_t col)
{
    return (col / 32) * LOOP_ROWS * 128 + row * 128 + (col % 32) * 4;
}

/* The loop case's program run on the card: x (LOOP_ROWS x LOOP_COLS fp32 in sticks) holds
 * r * LOOP_COLS + k; the first `out_bytes` of y are read into `out`. */
static void run_loop_case(spy_device *d, const loop_case *c, const spy_built *b, void *out, uint64_t out_bytes)
{
    uint64_t x, y, blob;
    CHECK_OK(spy_malloc(d, c->extents[0], SPY_MEM_DATA, &x));
    CHECK_OK(spy_malloc(d, c->extents[1], SPY_MEM_DATA, &y));
    float *host = calloc(c->extents[0] / 4, 4);
    for (uint64_t r = 0; r < LOOP_ROWS; r++)
        for (uint64_t k = 0; k < LOOP_COLS; k++)
            host[stick_offset(r, k) / 4] = (float)(r * LOOP_COLS + k);
    CHECK_OK(spy_mem_write(d, x, host, c->extents[0]));
    free(host);
    CHECK_OK(spy_malloc(d, b->bytes, SPY_MEM_CONTROL, &blob));
    CHECK_OK(spy_mem_write(d, blob, b->data, b->bytes));
    CHECK_OK(spy_program_commit(d, blob, NULL));
    uint64_t bind[2] = {x, y};
    double end;
    CHECK_OK(spy_launch(d, blob, bind, 2, 0, &end));
    CHECK_OK(spy_mem_read(d, y, out, out_bytes));
    spy_free(d, blob);
    spy_free(d, x);
    spy_free(d, y);
}

static void test_loop_builder(void)
{
    current = "loop builder";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    loop_case c;
    loop_case_init(&c);
    spy_built b, again;
    CHECK_OK(spy_build_loop(&c.rec, &b));
    spy_job_info info;
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    CHECK(info.ncmds == 3 * c.rec.ntiles && info.cores_used == 4); /* load, SFU, store per tile */
    CHECK_OK(spy_build_loop(&c.rec, &again)); /* every build makes the same block */
    CHECK(again.bytes == b.bytes && !memcmp(again.data, b.data, b.bytes));
    spy_built_free(&again);

    /* it computes y = x + 1 on the card */
    float *host = calloc(c.extents[1] / 4, 4);
    run_loop_case(d, &c, &b, host, c.extents[1]);
    bool right = true;
    for (uint64_t r = 0; r < LOOP_ROWS; r++)
        for (uint64_t k = 0; k < LOOP_COLS; k++)
            right &= host[stick_offset(r, k) / 4] == (float)(r * LOOP_COLS + k + 1);
    CHECK(right);
    free(host);
    spy_built_free(&b);

    /* a corrupt record is refused whole, naming the field, and leaves nothing */
    c.tiles[3].size = 3; /* rows outside the regions laid out for two */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_SCRATCHPAD && !b.data && strstr(spy_last_error(), "tiles[3].size"));
    loop_case_init(&c);
    c.acc[1].base = LOOP_COLS; /* one row past the storage in the last tile */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_BAD_ADDRESS && !b.data && strstr(spy_last_error(), "accesses[1]"));
    loop_case_init(&c);
    c.extents[0] = 64; /* a slot smaller than its storage */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_BAD_ADDRESS && strstr(spy_last_error(), "accesses[0].layout"));
    loop_case_init(&c);
    c.instrs[1].instr.src[0].v.off = c.rec.lx_bytes - 4;
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_SCRATCHPAD && strstr(spy_last_error(), "instrs[1].src[0]"));
    loop_case_init(&c);
    c.rec.sizes[1] = 1ull << 41; /* counts that overflow */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "sizes[1]"));
    loop_case_init(&c);
    c.acc[0].coeffs[1] = INT64_MIN;
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "accesses[0].coeffs[1]"));
    loop_case_init(&c);
    c.stage.count = 2;
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "stages[0].first[1]"));
    loop_case_init(&c);
    c.instrs[0].tile_rows = 2; /* one in two of the tile's rows, but each block index is one row */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "instrs[0] covers one in 2"));
    CHECK(spy_build_loop(NULL, &b) == SPY_E_INVALID_ARG);
    spy_device_close(d);
}

/* Merged stores: y[r] = sum of row r of x, y 37 fp32 in two sticks of 32. Each stick's rows
 * are a group of tiles on several cores that send their sums to the group's core, which
 * stores the stick once: group 0 (rows 0 .. 31) on core 0, group 1 (rows 32 .. 36) on core 1. */
static void merged_case(loop_case *c, spy_loop_merge *m, int32_t *tile_merge, uint32_t *merge_off)
{
    loop_case_init(c);
    spy_loop_access *y = &c->acc[1];
    y->kind = SPY_OPND_ROW;
    y->layout = (spy_layout){1, LOOP_ROWS, 4, 128};
    y->lx_pitch = 1;
    y->coeffs[0] = 1;
    y->coeffs[1] = 0;
    c->extents[1] = 256;
    for (int p = 0; p < 2; p++) {
        spy_instr *x = &c->instrs[p].instr;
        x->op = SPY_SFU_RSUM;
        x->dst = (spy_operand){SPY_OPND_ROW, SPY_DT_F32, 0, 1, {.off = y->lx_off[p]}};
        x->src[1] = (spy_operand){0};
    }
    uint32_t region = 4 * 2 * LOOP_COLS * 4;
    c->rec.lx_bytes = region + 128;
    memset(m, 0, 2 * sizeof *m);
    m[0].box = (spy_loop_tile){0, 32, 0, {0}};
    m[1].box = (spy_loop_tile){1, LOOP_ROWS - 32, 32, {0}};
    m[0].lx_off = m[1].lx_off = region;
    for (uint32_t t = 0; t < c->rec.ntiles; t++)
        tile_merge[t] = c->tiles[t].start < 32 ? 0 : 1;
    merge_off[0] = SPY_LOOP_UNMERGED;
    merge_off[1] = 0;
    c->rec.nmerges = 2;
    c->rec.merges = m;
    c->rec.tile_merge = tile_merge;
    c->rec.merge_off = merge_off;
}

static void test_loop_merged_stores(void)
{
    current = "loop builder, merged stores";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, 0, &d));
    loop_case c;
    spy_loop_merge m[2];
    int32_t tile_merge[(LOOP_ROWS + 1) / 2];
    uint32_t merge_off[2];
    merged_case(&c, m, tile_merge, merge_off);
    spy_built b;
    CHECK_OK(spy_build_loop(&c.rec, &b));
    spy_job_info info;
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    /* load, SFU, ring per tile; a store per group */
    CHECK(info.ncmds == 3 * c.rec.ntiles + 2 && info.cores_used == 4);
    const spy_job_header *h = (const spy_job_header *)b.data;
    const spy_cmd *cmds = (const spy_cmd *)((const uint8_t *)b.data + sizeof *h + h->nslots * sizeof(spy_slot));
    uint32_t rings = 0, stores = 0;
    for (uint32_t i = 0; i < h->ncmds; i++) {
        rings += cmds[i].op == SPY_OP_RING;
        if (cmds[i].op == SPY_OP_STORE) {
            stores++;
            CHECK(cmds[i].core == (stores == 1 ? 0 : 1) && cmds[i].ndeps == (stores == 1 ? 16 : 3));
        }
    }
    CHECK(rings == c.rec.ntiles && stores == 2);

    float sums[64];
    run_loop_case(d, &c, &b, sums, sizeof sums);
    bool right = true;
    for (uint64_t r = 0; r < LOOP_ROWS; r++)
        right &= sums[r] == (float)(r * LOOP_COLS * LOOP_COLS + LOOP_COLS * (LOOP_COLS - 1) / 2);
    CHECK(right);
    spy_built_free(&b);

    /* a corrupt record is refused whole, naming the field, and leaves nothing */
    merged_case(&c, m, tile_merge, merge_off);
    tile_merge[0] = 1; /* a tile outside its group */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && !b.data && strstr(spy_last_error(), "tiles[0]"));
    merged_case(&c, m, tile_merge, merge_off);
    for (uint32_t t = 0; t < c.rec.ntiles; t++)
        if (c.tiles[t].start == 34)
            tile_merge[t] = -1; /* group 1 then lacks rows no tile sends */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && !b.data && strstr(spy_last_error(), "merges[1]"));
    merged_case(&c, m, tile_merge, merge_off);
    m[1].lx_off = (uint32_t)c.rec.lx_bytes - 8; /* a region past the layout */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_SCRATCHPAD && !b.data && strstr(spy_last_error(), "merges[1]"));
    merged_case(&c, m, tile_merge, merge_off);
    m[0].box.core = 4;
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && !b.data && strstr(spy_last_error(), "merges[0].core"));
    merged_case(&c, m, tile_merge, merge_off);
    merge_off[0] = 0; /* a load cannot merge */
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && !b.data && strstr(spy_last_error(), "accesses[0]"));
    merged_case(&c, m, tile_merge, merge_off);
    c.rec.merge_off = NULL;
    CHECK(spy_build_loop(&c.rec, &b) == SPY_E_INVALID_ARG && !b.data && strstr(spy_last_error(), "arrays"));
    spy_device_close(d);
}

/* An attention of 4 query heads over 2 KV heads, one query row (decode), 200 keys: each
 * KV head's keys in two parts on cores of their own, combined on the first part's core. */
static void attention_record(spy_attention_record *r, spy_attention_task *tasks, uint64_t *extents)
{
    memset(r, 0, sizeof *r);
    r->num_cores = 32;
    r->nslots = 4;
    r->scratchpad_bytes = 2u << 20;
    r->batch = 1, r->heads = 4, r->kv_heads = 2, r->q_len = 1, r->kv_len = 200, r->dim = 64, r->v_dim = 64;
    r->dtype = SPY_DT_F16;
    r->mask_kind = SPY_ATTN_MASK_NONE;
    r->mask_heads = 1;
    r->scale = 0.125;
    r->q_rows = 1, r->kv_block = 128;
    for (int i = 0; i < 4; i++) /* core, batch, kv_head, q0, rows, kv0, kv1, part, parts, leader, group, step */
        tasks[i] = (spy_attention_task){i, 0, i / 2, 0, 1, i % 2 ? 128 : 0, i % 2 ? 200 : 128, i % 2, 2, i / 2 * 2,
                                        -1, 0};
    r->ntasks = 4;
    r->tasks = tasks;
    extents[0] = extents[3] = 4 * 128, extents[1] = extents[2] = 400 * 128;
    r->slot_extent = extents;
    spy_attention_view q = {0, 0, {4, 64, 2, 128}, 0, {1, 4, 1, 64}, {256, 64, 64, 1}};
    spy_attention_view kv = {1, 0, {400, 64, 2, 128}, 0, {1, 2, 200, 64}, {25600, 12800, 64, 1}};
    r->q = r->out = q;
    r->out.slot = 3;
    r->k = r->v = kv;
    r->v.slot = 2;
    /* stick-aligned regions as spyre_rt.construct.attention.Scratchpad lays them out */
    spy_attention_lx *x = &r->lx;
    x->q[0] = 0, x->q[1] = 256, x->k[0] = 512, x->k[1] = 16896, x->v[0] = 33280, x->v[1] = 49664;
    x->s[0] = 66048, x->s[1] = 67072, x->p = 68096, x->state = 68608, x->recv = 69376;
    x->mn = 70144, x->safe = 70272, x->alpha = 70400, x->t = 70528, x->flag = 70656, x->stage = 70784;
    x->q_pitch = x->k_pitch = x->v_pitch = x->o_pitch = x->stage_pitch = 64;
    x->m_pitch = x->s_pitch = x->p_pitch = x->flag_pitch = 128;
    x->row_bytes = 128, x->state_bytes = 768;
}

static void test_attention_builder(void)
{
    current = "attention builder";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    spy_attention_record r;
    spy_attention_task tasks[4];
    uint64_t extents[4];
    attention_record(&r, tasks, extents);
    spy_built b, again;
    spy_job_info info;
    CHECK_OK(spy_build_attention(&r, &b));
    CHECK(b.data && ((uintptr_t)b.data & 7) == 0);
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    CHECK(info.total_bytes == b.bytes && info.cores_used == 4);
    CHECK_OK(spy_build_attention(&r, &again)); /* every build makes the same block */
    CHECK(again.bytes == b.bytes && !memcmp(again.data, b.data, b.bytes));
    spy_built_free(&again);
    /* the parts' states reach their leaders over the ring: one transfer per part 1 */
    const spy_job_header *h = (const spy_job_header *)b.data;
    const spy_cmd *cmds = (const spy_cmd *)((const spy_slot *)(h + 1) + h->nslots);
    uint32_t rings = 0;
    for (uint32_t i = 0; i < h->ncmds; i++)
        if (cmds[i].op == SPY_OP_RING) {
            rings++;
            CHECK(cmds[i].u.ring.dst_off == r.lx.recv && cmds[i].u.ring.dst_core + 1u == cmds[i].core);
        }
    CHECK(rings == 2);
    spy_built_free(&b);

    /* refused whole, naming the field, with nothing built */
    struct {
        const char *field;
        spy_status status;
    } cases[] = {
        {"lx.k[1]", SPY_E_SCRATCHPAD},   {"k.offset", SPY_E_BAD_ADDRESS}, {"slot 2", SPY_E_BAD_ADDRESS},
        {"tasks[2].core", SPY_E_INVALID_ARG}, {"tasks[1].leader", SPY_E_INVALID_ARG},
        {"blocks of keys", SPY_E_INVALID_ARG}, {"lx.q_pitch", SPY_E_INVALID_ARG}, {"out.sizes[3]", SPY_E_INVALID_ARG},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        attention_record(&r, tasks, extents);
        switch (i) {
        case 0: r.lx.k[1] = r.scratchpad_bytes - 100; break;                /* a tile outside the scratchpad */
        case 1: r.k.offset = 400 * 64 - 1; break;                           /* a DMA pattern outside its storage */
        case 2: extents[2] = 1000; break;                                   /* a slot smaller than its storage */
        case 3: tasks[2].core = 0; break;                                   /* out of core order */
        case 4: tasks[1].leader = 1; break;                                 /* a part leading itself */
        case 5: r.kv_len = UINT32_MAX, r.kv_block = 1, tasks[0].kv1 = UINT32_MAX; break; /* counts that overflow */
        case 6: r.lx.q_pitch = 32; break;                                   /* rows narrower than the head */
        case 7: r.out.sizes[3] = 65; break;                                 /* a view that is not the shape's */
        }
        b.data = (uint8_t *)&b; /* the refusal clears it */
        spy_status s = spy_build_attention(&r, &b);
        CHECK(s == cases[i].status && !b.data && b.bytes == 0);
        CHECK(strstr(spy_last_error(), cases[i].field) != NULL);
    }
    CHECK(spy_build_attention(NULL, &b) == SPY_E_INVALID_ARG);
    spy_device_close(d);
}

/* The record above over a paged cache: 256 keys in 4 pages of 64 of a cache of 8 pages
 * ((kv_heads, pages, page, dim) storage, read pages first), a table of 4 page numbers. */
static void paged_record(spy_attention_record *r, spy_attention_task *tasks, uint64_t *extents)
{
    attention_record(r, tasks, extents);
    r->nslots = 5;
    r->kv_len = 256;
    for (int i = 0; i < 4; i++)
        tasks[i].kv0 = i % 2 ? 128 : 0, tasks[i].kv1 = i % 2 ? 256 : 128;
    extents[1] = extents[2] = 1024 * 128, extents[4] = 128;
    spy_attention_view kv = {1, 0, {1024, 64, 2, 128}, 0, {8, 2, 64, 64}, {4096, 32768, 64, 1}};
    r->k = r->v = kv;
    r->v.slot = 2;
    r->page = 64;
    r->table_dtype = SPY_DT_I64;
    r->table = (spy_attention_view){4, 0, {1, 4, 8, 128}, 0, {1, 4, 1, 1}, {4, 1, 1, 1}};
    r->lx_table = 71040, r->table_pitch = 32, r->table_rows = 1;
}

static void test_paged_attention_builder(void)
{
    current = "paged attention builder";
    spy_profile pr = test_profile();
    spy_device *d;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    spy_attention_record r;
    spy_attention_task tasks[4];
    uint64_t extents[5];
    paged_record(&r, tasks, extents);
    spy_built b;
    spy_job_info info;
    CHECK_OK(spy_build_attention(&r, &b));
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    /* a table row loaded per core, then one gather of two pages each for K and V per task */
    const spy_job_header *h = (const spy_job_header *)b.data;
    const spy_cmd *cmds = (const spy_cmd *)((const spy_slot *)(h + 1) + h->nslots);
    uint32_t gathers = 0, loads = 0;
    for (uint32_t i = 0; i < h->ncmds; i++) {
        if (cmds[i].op == SPY_OP_GATHER) {
            const spy_gather *g = &cmds[i].u.gather;
            gathers++;
            CHECK(g->nidx == 2 && g->limit == 8 && g->row_stride == 64 * 128 && g->lx_pitch == 64 * 128);
            CHECK(g->idx_off == r.lx_table + (cmds[i].core % 2 ? 16u : 0u)); /* the second part: pages 2, 3 */
        }
        loads += cmds[i].op == SPY_OP_LOAD && cmds[i].u.dma.dst_off == r.lx_table;
    }
    CHECK(gathers == 8 && loads == 4);
    spy_built_free(&b);

    struct {
        const char *field;
        spy_status status;
    } cases[] = {
        {"multiple of page", SPY_E_INVALID_ARG}, {"neither divides", SPY_E_INVALID_ARG},
        {"tasks[1].kv0", SPY_E_INVALID_ARG},     {"table_rows", SPY_E_INVALID_ARG},
        {"paged k", SPY_E_INVALID_ARG},          {"table's storage", SPY_E_INVALID_ARG},
        {"table_dtype", SPY_E_INVALID_ARG},      {"table.sizes[1]", SPY_E_INVALID_ARG},
        {"lx.table", SPY_E_SCRATCHPAD},          {"k_pitch", SPY_E_INVALID_ARG},
        {"table.offset", SPY_E_BAD_ADDRESS},     {"256 bytes at least", SPY_E_INVALID_ARG},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        paged_record(&r, tasks, extents);
        switch (i) {
        case 0: r.page = 96; break;                                    /* 256 keys are not whole pages */
        case 1: r.page = 128, r.kv_block = 96; break;                  /* a block across pages */
        case 2: tasks[1].kv0 = 96; break;                              /* a task starting inside a block */
        case 3: r.table_pitch = 24; break;                             /* a region short of a row */
        case 4: r.k.strides[2] = 32; break;                            /* two keys per storage row */
        case 5: r.table_dtype = SPY_DT_I32; break;                     /* entries of the wrong width */
        case 6: r.table_dtype = SPY_DT_F32; break;
        case 7: r.table.sizes[1] = 3; break;                           /* not kv_len / page entries */
        case 8: r.lx_table = r.scratchpad_bytes - 8; break;            /* the regions outside */
        case 9: r.lx.k_pitch = 128; break;                             /* a key of more sticks than its dim */
        case 10: r.table.offset = 1; break;                            /* a row reaching past its storage */
        case 11:                                                       /* 32 entries: two whole sticks */
            r.page = 8, r.k.sizes[2] = r.v.sizes[2] = 8, r.table.sizes[1] = 32, r.table.layout.row_len = 32;
            extents[4] = 256;
            break;
        }
        b.data = (uint8_t *)&b;
        spy_status s = spy_build_attention(&r, &b);
        CHECK(s == cases[i].status && !b.data && b.bytes == 0);
        if (!strstr(spy_last_error(), cases[i].field))
            fprintf(stderr, "case %zu: %s\n", i, spy_last_error());
        CHECK(strstr(spy_last_error(), cases[i].field) != NULL);
    }
    /* a core reading the rows of more batch elements than its regions */
    paged_record(&r, tasks, extents);
    r.batch = 2;
    r.table.layout.rows = 2, r.table.sizes[0] = 2, extents[4] = 256;
    r.q.sizes[0] = r.out.sizes[0] = 2, r.q.layout.rows = r.out.layout.rows = 8, extents[0] = extents[3] = 8 * 128;
    tasks[1].core = 0, tasks[1].batch = 1, tasks[1].part = 0, tasks[1].parts = 1, tasks[1].leader = 1;
    tasks[0].parts = 1;
    CHECK(spy_build_attention(&r, &b) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "table_rows 1 batch"));
    r.table_rows = 2;
    CHECK_OK(spy_build_attention(&r, &b));
    CHECK_OK(spy_job_validate(d, b.data, b.bytes, &info));
    spy_built_free(&b);
    spy_device_close(d);
}

/* ---- collectives (ccl.c) and timed jobs: two ranks as two threads of one process ---- */

typedef struct ccl_rank_run {
    spy_ccl *c;
    uint32_t rank;
    spy_status s[8];
    float sum[100];
    uint16_t half_max[3];
    int32_t gathered[4], interleaved[4];
    double scattered[2], scattered_chunks[2];
    uint8_t bcast[300];
    int64_t a2a[2];
} ccl_rank_run;

static void *ccl_rank_main(void *arg)
{
    ccl_rank_run *r = arg;
    float x[100];
    for (int i = 0; i < 100; i++)
        x[i] = (float)(i + 100 * r->rank);
    r->s[0] = spy_ccl_allreduce(r->c, x, r->sum, 100, SPY_CCL_F32, SPY_CCL_SUM, 7); /* 400 bytes: two rounds */
    uint16_t h[3] = {r->rank ? 0x4000 : 0x3c00, r->rank ? 0x3c00 : 0x4200, 0xc000}; /* 1,2 | 3,1 | -2,-2 */
    r->s[1] = spy_ccl_allreduce(r->c, h, r->half_max, 3, SPY_CCL_F16, SPY_CCL_MAX, 0);
    int32_t mine[2] = {(int32_t)r->rank * 10, (int32_t)r->rank * 10 + 1};
    r->s[2] = spy_ccl_allgather(r->c, mine, r->gathered, sizeof mine, sizeof mine);
    /* by chunks of one element: rank 0's first, rank 1's first, rank 0's second... */
    if (r->s[2] == SPY_OK)
        r->s[2] = spy_ccl_allgather(r->c, mine, r->interleaved, sizeof mine, sizeof mine[0]);
    double blocks[4] = {1 + r->rank, 2 + r->rank, 3 + r->rank, 4 + r->rank};
    r->s[3] = spy_ccl_reduce_scatter(r->c, blocks, r->scattered, 2, 2, SPY_CCL_F64, SPY_CCL_AVG);
    /* the reverse of the interleaving: element k*2 + rank of each chunk column, summed */
    if (r->s[3] == SPY_OK)
        r->s[3] = spy_ccl_reduce_scatter(r->c, blocks, r->scattered_chunks, 2, 1, SPY_CCL_F64, SPY_CCL_SUM);
    for (int i = 0; i < 300; i++)
        r->bcast[i] = r->rank ? (uint8_t)i : 0;
    r->s[4] = spy_ccl_broadcast(r->c, r->bcast, sizeof r->bcast, 1);
    int64_t out[2] = {0, 0}, in[2] = {r->rank * 2, r->rank * 2 + 1};
    r->s[5] = spy_ccl_alltoall(r->c, in, out, sizeof(int64_t));
    memcpy(r->a2a, out, sizeof out);
    float y[4] = {0};
    r->s[6] = spy_ccl_allreduce(r->c, y, y, 3 + r->rank, SPY_CCL_F32, SPY_CCL_SUM, 0); /* mismatched counts */
    r->s[7] = spy_ccl_barrier(r->c); /* the group is aborted from then on */
    return NULL;
}

static void test_ccl(void)
{
    current = "ccl";
    char name[64];
    snprintf(name, sizeof name, "/spyreccl-test-%ld", (long)time(NULL));
    spy_ccl *c0 = NULL, *c1 = NULL, *lone = NULL;
    CHECK(spy_ccl_open("no-slash", 0, 2, 256, 1, 1000000, &c0) == SPY_E_INVALID_ARG);
    CHECK(spy_ccl_open(name, 0, 2, 100, 1, 1000000, &c0) == SPY_E_INVALID_ARG); /* not whole lines */
    CHECK_OK(spy_ccl_open(name, 0, 2, 256, 1, 5000000000ull, &c0));
    CHECK(spy_ccl_open(name, 1, 3, 256, 0, 1000000, &c1) == SPY_E_INVALID_ARG); /* another group's shape */
    CHECK_OK(spy_ccl_open(name, 1, 2, 256, 0, 5000000000ull, &c1));
    CHECK_OK(spy_ccl_unlink(name));
    if (!c0 || !c1) {
        spy_ccl_close(c0);
        spy_ccl_close(c1);
        return;
    }
    ccl_rank_run runs[2] = {{.c = c0, .rank = 0}, {.c = c1, .rank = 1}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, ccl_rank_main, &runs[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
    for (int i = 0; i < 2; i++) {
        ccl_rank_run *r = &runs[i];
        for (int k = 0; k < 6; k++)
            CHECK(r->s[k] == SPY_OK);
        for (int e = 0; e < 100; e++)
            CHECK(r->sum[e] == (float)(2 * e + 100));
        CHECK(r->half_max[0] == 0x4000 && r->half_max[1] == 0x4200 && r->half_max[2] == 0xc000);
        CHECK(r->gathered[0] == 0 && r->gathered[1] == 1 && r->gathered[2] == 10 && r->gathered[3] == 11);
        CHECK(r->interleaved[0] == 0 && r->interleaved[1] == 10 && r->interleaved[2] == 1 && r->interleaved[3] == 11);
        /* block `rank` of {1,2,3,4} and {2,3,4,5}, averaged */
        CHECK(r->scattered[0] == (i ? 3.5 : 1.5) && r->scattered[1] == (i ? 4.5 : 2.5));
        /* elements rank and 2 + rank of both, summed */
        CHECK(r->scattered_chunks[0] == (i ? 5.0 : 3.0) && r->scattered_chunks[1] == (i ? 9.0 : 7.0));
        for (int b = 0; b < 300; b++)
            CHECK(r->bcast[b] == (uint8_t)b);
        CHECK(r->a2a[0] == i && r->a2a[1] == 2 + i);
        CHECK(r->s[6] == SPY_E_CCL_MISMATCH || r->s[6] == SPY_E_CCL_PEER);
        CHECK(r->s[7] == SPY_E_CCL_PEER);
    }
    CHECK(spy_ccl_rounds(c0) == spy_ccl_rounds(c1));
    spy_ccl_close(c0);
    spy_ccl_close(c1);

    /* the same calls between "machines": two ranks over a pair of connected stream sockets */
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    int32_t fds0[2] = {-1, sv[0]}, fds1[2] = {sv[1], -1};
    CHECK(spy_ccl_open_tcp(0, 2, fds0, 100, 1000000, &c0) == SPY_E_INVALID_ARG); /* not whole lines: closes sv[0] */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    fds0[1] = sv[0];
    fds1[0] = sv[1];
    CHECK_OK(spy_ccl_open_tcp(0, 2, fds0, 256, 5000000000ull, &c0));
    CHECK_OK(spy_ccl_open_tcp(1, 2, fds1, 256, 5000000000ull, &c1));
    if (c0 && c1) {
        CHECK(spy_ccl_is_tcp(c0) == 1);
        ccl_rank_run tcp[2] = {{.c = c0, .rank = 0}, {.c = c1, .rank = 1}};
        for (int i = 0; i < 2; i++)
            pthread_create(&threads[i], NULL, ccl_rank_main, &tcp[i]);
        for (int i = 0; i < 2; i++)
            pthread_join(threads[i], NULL);
        for (int i = 0; i < 2; i++) {
            ccl_rank_run *r = &tcp[i];
            for (int k = 0; k < 6; k++)
                CHECK(r->s[k] == SPY_OK);
            for (int e = 0; e < 100; e++)
                CHECK(r->sum[e] == (float)(2 * e + 100));
            CHECK(r->interleaved[0] == 0 && r->interleaved[1] == 10 && r->interleaved[2] == 1);
            CHECK(r->scattered_chunks[0] == (i ? 5.0 : 3.0) && r->scattered_chunks[1] == (i ? 9.0 : 7.0));
            for (int b = 0; b < 300; b++)
                CHECK(r->bcast[b] == (uint8_t)b);
            CHECK(r->a2a[0] == i && r->a2a[1] == 2 + i);
            CHECK(r->s[6] == SPY_E_CCL_MISMATCH || r->s[6] == SPY_E_CCL_PEER);
            CHECK(r->s[7] == SPY_E_CCL_PEER);
        }
    }
    spy_ccl_close(c0);
    spy_ccl_close(c1);
    /* an abort between machines reaches the peer with its reason */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    fds0[1] = sv[0];
    fds1[0] = sv[1];
    CHECK_OK(spy_ccl_open_tcp(0, 2, fds0, 256, 5000000000ull, &c0));
    CHECK_OK(spy_ccl_open_tcp(1, 2, fds1, 256, 5000000000ull, &c1));
    if (c0 && c1) {
        spy_ccl_abort(c1, "its card failed");
        CHECK(spy_ccl_barrier(c0) == SPY_E_CCL_PEER);
        CHECK(strstr(spy_last_error(), "its card failed") != NULL);
        CHECK(spy_ccl_rearm(c0, spy_ccl_rounds(c0)) == SPY_E_CCL_PEER); /* its sockets are shut */
    }
    spy_ccl_close(c0);
    spy_ccl_close(c1);
    /* a peer that leaves: its end of the stream closes, the wait ends at once */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    fds0[1] = sv[0];
    CHECK_OK(spy_ccl_open_tcp(0, 2, fds0, 256, 5000000000ull, &c0));
    close(sv[1]);
    if (c0) {
        CHECK(spy_ccl_barrier(c0) == SPY_E_CCL_PEER);
        CHECK(strstr(spy_last_error(), "closed its connection") != NULL);
        spy_ccl_close(c0);
    }

    /* a peer that never arrives: the wait ends at the timeout */
    snprintf(name, sizeof name, "/spyreccl-test-lone-%ld", (long)time(NULL));
    CHECK_OK(spy_ccl_open(name, 0, 2, 256, 1, 50000000ull, &lone));
    CHECK_OK(spy_ccl_unlink(name));
    if (lone) {
        CHECK(spy_ccl_barrier(lone) == SPY_E_CCL_TIMEOUT);
        CHECK(strstr(spy_last_error(), "within the timeout") != NULL);
        spy_ccl_close(lone);
    }
}

/* Two cards, one per thread, each running a plan of one collective job (an all-reduce of
 * binding 0 in place) in a group of two: the data, the time (the later card's readiness plus
 * the duration), the group to attach, and a failure that aborts the group for the peer. */
typedef struct plan_rank_run {
    spy_device *d;
    spy_plan *plan;
    uint64_t buf;
    double ready, end;
    spy_status s, s2;
} plan_rank_run;

static void *plan_rank_main(void *arg)
{
    plan_rank_run *r = arg;
    CHECK_OK(spy_timed_job(r->d, r->ready, 0, 0, NULL)); /* the card is busy until `ready` */
    r->s = spy_plan_launch(r->plan, &r->buf, 1, 0, &r->end);
    return NULL;
}

/* Both ranks' plans launched at once, a thread each (each waits in the ring for the other). */
static void launch_both(plan_rank_run runs[2])
{
    pthread_t threads[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, plan_rank_main, &runs[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
}

static uint8_t *collective_plan(const spy_collective *coll, uint64_t *len)
{
    uint64_t head = sizeof(spy_plan_header) + sizeof(spy_plan_job) + 2 * sizeof(spy_reloc) + sizeof(spy_layout);
    *len = head + sizeof *coll;
    uint8_t *blob = aligned_alloc(8, *len);
    memset(blob, 0, *len);
    spy_plan_header h = {SPY_PLAN_MAGIC, SPY_PLAN_VERSION, 1, 2, 1, 1, *len, {0}};
    spy_plan_job job = {head, sizeof *coll, 0, 2, 0, SPY_PLAN_JOB_COLLECTIVE};
    spy_reloc rel[2] = {{0, 0, 0}, {0, 0, 0}};
    memcpy(blob, &h, sizeof h);
    memcpy(blob + sizeof h, &job, sizeof job);
    memcpy(blob + sizeof h + sizeof job, rel, sizeof rel);
    memcpy(blob + head, coll, sizeof *coll);
    return blob;
}

static void test_plan_collective(void)
{
    current = "plan collective";
    spy_profile pr = test_profile();
    char name[64];
    snprintf(name, sizeof name, "/spyreccl-plan-%ld", (long)time(NULL));
    spy_ccl *c[2] = {NULL, NULL};
    CHECK_OK(spy_ccl_open(name, 0, 2, 256, 1, 5000000000ull, &c[0]));
    CHECK_OK(spy_ccl_open(name, 1, 2, 256, 0, 5000000000ull, &c[1]));
    CHECK_OK(spy_ccl_unlink(name));
    spy_collective coll = {SPY_COLL_ALL_REDUCE, SPY_CCL_F32, SPY_CCL_SUM, 2, 0, 0, 512, 512, 0, 0, 250.0};
    uint64_t len;
    uint8_t *blob = collective_plan(&coll, &len);
    plan_rank_run runs[2];
    memset(runs, 0, sizeof runs);
    for (int i = 0; i < 2 && c[0] && c[1]; i++) {
        CHECK_OK(spy_device_open(&pr, SPY_MODE_FUNCTIONAL, (uint32_t)i, &runs[i].d));
        CHECK_OK(spy_plan_create(runs[i].d, blob, len, &runs[i].plan));
        CHECK_OK(spy_malloc(runs[i].d, 512, SPY_MEM_DATA, &runs[i].buf));
        float x[128];
        for (int e = 0; e < 128; e++)
            x[e] = (float)(e + 1000 * i);
        CHECK_OK(spy_mem_write(runs[i].d, runs[i].buf, x, sizeof x));
        runs[i].ready = i ? 5e9 : 1e9; /* later than the launches (host clock) */
    }
    if (!runs[0].plan || !runs[1].plan)
        goto out;
    double end;
    CHECK(spy_plan_launch(runs[0].plan, &runs[0].buf, 1, 0, &end) == SPY_E_INVALID_ARG); /* no ring attached */
    CHECK(spy_plan_set_group(runs[0].plan, 1, c[0]) == SPY_E_INVALID_ARG);             /* one group only */
    for (int i = 0; i < 2; i++)
        CHECK_OK(spy_plan_set_group(runs[i].plan, 0, c[i]));
    launch_both(runs);
    for (int i = 0; i < 2; i++) {
        CHECK(runs[i].s == SPY_OK);
        float y[128];
        CHECK_OK(spy_mem_read(runs[i].d, runs[i].buf, y, sizeof y));
        for (int e = 0; e < 128; e++)
            CHECK(y[e] == (float)(2 * e + 1000));
        CHECK(runs[i].end == 5e9 + 250.0); /* the later card's readiness, then the duration */
    }
    /* a fault on rank 0 before its collective aborts the group: rank 1 fails instead of waiting */
    spy_ccl_abort(c[0], "its card failed");
    CHECK(spy_plan_launch(runs[1].plan, &runs[1].buf, 1, 0, &end) == SPY_E_CCL_PEER);
    CHECK(strstr(spy_last_error(), "its card failed") != NULL);
    CHECK(spy_last_error_job() == 0);
    /* both ranks out of the ring, the group rearmed at the later rank's round serves again */
    CHECK(spy_ccl_rearm(c[1], spy_ccl_rounds(c[1]) - 1) == SPY_E_INVALID_ARG);
    uint64_t resume = spy_ccl_rounds(c[0]) > spy_ccl_rounds(c[1]) ? spy_ccl_rounds(c[0]) : spy_ccl_rounds(c[1]);
    for (int i = 0; i < 2; i++)
        CHECK_OK(spy_ccl_rearm(c[i], resume));
    for (int i = 0; i < 2; i++)
        CHECK_OK(spy_mem_write(runs[i].d, runs[i].buf, (float[128]){[0] = (float)(i + 1)}, 128 * sizeof(float)));
    launch_both(runs);
    for (int i = 0; i < 2; i++) {
        CHECK(runs[i].s == SPY_OK);
        float y[2];
        CHECK_OK(spy_mem_read(runs[i].d, runs[i].buf, y, sizeof y));
        CHECK(y[0] == 3.0f && y[1] == 0.0f);
    }
    /* hostile descriptors are refused when the plan is made */
    spy_collective bad = coll;
    bad.out_bytes = 256;
    uint8_t *bad_blob = collective_plan(&bad, &len);
    spy_plan *p = NULL;
    CHECK(spy_plan_create(runs[0].d, bad_blob, len, &p) == SPY_E_BAD_PROGRAM && !p);
    free(bad_blob);
    bad = coll;
    bad.group = 1;
    bad_blob = collective_plan(&bad, &len);
    CHECK(spy_plan_create(runs[0].d, bad_blob, len, &p) == SPY_E_BAD_PROGRAM && !p);
    free(bad_blob);
    bad = coll;
    bad.kind = SPY_COLL_ALL_GATHER;
    bad.out_bytes = 1024;
    bad.chunk_bytes = 384; /* does not divide the 512 bytes */
    bad_blob = collective_plan(&bad, &len);
    CHECK(spy_plan_create(runs[0].d, bad_blob, len, &p) == SPY_E_BAD_PROGRAM && !p);
    free(bad_blob);
out:
    for (int i = 0; i < 2; i++) {
        spy_plan_destroy(runs[i].plan);
        spy_device_close(runs[i].d);
        spy_ccl_close(c[i]);
    }
    free(blob);
}

static void test_timed_job(void)
{
    current = "timed job";
    spy_profile pr = test_profile();
    spy_device *d = NULL;
    CHECK_OK(spy_device_open(&pr, SPY_MODE_TIMING, 0, &d));
    if (!d)
        return;
    double end = 0;
    CHECK_OK(spy_timed_job(d, 1e9, 500, 0, &end)); /* waits for the last rank, at 1 s */
    CHECK(end == 1e9 + 500 && spy_device_finish_ns(d) == end);
    CHECK_OK(spy_timed_job(d, 0, 100, 0, &end)); /* queues behind the first */
    CHECK(end == 1e9 + 600);
    CHECK(spy_timed_job(d, 0, NAN, 0, &end) == SPY_E_INVALID_ARG);
    CHECK(spy_timed_job(d, -1, 1, 0, NULL) == SPY_E_INVALID_ARG);
    CHECK(spy_device_finish_ns(d) == 1e9 + 600);
    spy_device_close(d);
}

/* Host memory the builders use again (graph.c): a large buffer freed is handed out again
 * for a need it fits, not for a much smaller one; small ones and a full pool go to malloc;
 * realloc keeps what was used; threads share the pool safely. */
static void *pool_churn(void *arg)
{
    (void)arg;
    for (int i = 0; i < 2000; i++) {
        uint8_t *p = spy_host_alloc((uint64_t)(64 + i % 7 * 40) << 10);
        if (!p)
            return (void *)1;
        p[0] = (uint8_t)i;
        spy_host_free(p);
    }
    return NULL;
}

static void test_host_pool(void)
{
    current = "host pool";
    uint8_t *a = spy_host_alloc(300u << 10);
    CHECK(a != NULL && (uintptr_t)a % 16 == 0);
    memset(a, 7, 300u << 10);
    spy_host_free(a);
    uint8_t *b = spy_host_alloc(280u << 10); /* fits the kept buffer */
    CHECK(b == a);
    uint8_t *small = spy_host_alloc(40u << 10); /* far smaller: not the kept one */
    CHECK(small != NULL && small != b);
    spy_host_free(small);
    b[0] = 1;
    b[1] = 2;
    uint8_t *c = spy_host_realloc(b, 2, 1u << 20); /* grows: the used bytes move */
    CHECK(c != NULL && c[0] == 1 && c[1] == 2);
    CHECK(spy_host_realloc(c, 2, 100) == c); /* already large enough */
    spy_host_free(c);
    spy_host_free(NULL);
    /* more buffers than the pool keeps: the rest are freed, none lost (ASan's leak check) */
    uint8_t *many[12];
    for (int i = 0; i < 12; i++)
        many[i] = spy_host_alloc((uint64_t)(100 + i) << 10);
    for (int i = 0; i < 12; i++)
        spy_host_free(many[i]);
    CHECK(spy_host_alloc((uint64_t)SIZE_MAX) == NULL);
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&t[i], NULL, pool_churn, NULL) == 0);
    pid_t child = fork(); /* while the threads use the pool: the child's must not be left locked */
    if (child == 0) {
        void *p = spy_host_alloc(200u << 10);
        spy_host_free(p);
        _exit(p ? 0 : 1);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (int i = 0; i < 2; i++) {
        void *r = (void *)1;
        CHECK(pthread_join(t[i], &r) == 0 && r == NULL);
    }
}

/* A program's footprint: runs times counts, descriptor entries clipped to the table,
 * gathers by their indices, distinct cores; counts past a command's dimensions unread. */
static void test_program_footprint(void)
{
    spy_cmd cmds[4];
    memset(cmds, 0, sizeof cmds);
    cmds[0].op = SPY_OP_LOAD;
    cmds[0].core = 3;
    cmds[0].u.dma.run_bytes = 64;
    cmds[0].u.dma.ndims = 9; /* hostile: only three counts exist */
    cmds[0].u.dma.count[0] = 2;
    cmds[0].u.dma.count[1] = 3;
    cmds[0].u.dma.count[2] = 5;
    cmds[1].op = SPY_OP_STORE;
    cmds[1].core = 3;
    cmds[1].flags = SPY_DMA_DESCS;
    cmds[1].u.dma.src_off = 1;
    cmds[1].u.dma.desc_count = 1000; /* past the table: clipped */
    cmds[2].op = SPY_OP_GATHER;
    cmds[2].core = 65534;
    cmds[2].u.gather.nidx = 4;
    cmds[2].u.gather.run_bytes = 16;
    cmds[2].u.gather.ndims = 1;
    cmds[2].u.gather.count[0] = 3;
    cmds[3].op = SPY_OP_BARRIER;
    cmds[3].core = SPY_CORE_CARD;
    spy_desc descs[3] = {{0, 0, 10, 0}, {0, 0, 20, 0}, {0, 0, 30, 0}};
    uint64_t bytes = 0;
    uint32_t cores = 0;
    CHECK_OK(spy_program_footprint(cmds, 4, descs, 3, &bytes, &cores));
    CHECK(bytes == 64 * 30 + 20 + 30 + 4 * 16 * 3);
    CHECK(cores == 2);
    CHECK_OK(spy_program_footprint(NULL, 0, NULL, 0, &bytes, &cores));
    CHECK(bytes == 0 && cores == 0);
    CHECK(spy_program_footprint(cmds, 4, NULL, 3, &bytes, &cores) == SPY_E_INVALID_ARG);
}

/* The matmul tiling search: a prefill GEMM gets a 2-D grid that fits, its estimate is at
 * least its DRAM floor, a shape too large for any tile is refused as a scratchpad error,
 * and bad arguments are refused naming the field. */
static void test_matmul_tiling(void)
{
    spy_mm_cost c = {.num_cores = 32, .stick_bytes = 128, .scratchpad_bytes = 2u << 20, .gran_m = 8, .gran_n = 64,
                     .gran_k = 8, .dram_burst_bytes = 64, .macs_per_ns = 1140.0, .dram_bytes_per_ns = 150.0,
                     .core_dma_bytes_per_ns = 25.0, .pt_fp32_ratio = 0.25, .pt_latency_ns = 20.0, .dma_latency_ns = 500.0,
                     .ring_bytes_per_ns = 128.0, .ring_hop_ns = 2.0, .sfu_elems_per_ns = 64.0, .sfu_fp32_ratio = 1.0,
                     .sfu_latency_ns = 10.0, .job_launch_ns = 2000.0};
    spy_mm_problem p = {.batch = 1, .m = 1024, .n = 12800, .k = 4096, .e_in = 2, .e_out = 2, .trans_b = 1,
                        .epi_temp_e = 4};
    spy_mm_tiling t;
    CHECK_OK(spy_mm_choose(&c, &p, &t));
    CHECK(t.groups * t.pk * t.pm * t.pn == 32 && t.pm > 1 && t.pn > 1 && t.nbuf >= 2);
    spy_mm_terms o;
    CHECK_OK(spy_mm_estimate(&c, &p, &t, 1, &o));
    CHECK(o.ns >= o.floor_ns && o.lx_bytes <= (double)c.scratchpad_bytes && o.ns > 0);
    uint32_t n = 0, got = 0;
    CHECK_OK(spy_mm_grids(&c, &p, NULL, 0, &n));
    CHECK(n > 1000);
    spy_mm_tiling *grids = calloc(n, sizeof *grids);
    double *best = calloc(n, sizeof *best), *floor_ns = calloc(n, sizeof *floor_ns);
    uint32_t *rows = calloc(n, sizeof *rows), nshort = 0;
    CHECK(grids && best && floor_ns && rows);
    if (grids && best && floor_ns && rows) {
        CHECK_OK(spy_mm_grids(&c, &p, grids, n, &got));
        CHECK(got == n);
        CHECK_OK(spy_mm_coarse(&c, &p, 1, best, floor_ns, rows, n, &got, &nshort));
        CHECK(nshort == SPY_MM_SHORTLIST);
        for (uint32_t i = 0; i < n; i++)
            CHECK(isnan(best[i]) || best[i] >= floor_ns[i]);
    }
    free(grids);
    free(best);
    free(floor_ns);
    free(rows);

    spy_mm_problem huge = p; /* a 4-byte, 64-deep chunk of these rows cannot fit 1 KiB */
    spy_mm_cost tiny = c;
    tiny.scratchpad_bytes = 1024;
    huge.e_in = huge.e_out = 4;
    CHECK(spy_mm_choose(&tiny, &huge, &t) == SPY_E_SCRATCHPAD);
    spy_mm_cost bad = c;
    bad.stick_bytes = 96;
    CHECK(spy_mm_choose(&bad, &p, &t) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "stick_bytes"));
    bad = c;
    bad.dram_bytes_per_ns = NAN;
    CHECK(spy_mm_choose(&bad, &p, &t) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "dram_bytes_per_ns"));
    spy_mm_problem wrong = p;
    wrong.m = (uint64_t)1 << 32;
    CHECK(spy_mm_choose(&c, &wrong, &t) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "m "));
    wrong = p;
    wrong.nstores = SPY_MM_MAX_EPI + 1;
    CHECK(spy_mm_choose(&c, &wrong, &t) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "nstores"));
    wrong = p;
    wrong.ntiles = 1;
    wrong.e_tiles[0] = 3;
    CHECK(spy_mm_choose(&c, &wrong, &t) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "e_tiles[0] = 3"));
    spy_mm_tiling over = t;
    over.n_tiles = 12801;
    CHECK(spy_mm_estimate(&c, &p, &over, 1, &o) == SPY_E_INVALID_ARG && strstr(spy_last_error(), "n_tiles"));
    over = t;
    over.nbuf = 1;
    CHECK(spy_mm_estimate(&c, &p, &over, 1, &o) == SPY_E_INVALID_ARG);
    spy_mm_problem empty = p;
    empty.m = 0;
    CHECK_OK(spy_mm_choose(&c, &empty, &t));
    CHECK(t.groups == 32 && t.tk == SPY_MM_K_GRANULE);
}

int main(void)
{
    test_allocator();
    test_host_pool();
    test_validation();
    test_no_stray_writes();
    test_functional();
    test_cost_model();
    test_timing_reuses_a_jobs_duration();
    test_clocks();
    test_host_clock_threads();
    test_gather_and_faults();
    test_plan();
    test_sfu();
    test_sfu_table();
    test_sfu_fp32_rate();
    test_profile_figures();
    test_layouts();
    test_builder();
    test_matmul_builder();
    test_loop_builder();
    test_loop_merged_stores();
    test_attention_builder();
    test_paged_attention_builder();
    test_matmul_tiling();
    test_program_footprint();
    test_ccl();
    test_plan_collective();
    test_timed_job();
    if (failures) {
        fprintf(stderr, "%d native check(s) failed\n", failures);
        return 1;
    }
    printf("native tests passed\n");
    return 0;
}
