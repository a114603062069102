/* tiling.c -- the matmul's tiling search and its cost model.
 *
 * spyre_rt.construct.matmul.tiling describes the grid, the tiles and the model; this file
 * is their one implementation. The model's command charges are those of spyre_rt.cost
 * (what sim.c charges a command), with the same operations in the same order, so that a
 * choice among nearly equal estimates is the one the Python cost model would make
 * (tests/test_matmul_tiling.py holds each term to cost.py's charges). Average tiles are
 * fractions: their floor divisions and remainders are Python's on floats; integers stay
 * integers.
 *
 * The search: every grid (a split of the cores into groups of pk x pm x pn, and a count of
 * M and N tiles aimed at the sizes of M_AIMS and N_AIMS) that fits the scratchpad with the
 * smallest K chunk; a coarse estimate of each with two K chunks; the SPY_MM_SHORTLIST best
 * estimated with every K chunk and buffer count; the cheapest of those by the tie rule of
 * spy_mm_choose. No estimate of a grid is below its DRAM floor (the DRAM streaming its
 * bytes and two latencies, a term of every estimate), so grids are estimated from the
 * lowest floor up and those whose floor is above the shortlist's worst are not estimated. */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

static const uint32_t M_AIMS[] = {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024};
static const uint32_t N_AIMS[] = {1,   2,   4,   8,   16,  32,  64,   128,  192, 256,
                                  320, 384, 448, 512, 640, 768, 1024, 1536, 2048};
static const uint32_t K_CHUNKS[] = {64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096};
#define NM SPY_ARRAY_LEN(M_AIMS)
#define NN SPY_ARRAY_LEN(N_AIMS)
#define NK (SPY_ARRAY_LEN(K_CHUNKS) + 1)
#define LX_ALIGN 128         /* scratchpad regions start on a stick */
#define TIE 0.02             /* estimates within this fraction of the cheapest are equal */
#define DRAM_BUDGET 1.5      /* DRAM bytes a tiling may move, in minimums */
#define MAX_CORES 4096

/* ---- arithmetic as Python does it on floats --------------------------------------------- */

static double py_floordiv(double a, double b)
{
    double mod = fmod(a, b);
    double div = (a - mod) / b;
    if (mod != 0.0) {
        if ((b < 0) != (mod < 0))
            div -= 1.0;
    }
    if (div != 0.0) {
        double fl = floor(div);
        if (div - fl > 0.5)
            fl += 1.0;
        return fl;
    }
    return copysign(0.0, a / b);
}

static double round_up_f(double x, double g) { return -py_floordiv(-x, g) * g; }
static int64_t round_up(int64_t x, int64_t g) { return (x + g - 1) / g * g; } /* x >= 0, g > 0 */
static int64_t ceil_div(int64_t x, int64_t g) { return (x + g - 1) / g; }
static int64_t rounds(int64_t n) /* ceil(log2(n)): the halvings of a reduction over n */
{
    int64_t r = 0;
    while (((int64_t)1 << r) < n)
        r++;
    return r;
}
static double dmax(double a, double b) { return a >= b ? a : b; }
static double dmin(double a, double b) { return a <= b ? a : b; }

/* ---- the command charges (spyre_rt.cost.CostModel) -------------------------------------- */

/* DRAM bytes a transfer of `rows` runs of `cols` contiguous elements in the stick layout is
 * charged: whole sticks are exact, a stick's remainder costs whole bursts. */
static double charged_bytes(const spy_mm_cost *c, double rows, double cols, uint32_t itemsize)
{
    uint32_t s = c->stick_bytes / itemsize; /* a power of two */
    if (cols == (double)(int64_t)cols) { /* whole elements: exact either way */
        int64_t whole = (int64_t)cols;
        return rows * (double)(whole / s * c->stick_bytes + round_up(whole % s * itemsize, c->dram_burst_bytes));
    }
    /* cols >= 0 over a power of two: floor(cols / s) and its remainder are exact, as Python's */
    double q = floor(cols / s), rem = (cols - q * s) * itemsize;
    uint32_t b = c->dram_burst_bytes;
    double rounded = (b & (b - 1)) == 0 ? ceil(rem / b) * b : round_up_f(rem, b);
    return rows * (q * c->stick_bytes + rounded);
}

static double matmul_ns(const spy_mm_cost *c, int64_t rows, int64_t cols, int64_t depth, bool fp32)
{
    double padded = (double)round_up(rows, c->gran_m) * (double)round_up(cols, c->gran_n) *
                    (double)round_up(depth, c->gran_k); /* exact in the sizes check_args accepts */
    return c->pt_latency_ns + padded / (c->macs_per_ns * (fp32 ? c->pt_fp32_ratio : 1.0));
}

static double sfu_ns(const spy_mm_cost *c, int64_t elems) /* one instruction on fp32 operands */
{
    return c->sfu_latency_ns + (double)elems * 1.0 / (c->sfu_elems_per_ns * c->sfu_fp32_ratio);
}

static double dram_share(const spy_mm_cost *c, double transfers)
{
    return dmin(c->core_dma_bytes_per_ns, c->dram_bytes_per_ns / transfers);
}

static double transfer_ns(const spy_mm_cost *c, double nbytes, double rate)
{
    return c->dma_latency_ns + nbytes / rate;
}

static double ring_ns(const spy_mm_cost *c, double nbytes, double hops)
{
    return hops * c->ring_hop_ns + nbytes / c->ring_bytes_per_ns;
}

static double dram_ns(const spy_mm_cost *c, double nbytes) { return nbytes / c->dram_bytes_per_ns; }

/* ---- the problem's sizes ------------------------------------------------------------------ */

static int64_t k_or_1(const spy_mm_problem *p) { return p->k > 1 ? (int64_t)p->k : 1; } /* K of a chunk's depth */
static uint32_t e_store(const spy_mm_problem *p, uint32_t i) { return p->nstores ? p->e_stores[i] : p->e_out; }
static uint32_t n_store(const spy_mm_problem *p) { return p->nstores ? p->nstores : 1; }

static uint64_t min_bytes(const spy_mm_problem *p) /* each operand read once, the output written once */
{
    uint64_t tiles = 0, rows = 0;
    for (uint32_t i = 0; i < n_store(p); i++)
        tiles += e_store(p, i);
    for (uint32_t i = 0; i < p->ntiles; i++)
        tiles += p->e_tiles[i];
    for (uint32_t i = 0; i < p->nrows; i++)
        rows += p->e_rows[i];
    return p->batch * ((p->m * p->k + p->k * p->n) * p->e_in + p->m * p->n * tiles + p->n * rows);
}

/* The least time the card can take: all its arrays busy, or the DRAM streaming the minimum. */
static double roofline_ns(const spy_mm_cost *c, const spy_mm_problem *p)
{
    double flops = 2 * (double)(p->batch * p->m * p->n * p->k);
    double compute = flops / (2.0 * c->num_cores * (c->macs_per_ns * (p->fp32 ? c->pt_fp32_ratio : 1.0)));
    return dmax(compute, dram_ns(c, (double)min_bytes(p)));
}

/* The largest piece of `extent` cut into `tiles` pieces of whole granules (the preferred
 * unit if every piece gets one, else halved down to 8, else single elements). */
static int64_t tile_max(int64_t extent, int64_t tiles, int64_t preferred)
{
    int64_t g = preferred;
    while (g > 8 && extent < g * tiles)
        g /= 2;
    if (extent < g * tiles)
        g = 1;
    int64_t q = ceil_div(extent, g);
    int64_t piece = ceil_div(q, tiles) * g;
    return piece < extent ? piece : extent;
}

static int64_t gran_m_of(const spy_mm_cost *c, const spy_mm_problem *p)
{
    return p->trans_a ? c->stick_bytes / p->e_in : c->gran_m;
}

/* Scratchpad bytes a core needs (the layout record.Scratchpad makes). */
static int64_t lx_bytes(const spy_mm_cost *c, const spy_mm_problem *p, int64_t tm, int64_t tn, int64_t tk,
                        int64_t pk, int64_t nbuf)
{
    int64_t si = c->stick_bytes / p->e_in, k1 = k_or_1(p), depth = tk < k1 ? tk : k1;
    int64_t st = c->stick_bytes, al = LX_ALIGN;
    int64_t a = (p->trans_a ? depth * round_up(tm, si) : tm * round_up(depth, si)) * p->e_in;
    int64_t b = (p->trans_b ? tn * round_up(depth, si) : depth * round_up(tn, si)) * p->e_in;
    int64_t acc = tm * round_up(tn, 32) * 4;
    int64_t bias = p->e_bias ? round_up(tn, st / p->e_bias) * p->e_bias : 0;
    int64_t more = 0;
    for (uint32_t i = 0; i < n_store(p); i++) {
        int64_t e = e_store(p, i);
        more += 2 * round_up(tm * round_up(tn, st / e) * e, al);
    }
    for (uint32_t i = 0; i < p->ntiles; i++) {
        int64_t e = p->e_tiles[i];
        more += 2 * round_up(tm * round_up(tn, st / e) * e, al);
    }
    for (uint32_t i = 0; i < p->nrows; i++) {
        int64_t e = p->e_rows[i];
        more += 2 * round_up(round_up(tn, st / e) * e, al);
    }
    int64_t estrip = p->epi_strip && p->epi_strip < tm ? p->epi_strip : tm;
    int64_t temps = (int64_t)p->epi_temps * round_up(estrip * round_up(tn, 32) * p->epi_temp_e, al);
    /* an A prologue: its vectors, per operand buffer, and its temporaries over a chunk */
    int64_t vectors = 0;
    for (uint32_t i = 0; i < p->npro_rows; i++)
        vectors += round_up(tm * p->e_pro_rows[i], al);
    for (uint32_t i = 0; i < p->npro_cols; i++)
        vectors += round_up(depth * p->e_pro_cols[i], al);
    int64_t strip = p->pro_strip && p->pro_strip < tm ? p->pro_strip : tm;
    if (p->pro_temps) /* (their element size is checked only where there are some) */
        temps += (int64_t)p->pro_temps * round_up(strip * round_up(depth, 32) * p->pro_temp_e, al);
    return nbuf * (round_up(a, al) + round_up(b, al) + vectors) + round_up(acc, al) * (pk > 1 ? 2 : 1) + more +
           2 * round_up(bias, al) + temps;
}

/* ---- the estimate ------------------------------------------------------------------------ */

/* A grid row, with its largest tile. */
typedef struct grid {
    spy_mm_tiling t; /* tk, nbuf unset */
    int64_t tm, tn;
} grid;

typedef struct step_terms {
    double t_mm, t_port, t_ring, t_load, t_fwd, t_pro, t_step;
} step_terms;

static void chunks(const spy_mm_cost *c, const spy_mm_problem *p, double tm, double tn, double depth, double *a,
                   double *b)
{
    *a = p->trans_a ? charged_bytes(c, depth, tm, p->e_in) : charged_bytes(c, tm, depth, p->e_in);
    *b = p->trans_b ? charged_bytes(c, tn, depth, p->e_in) : charged_bytes(c, depth, tn, p->e_in);
}

/* One step of a wave (chunks `depth` deep) on its busiest core. */
static step_terms step_of(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, int64_t tm,
                          int64_t tn, double tm_avg, double tn_avg, int64_t depth, int64_t active)
{
    step_terms s;
    int64_t pk = t->pk, pm = t->pm, pn = t->pn;
    s.t_mm = matmul_ns(c, tm, tn, depth, p->fp32);
    double a, b, a_avg, b_avg;
    chunks(c, p, (double)tm, (double)tn, (double)depth, &a, &b);
    chunks(c, p, tm_avg, tn_avg, (double)depth, &a_avg, &b_avg);
    s.t_port = ((double)(pm + pn) * c->dma_latency_ns + ((double)pm * a + (double)pn * b) / c->core_dma_bytes_per_ns) /
               (double)(pm * pn);
    double loads = (double)(active * pk * (pm + pn));
    s.t_load = transfer_ns(c, ((double)pm * a_avg + (double)pn * b_avg) / (double)(pm + pn), dram_share(c, loads));
    double hops = (double)(pm > pn ? pm : pn) / 2;
    double a_send = ring_ns(c, a, hops), b_send = ring_ns(c, b, hops);
    s.t_fwd = dmax((double)(pn - 1) * a_send, (double)(pm - 1) * b_send);
    s.t_ring = ((double)(pm * (pn - 1)) * a_send + (double)(pn * (pm - 1)) * b_send) / (double)(pm * pn);
    /* an A prologue: its loader rewrites each A chunk between the load and the forwards; a
     * core loads 1 / pn of its A chunks */
    int64_t strip = p->pro_strip && p->pro_strip < tm ? p->pro_strip : tm;
    s.t_pro = p->pro_instrs && strip > 0 ? (double)(p->pro_instrs * ceil_div(tm, strip)) * sfu_ns(c, strip * depth)
                                         : 0; /* no rows (m 0): no prologue work */
    s.t_step = dmax(dmax(dmax(dmax(s.t_mm, s.t_ring), s.t_port), s.t_pro / (double)pn),
                    (s.t_load + s.t_pro + s.t_fwd) / (double)(t->nbuf - 1));
    return s;
}

/* What does not depend on the K chunk: tiles, blocks, waves, the bytes moved. */
static void blocks_of(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, int64_t tm, int64_t tn,
                      spy_mm_terms *o)
{
    int64_t blocks = (int64_t)p->batch * (t->m_tiles / t->pm) * (t->n_tiles / t->pn);
    o->tm = (double)tm;
    o->tn = (double)tn;
    o->tm_avg = (double)p->m / (double)t->m_tiles;
    o->tn_avg = (double)p->n / (double)t->n_tiles;
    o->blocks = (double)blocks;
    o->waves = (double)ceil_div(blocks, t->groups);
    o->active = (double)(blocks < t->groups ? blocks : t->groups);
    double k = (double)p->k;
    double a_strip = p->trans_a ? charged_bytes(c, k, o->tm_avg, p->e_in) : charged_bytes(c, o->tm_avg, k, p->e_in);
    double b_strip = p->trans_b ? charged_bytes(c, o->tn_avg, k, p->e_in) : charged_bytes(c, k, o->tn_avg, p->e_in);
    double tile_bytes = 0;
    for (uint32_t i = 0; i < n_store(p); i++)
        tile_bytes += charged_bytes(c, o->tm_avg, o->tn_avg, e_store(p, i));
    for (uint32_t i = 0; i < p->ntiles; i++)
        tile_bytes += charged_bytes(c, o->tm_avg, o->tn_avg, p->e_tiles[i]);
    o->per_block = (double)t->pm * a_strip + (double)t->pn * b_strip + (double)(t->pm * t->pn) * tile_bytes;
    o->dram_bytes = (double)blocks * o->per_block;
    o->floor_ns = dram_ns(c, o->dram_bytes) + 2 * c->dma_latency_ns;
}

/* The K chunks the pieces of a core's last tile walk (the record's last_depth): as many
 * chunks' matmuls as the stores of the last tiles take, at most the operand buffers and
 * the chunks. */
static uint32_t last_depth_of(const spy_mm_terms *o, uint32_t nbuf)
{
    double most = dmin((double)nbuf, dmax(o->steps, 1));
    if (!(o->t_mm > 0) || !(o->t_drain > o->t_mm))
        return 1;
    return (uint32_t)dmin(most, ceil(o->t_drain / o->t_mm));
}

/* Every term of one tiling's estimate but lx_bytes, *o holding its grid's (blocks_of). */
static void estimate(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, spy_mm_terms *o)
{
    int64_t pk = t->pk, pm = t->pm, pn = t->pn, tk = t->tk, tm = (int64_t)o->tm, tn = (int64_t)o->tn;
    int64_t k_slice = tile_max((int64_t)p->k, pk, SPY_MM_K_GRANULE);
    int64_t steps = ceil_div(k_slice, tk), tail = k_slice - (steps - 1) * tk;
    int64_t blocks = (int64_t)o->blocks, active = (int64_t)o->active;
    o->steps = (double)steps;
    o->tail = (double)tail;
    int64_t sends = pm * (pn - 1) + pn * (pm - 1);
    o->cmds = (double)blocks * ((double)steps * (double)(pk * (pm + pn + sends + pm * pn)) + (double)(pm * pn * (pk + 2)));

    int64_t k1 = k_or_1(p);
    step_terms step = step_of(c, p, t, tm, tn, o->tm_avg, o->tn_avg, tk < k1 ? tk : k1, active);
    step_terms last = step_of(c, p, t, tm, tn, o->tm_avg, o->tn_avg, tail > 1 ? tail : 1, active);
    o->t_mm = step.t_mm;
    o->t_port = step.t_port;
    o->t_ring = step.t_ring;
    o->t_load = step.t_load;
    o->t_fwd = step.t_fwd;
    o->t_prologue = step.t_pro;
    o->t_step = step.t_step;
    o->t_steps = steps > 0 ? (double)(steps - 1) * step.t_step + last.t_step : 0;

    /* the reduction's adds and the epilogue work on the fp32 accumulator */
    double sfu = sfu_ns(c, tm * tn);
    int64_t acc_bytes = tm * round_up(tn, 32) * 4;
    o->t_reduce = (double)rounds(pk) * (ring_ns(c, (double)acc_bytes, 1) + sfu);
    o->t_epilogue = sfu * (double)((p->e_bias ? 2 : 1) + p->epi_instrs);
    o->t_wave = dmax(o->t_steps, dram_ns(c, (double)active * o->per_block)) + o->t_reduce + o->t_epilogue;

    o->t_fill = steps > 0 ? step.t_fwd + step.t_load + step.t_pro - dmax(0, step.t_load - c->dma_latency_ns - step.t_mm)
                          : 0;
    double storing = dram_share(c, (double)(active * pm * pn));
    double stored = 0;
    for (uint32_t i = 0; i < n_store(p); i++)
        stored += charged_bytes(c, (double)tm, (double)tn, e_store(p, i));
    o->t_drain = transfer_ns(c, stored, storing);
    o->t_stream = dram_ns(c, o->dram_bytes) + 2 * c->dma_latency_ns + step.t_mm + o->t_epilogue;
    /* Tiles finish in pieces of rows (build_matmul.c), their programs and stores under the
     * last matmuls. Not counted: the model is 2 to 5 % above the simulator at a 1,024-row
     * prefill's shapes. Counted, the tie rule picked tilings of fewer commands there that
     * were 0.4 % slower. */
    o->ns = dmax(o->t_fill + o->waves * o->t_wave + o->t_drain, o->t_stream);
}

/* ---- the arguments, checked -------------------------------------------------------------- */

static bool itemsize_ok(uint32_t e) { return e == 1 || e == 2 || e == 4; }
static bool figure_ok(double x, bool positive) { return isfinite(x) && (positive ? x > 0 : x >= 0); }

static spy_status check_args(const spy_mm_cost *c, const spy_mm_problem *p)
{
    if (!c || !p)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null cost model or problem");
    if (c->num_cores == 0 || c->num_cores > MAX_CORES)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: num_cores %u outside 1..%u", c->num_cores, MAX_CORES);
    if (c->stick_bytes < 4 || (c->stick_bytes & (c->stick_bytes - 1)) || c->stick_bytes > (1u << 20))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: stick_bytes %u is not a power of two from 4 to 2^20",
                        c->stick_bytes);
    if (c->scratchpad_bytes == 0 || c->scratchpad_bytes > ((uint64_t)1 << 40))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: scratchpad_bytes %llu outside 1..2^40",
                        (unsigned long long)c->scratchpad_bytes);
    if (!c->gran_m || !c->gran_n || !c->gran_k || !c->dram_burst_bytes || c->gran_m > 65536 || c->gran_n > 65536 ||
        c->gran_k > 65536 || c->dram_burst_bytes > 65536)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: a granule or the burst is 0 or above 65536");
    const double positive[] = {c->macs_per_ns, c->dram_bytes_per_ns, c->core_dma_bytes_per_ns, c->pt_fp32_ratio,
                               c->ring_bytes_per_ns, c->sfu_elems_per_ns, c->sfu_fp32_ratio};
    const char *pos_names[] = {"macs_per_ns", "dram_bytes_per_ns", "core_dma_bytes_per_ns", "pt_fp32_ratio",
                               "ring_bytes_per_ns", "sfu_elems_per_ns", "sfu_fp32_ratio"};
    for (size_t i = 0; i < SPY_ARRAY_LEN(positive); i++)
        if (!figure_ok(positive[i], true))
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: %s must be positive and finite", pos_names[i]);
    const double any[] = {c->pt_latency_ns, c->dma_latency_ns, c->ring_hop_ns, c->sfu_latency_ns, c->job_launch_ns};
    const char *any_names[] = {"pt_latency_ns", "dma_latency_ns", "ring_hop_ns", "sfu_latency_ns", "job_launch_ns"};
    for (size_t i = 0; i < SPY_ARRAY_LEN(any); i++)
        if (!figure_ok(any[i], false))
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: %s must be finite and not negative",
                            any_names[i]);
    const uint64_t sizes[] = {p->batch, p->m, p->n, p->k};
    const char *size_names[] = {"batch", "m", "n", "k"};
    for (size_t i = 0; i < 4; i++)
        if (sizes[i] >= ((uint64_t)1 << 32))
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: %s %llu is not below 2^32", size_names[i],
                            (unsigned long long)sizes[i]);
    /* the products the model forms (macs, bytes, padded tiles) stay exact in a double */
    if ((double)p->batch * (double)p->m * (double)p->n * ((double)p->k + 1) > 0x1p50 ||
        (double)p->batch * ((double)p->m + (double)p->n) * ((double)p->k + (double)p->n) > 0x1p48)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: %llux%llux%llu (batch %llu) is too large to cost",
                        (unsigned long long)p->m, (unsigned long long)p->n, (unsigned long long)p->k,
                        (unsigned long long)p->batch);
    if (!itemsize_ok(p->e_in) || !itemsize_ok(p->e_out) || (p->e_bias && !itemsize_ok(p->e_bias)) ||
        !itemsize_ok(p->epi_temp_e))
        return spy_fail(SPY_E_INVALID_ARG, -1,
                        "matmul tiling: element sizes e_in %u, e_out %u, e_bias %u, epi_temp_e %u: not 1, 2 or 4",
                        p->e_in, p->e_out, p->e_bias, p->epi_temp_e);
    if (p->trans_a > 1 || p->trans_b > 1 || p->fp32 > 1)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: trans_a, trans_b and fp32 are 0 or 1");
    if (p->nstores > SPY_MM_MAX_EPI || p->ntiles > SPY_MM_MAX_EPI || p->nrows > SPY_MM_MAX_EPI)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: nstores %u, ntiles %u, nrows %u: above %u", p->nstores,
                        p->ntiles, p->nrows, SPY_MM_MAX_EPI);
    const struct {
        const char *name;
        const uint32_t *e;
        uint32_t n;
    } epi[] = {{"e_stores", p->e_stores, p->nstores}, {"e_tiles", p->e_tiles, p->ntiles}, {"e_rows", p->e_rows, p->nrows}};
    for (size_t a = 0; a < SPY_ARRAY_LEN(epi); a++)
        for (uint32_t i = 0; i < epi[a].n; i++)
            if (!itemsize_ok(epi[a].e[i]))
                return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: %s[%u] = %u: not 1, 2 or 4", epi[a].name, i,
                                epi[a].e[i]);
    if (p->epi_temps > 64 || p->epi_instrs > 4096)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: epi_temps %u above 64 or epi_instrs %u above 4096",
                        p->epi_temps, p->epi_instrs);
    if (p->pro_temps > 64 || p->pro_instrs > SPY_MM_MAX_PROGRAM || p->npro_rows > SPY_MM_MAX_VECTORS ||
        p->npro_cols > SPY_MM_MAX_VECTORS || (p->pro_instrs && p->trans_a) ||
        ((p->pro_instrs || p->pro_temps) && !itemsize_ok(p->pro_temp_e)))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: an A prologue of %u temporaries of %u bytes, %u "
                        "instructions, %u + %u vectors (at most 64, %u, %u each; A not transposed)", p->pro_temps,
                        p->pro_temp_e, p->pro_instrs, p->npro_rows, p->npro_cols, SPY_MM_MAX_PROGRAM,
                        SPY_MM_MAX_VECTORS);
    for (uint32_t i = 0; i < p->npro_rows + p->npro_cols; i++) {
        uint32_t e = i < p->npro_rows ? p->e_pro_rows[i] : p->e_pro_cols[i - p->npro_rows];
        if (!itemsize_ok(e) && e != 8)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: a prologue vector of %u-byte elements", e);
    }
    return SPY_OK;
}

static spy_status check_tiling(const spy_mm_problem *p, const spy_mm_tiling *t, uint32_t i)
{
    if (!t->groups || !t->pk || !t->pm || !t->pn || !t->m_tiles || !t->n_tiles || !t->tk || t->nbuf < 2 ||
        t->nbuf > SPY_MM_MAX_NBUF || t->groups > MAX_CORES || t->pk > MAX_CORES || t->pm > MAX_CORES ||
        t->pn > MAX_CORES || t->m_tiles > (p->m > 1 ? p->m : 1) || t->n_tiles > (p->n > 1 ? p->n : 1) ||
        t->tk >= (1u << 31))
        return spy_fail(SPY_E_INVALID_ARG, i,
                        "matmul tiling %u: groups %u pk %u pm %u pn %u m_tiles %u n_tiles %u tk %u nbuf %u: a count is "
                        "0 or too large (tiles: at most M and N), or nbuf outside 2..%u",
                        i, t->groups, t->pk, t->pm, t->pn, t->m_tiles, t->n_tiles, t->tk, t->nbuf, SPY_MM_MAX_NBUF);
    return SPY_OK;
}

/* ---- the search ---------------------------------------------------------------------------- */

/* The grids worth trying (spyre_rt.construct.matmul.tiling.grids), in order: per split of the cores (pk, then pm,
 * then pn, each ascending), every distinct tile count per core along M (ascending), with
 * every one along N; those whose tiles exist and fit with the smallest chunk; and when the
 * roofline is more than a few launches, those that give every core a tile in every wave (if
 * any do). *out is malloc'ed (NULL when there are none). */
/* The distinct tile counts per core along an extent cut over `parts` cores that tiles
 * aimed at `aims` (ascending) give, ascending: into out, their count returned. */
static size_t tile_counts(int64_t extent, int64_t parts, const uint32_t *aims, size_t naims, int64_t *out)
{
    size_t n = 0;
    for (size_t a = naims; a-- > 0;) { /* counts of decreasing aims: ascending */
        int64_t w = ceil_div(extent, parts * aims[a]);
        w = w > 1 ? w : 1;
        if (!n || out[n - 1] != w)
            out[n++] = w;
    }
    return n;
}

static spy_status make_grids(const spy_mm_cost *c, const spy_mm_problem *p, grid **out, uint32_t *n)
{
    *out = NULL;
    *n = 0;
    uint32_t cores = c->num_cores;
    int64_t k1 = k_or_1(p), gm = gran_m_of(c, p), gn = c->gran_n;
    int64_t tk = SPY_MM_K_GRANULE < k1 ? SPY_MM_K_GRANULE : k1; /* the smallest chunk */
    size_t cap = 0, len = 0;
    grid *g = NULL;
    for (uint32_t pk = 1; pk <= cores; pk++) {
        if (cores % pk || (int64_t)pk > k1)
            continue;
        for (uint32_t pm = 1; pm <= cores / pk; pm++) {
            if ((cores / pk) % pm)
                continue;
            for (uint32_t pn = 1; pn <= cores / (pk * pm); pn++) {
                if ((cores / (pk * pm)) % pn)
                    continue;
                int64_t wm[NM], wn[NN];
                size_t nwm = tile_counts((int64_t)p->m, pm, M_AIMS, NM, wm);
                size_t nwn = tile_counts((int64_t)p->n, pn, N_AIMS, NN, wn);
                for (size_t i = 0; i < nwm; i++)
                    for (size_t j = 0; j < nwn; j++) {
                        int64_t m_tiles = pm * wm[i], n_tiles = pn * wn[j];
                        if (m_tiles > (int64_t)p->m || n_tiles > (int64_t)p->n)
                            continue;
                        int64_t tm = tile_max((int64_t)p->m, m_tiles, gm), tn = tile_max((int64_t)p->n, n_tiles, gn);
                        if (lx_bytes(c, p, tm, tn, tk, pk, 2) > (int64_t)c->scratchpad_bytes)
                            continue;
                        if (len == cap) {
                            size_t want = cap ? 2 * cap : 1024;
                            grid *more = realloc(g, want * sizeof *g);
                            if (!more) {
                                free(g);
                                return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
                            }
                            g = more;
                            cap = want;
                        }
                        g[len++] = (grid){{cores / (pk * pm * pn), pk, pm, pn, (uint32_t)m_tiles, (uint32_t)n_tiles, 0, 0},
                                          tm, tn};
                    }
            }
        }
    }
    if (len && roofline_ns(c, p) >= SPY_MM_BUSY_FROM * c->job_launch_ns) {
        size_t busy = 0;
        for (size_t i = 0; i < len; i++) {
            uint64_t blocks = (uint64_t)(g[i].t.m_tiles / g[i].t.pm) * (g[i].t.n_tiles / g[i].t.pn);
            if (p->batch * blocks % g[i].t.groups == 0)
                g[busy++] = g[i];
        }
        if (busy) /* else every grid stays: none keeps every core busy (and none was moved) */
            len = busy;
    }
    *out = g;
    *n = (uint32_t)len;
    return SPY_OK;
}

/* The K chunks of the fine pass: every chunk below the K extent rounded up to a granule, and
 * that extent. Returns their count. */
static uint32_t chunk_list(const spy_mm_problem *p, int64_t *tks)
{
    int64_t k_max = round_up(k_or_1(p), SPY_MM_K_GRANULE);
    uint32_t n = 0;
    for (size_t i = 0; i < SPY_ARRAY_LEN(K_CHUNKS); i++)
        if (K_CHUNKS[i] < k_max)
            tks[n++] = K_CHUNKS[i];
    tks[n++] = k_max;
    return n;
}

/* A grid's best estimate with the chunks `tks` (three operand buffers where they fit, else
 * two: three never take longer); inf when none fits. */
static double coarse(const spy_mm_cost *c, const spy_mm_problem *p, const grid *g, const spy_mm_terms *row,
                     const int64_t *tks, uint32_t ntks)
{
    double best = INFINITY;
    for (uint32_t i = 0; i < ntks; i++) {
        spy_mm_tiling t = g->t;
        t.tk = (uint32_t)tks[i];
        if (lx_bytes(c, p, g->tm, g->tn, tks[i], t.pk, 3) <= (int64_t)c->scratchpad_bytes)
            t.nbuf = 3;
        else if (lx_bytes(c, p, g->tm, g->tn, tks[i], t.pk, 2) <= (int64_t)c->scratchpad_bytes)
            t.nbuf = 2;
        else
            continue;
        spy_mm_terms o = *row;
        estimate(c, p, &t, &o);
        if (o.ns < best)
            best = o.ns;
    }
    return best;
}

typedef struct ranked {
    double key;
    uint32_t row;
} ranked;

static int by_key_then_row(const void *x, const void *y)
{
    const ranked *a = x, *b = y;
    if (a->key != b->key)
        return a->key < b->key ? -1 : 1;
    return a->row < b->row ? -1 : a->row > b->row;
}

static bool worse(ranked a, ranked b) { return by_key_then_row(&a, &b) > 0; }

/* Restore the min-heap order of h[0..n) below i. */
static void sift_down(ranked *h, uint32_t n, uint32_t i)
{
    ranked x = h[i];
    for (;;) {
        uint32_t l = 2 * i + 1, w = l;
        if (l >= n)
            break;
        if (l + 1 < n && worse(h[l], h[l + 1]))
            w = l + 1;
        if (!worse(x, h[w]))
            break;
        h[i] = h[w];
        i = w;
    }
    h[i] = x;
}

/* A max-heap of the SHORTLIST best (estimate, row) so far: heap[0] the worst of them. */
static void heap_push(ranked *heap, uint32_t *len, ranked x)
{
    uint32_t i;
    if (*len < SPY_MM_SHORTLIST) {
        i = (*len)++;
        while (i && worse(x, heap[(i - 1) / 2])) {
            heap[i] = heap[(i - 1) / 2];
            i = (i - 1) / 2;
        }
        heap[i] = x;
        return;
    }
    if (!worse(heap[0], x))
        return;
    i = 0;
    for (;;) { /* x replaces the worst and sinks */
        uint32_t l = 2 * i + 1, r = l + 1, w = i;
        ranked at = w == i ? x : heap[w];
        if (l < *len && worse(heap[l], at))
            w = l, at = heap[l];
        if (r < *len && worse(heap[r], at))
            w = r;
        if (w == i)
            break;
        heap[i] = heap[w];
        i = w;
    }
    heap[i] = x;
}

/* The grids of the SHORTLIST best coarse estimates, best first (equal ones in row order):
 * into short_rows[], *nshort of them. best[] and floor_ns[] per grid (best NaN where a
 * grid was not estimated). With `prune`, grids are estimated from the lowest floor up,
 * until a floor is above the SHORTLIST-th best estimate so far: no estimate of that grid
 * or of a later one can be below it, so the list is the one estimating every grid makes. */
static spy_status shortlist(const spy_mm_cost *c, const spy_mm_problem *p, const grid *g, uint32_t n, bool prune,
                            double *best, double *floor_ns, uint32_t *short_rows, uint32_t *nshort)
{
    int64_t tks[NK];
    uint32_t nall = chunk_list(p, tks);
    int64_t k_max = tks[nall - 1];
    int64_t coarse_tks[2] = {tks[0], k_max < 256 ? k_max : 256};
    uint32_t ncoarse = coarse_tks[0] == coarse_tks[1] ? 1 : 2;
    ranked *order = malloc((n ? n : 1) * sizeof *order);
    if (!order)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    for (uint32_t i = 0; i < n; i++) {
        spy_mm_terms o;
        blocks_of(c, p, &g[i].t, g[i].tm, g[i].tn, &o);
        floor_ns[i] = o.floor_ns;
        best[i] = NAN;
        order[i] = (ranked){o.floor_ns, i};
    }
    if (prune) /* a min-heap of the floors: grids come out lowest floor first */
        for (uint32_t i = n / 2; i-- > 0;)
            sift_down(order, n, i);
    ranked heap[SPY_MM_SHORTLIST];
    uint32_t len = 0;
    for (uint32_t r = 0, left = n; r < n; r++) {
        ranked next = order[r];
        if (prune) {
            next = order[0];
            order[0] = order[--left];
            sift_down(order, left, 0);
        }
        uint32_t row = next.row;
        if (prune && len == SPY_MM_SHORTLIST && next.key > heap[0].key)
            break;
        spy_mm_terms o;
        blocks_of(c, p, &g[row].t, g[row].tm, g[row].tn, &o);
        best[row] = coarse(c, p, &g[row], &o, coarse_tks, ncoarse);
        heap_push(heap, &len, (ranked){best[row], row});
    }
    free(order);
    qsort(heap, len, sizeof *heap, by_key_then_row);
    for (uint32_t i = 0; i < len; i++)
        short_rows[i] = heap[i].row;
    *nshort = len;
    return SPY_OK;
}

static spy_status search(const spy_mm_cost *c, const spy_mm_problem *p, spy_mm_tiling *out)
{
    grid *g;
    uint32_t n;
    spy_status s = make_grids(c, p, &g, &n);
    if (s != SPY_OK)
        return s;
    double *best = malloc(2 * (n ? n : 1) * sizeof *best);
    if (!best) {
        free(g);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    }
    uint32_t rows[SPY_MM_SHORTLIST], nshort = 0;
    s = shortlist(c, p, g, n, true, best, best + (n ? n : 1), rows, &nshort);
    free(best);
    if (s != SPY_OK) {
        free(g);
        return s;
    }
    /* every shortlisted grid with every chunk and buffer count that fits, in that order */
    int64_t tks[NK];
    uint32_t ntks = chunk_list(p, tks);
    enum { MAXC = SPY_MM_SHORTLIST * NK * 2 };
    static const uint32_t nbufs[2] = {2, 3};
    spy_mm_tiling cand[MAXC];
    double ns[MAXC], nbytes[MAXC], cmds[MAXC];
    uint32_t nc = 0;
    for (uint32_t r = 0; r < nshort; r++) {
        const grid *gr = &g[rows[r]];
        spy_mm_terms row;
        blocks_of(c, p, &gr->t, gr->tm, gr->tn, &row);
        for (uint32_t i = 0; i < ntks; i++)
            for (uint32_t b = 0; b < 2; b++) {
                if (lx_bytes(c, p, gr->tm, gr->tn, tks[i], gr->t.pk, nbufs[b]) > (int64_t)c->scratchpad_bytes)
                    continue;
                spy_mm_tiling t = gr->t;
                t.tk = (uint32_t)tks[i];
                t.nbuf = nbufs[b];
                spy_mm_terms o = row;
                estimate(c, p, &t, &o);
                cand[nc] = t;
                ns[nc] = o.ns;
                nbytes[nc] = o.dram_bytes;
                cmds[nc] = o.cmds;
                nc++;
            }
    }
    free(g);
    if (!nc)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "no matmul tile of %llux%llux%llu fits the scratchpad",
                        (unsigned long long)p->m, (unsigned long long)p->n, (unsigned long long)p->k);
    /* the tie rule: within the model's error (or a job launch) of the cheapest; of those, the
     * ones within the DRAM budget (if any), with the most operand buffers, then the fewest
     * commands (the first of equals) */
    double lo = ns[0];
    for (uint32_t i = 1; i < nc; i++)
        lo = ns[i] < lo ? ns[i] : lo;
    double near = lo + dmax(TIE * lo, c->job_launch_ns), budget = DRAM_BUDGET * (double)min_bytes(p);
    bool lean_any = false;
    for (uint32_t i = 0; i < nc; i++)
        lean_any |= ns[i] <= near && nbytes[i] <= budget;
    uint32_t most = 0;
    for (uint32_t i = 0; i < nc; i++)
        if (ns[i] <= near && (!lean_any || nbytes[i] <= budget) && cand[i].nbuf > most)
            most = cand[i].nbuf;
    int64_t pick = -1;
    for (uint32_t i = 0; i < nc; i++)
        if (ns[i] <= near && (!lean_any || nbytes[i] <= budget) && cand[i].nbuf == most &&
            (pick < 0 || cmds[i] < cmds[pick]))
            pick = i;
    *out = cand[pick];
    return SPY_OK;
}

/* ---- the entry points ------------------------------------------------------------------------ */

spy_status spy_mm_choose(const spy_mm_cost *c, const spy_mm_problem *p, spy_mm_tiling *out)
{
    spy_status s = check_args(c, p);
    if (s != SPY_OK)
        return s;
    if (!out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null output");
    if (p->batch * p->m * p->n == 0) { /* nothing to compute */
        *out = (spy_mm_tiling){c->num_cores, 1, 1, 1, 1, 1, SPY_MM_K_GRANULE, 2};
        return SPY_OK;
    }
    return search(c, p, out);
}

spy_status spy_mm_estimate(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, uint32_t n,
                           spy_mm_terms *out)
{
    spy_status s = check_args(c, p);
    if (s != SPY_OK)
        return s;
    if (n && (!t || !out))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null tilings or terms");
    for (uint32_t i = 0; i < n; i++)
        if ((s = check_tiling(p, &t[i], i)) != SPY_OK)
            return s;
    int64_t gm = gran_m_of(c, p);
    for (uint32_t i = 0; i < n; i++) {
        int64_t tm = tile_max((int64_t)p->m, t[i].m_tiles, gm), tn = tile_max((int64_t)p->n, t[i].n_tiles, c->gran_n);
        blocks_of(c, p, &t[i], tm, tn, &out[i]);
        estimate(c, p, &t[i], &out[i]);
        out[i].lx_bytes = (double)lx_bytes(c, p, tm, tn, t[i].tk, t[i].pk, t[i].nbuf);
    }
    return SPY_OK;
}

spy_status spy_mm_last_depth(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, uint32_t *out)
{
    spy_mm_terms o;
    if (!out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null output");
    spy_status s = spy_mm_estimate(c, p, t, 1, &o);
    if (s == SPY_OK)
        *out = last_depth_of(&o, t->nbuf);
    return s;
}

spy_status spy_mm_grids(const spy_mm_cost *c, const spy_mm_problem *p, spy_mm_tiling *out, uint32_t cap, uint32_t *n)
{
    spy_status s = check_args(c, p);
    if (s != SPY_OK)
        return s;
    if (!n || (cap && !out))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null output");
    grid *g;
    if ((s = make_grids(c, p, &g, n)) != SPY_OK)
        return s;
    for (uint32_t i = 0; i < *n && i < cap; i++)
        out[i] = g[i].t;
    free(g);
    return SPY_OK;
}

spy_status spy_mm_coarse(const spy_mm_cost *c, const spy_mm_problem *p, uint32_t prune, double *best,
                         double *floor_ns, uint32_t *short_rows, uint32_t cap, uint32_t *n, uint32_t *nshort)
{
    spy_status s = check_args(c, p);
    if (s != SPY_OK)
        return s;
    if (!n || !nshort || !best || !floor_ns || !short_rows)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null output");
    grid *g;
    if ((s = make_grids(c, p, &g, n)) != SPY_OK)
        return s;
    if (*n > cap || cap < SPY_MM_SHORTLIST) {
        free(g);
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: %u grids, arrays of %u (at least %u)", *n, cap,
                        SPY_MM_SHORTLIST);
    }
    s = shortlist(c, p, g, *n, prune != 0, best, floor_ns, short_rows, nshort);
    free(g);
    return s;
}

spy_status spy_mm_aims(const uint32_t **m_aims, uint32_t *nm, const uint32_t **n_aims, uint32_t *nn,
                       const uint32_t **k_chunks, uint32_t *nk)
{
    if (!m_aims || !nm || !n_aims || !nn || !k_chunks || !nk)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul tiling: null output");
    *m_aims = M_AIMS;
    *nm = NM;
    *n_aims = N_AIMS;
    *nn = NN;
    *k_chunks = K_CHUNKS;
    *nk = SPY_ARRAY_LEN(K_CHUNKS);
    return SPY_OK;
}
