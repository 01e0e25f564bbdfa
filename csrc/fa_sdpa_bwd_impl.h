/*
 * Backward of the scaled-dot-product attention kernel (fastattn.h,
 * fa_sdpa_bwd_args), instantiated once per precision by fa_sdpa.c right after
 * fa_sdpa_impl.h, with REAL, SFX and GEMM defined; it reuses that header's
 * batch_off, mask_row, key_end and rm_gemm.  Not a public header.
 *
 * With P = exp(S - lse) recomputed per tile (S = scale Q K^T + mask, masked
 * and causally forbidden entries -inf), dP = dO V^T and D = rowsum(dO o O):
 *     dS = P o (dP - D),  dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K.
 * One pass, five tile products (S, dP, dV, dK, dQ), over tasks (batch item,
 * key group): a group is a fixed run of key blocks (a function of the shape
 * and the thread count only), and its task sums dK_j and dV_j of each of its
 * blocks over the query blocks that see it, and adds dS K_j into its own dQ
 * buffer: the dq output for group 0, a scratch partial per further group,
 * summed into dq in group order afterwards.  Every output element is summed
 * by one task in a fixed order, so the result depends on the shapes and the
 * number of groups, never on which thread ran what.  More than one group
 * only when there are fewer batch items than twice the threads (one head
 * still uses every core); the partials cost (groups - 1) x Lq x d a batch item.
 *
 * Accuracy: every gradient is a long sum (over all queries for dK and dV,
 * all keys for dQ).  It is formed from products of at most FA_BWD_SUM_ROWS
 * terms each (a BLAS call summed from zero), added into a double accumulator
 * (dK_j, dV_j: bk rows a task) or onto the dQ rows: float32 rms errors went
 * from 1.0-1.12x torch's to 0.86-0.96x (one sequential float32 sum over 512
 * queries was the largest term).
 */
#ifndef FA_BWD_SUM_ROWS
#define FA_BWD_SUM_ROWS 64
#endif
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* dst (rows x cols, row stride ld) = (REAL) acc (row stride cols) */
static inline void FN(bwd_store)(const fa_rowops *ops, REAL *dst, int64_t ld, const double *acc,
                                 int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++)
        FN(ops_bwd_store)(ops, dst + r * ld, acc + r * cols, cols);
}

/* acc (M x N) += alpha * op(A)(M x K) . B (K x N, row stride ldb) with the
 * reduction over K cut into products of at most FA_BWD_SUM_ROWS terms, each
 * computed into T (M x N) from zero.  transA: A is stored K x M (row stride
 * lda), else M x K.  mcap: the chunk of terms [k0, k0+kc) contributes to the
 * first mcap + k0 + kc rows only (causality: key row c is seen by query rows
 * i >= c - mcap); the other rows' terms are zero and are skipped. */
static void FN(bwd_gemm_acc)(const fa_rowops *ops, int transA, int64_t M, int64_t N, int64_t K,
                             REAL alpha, const REAL *A, int64_t lda, const REAL *B, int64_t ldb,
                             REAL *T, double *acc, int64_t mcap)
{
    for (int64_t k0 = 0; k0 < K; k0 += FA_BWD_SUM_ROWS) {
        int64_t kc = K - k0 < FA_BWD_SUM_ROWS ? K - k0 : FA_BWD_SUM_ROWS;
        int64_t me = mcap + k0 + kc;
        me = me < 0 ? 0 : me > M ? M : me;
        if (me == 0)
            continue;
        const REAL *Ac = transA ? A + k0 * lda : A + k0;
        if (transA && FN(ops_has_tn)(ops)) {   /* straight into acc, no BLAS call */
            FN(ops_gemm_tn_acc)(ops, me, N, kc, alpha, Ac, lda, B + k0 * ldb, ldb, acc, N);
            continue;
        }
        FN(rm_gemm)(transA ? 'T' : 'N', 'N', me, N, kc, alpha, Ac, lda, B + k0 * ldb, ldb,
                    (REAL)0, T, N);
        FN(ops_bwd_acc)(ops, acc, T, me * N);
    }
}

/* Allowed columns of query row i (global) in a key tile from j0 of n keys. */
static inline int64_t FN(bwd_allowed)(const fa_sdpa_args *f, int64_t i, int64_t j0, int64_t n)
{
    if (!f->causal)
        return n;
    int64_t c = i + f->causal_offset - j0 + 1;
    return c < 0 ? 0 : c > n ? n : c;
}

/* P = exp(S - lse) for the m x n tile S (row stride n) of query rows
 * [i0, i0+m), keys [j0, j0+n); causally forbidden entries (which S need not
 * hold: our products skip them) and rows with lse = -inf (no allowed key)
 * become exact zeros.  Lse points at row i0. */
static void FN(bwd_probs)(const fa_sdpa_args *f, const fa_rowops *ops, const unsigned char *mb,
                          const REAL *bb, const REAL *Lse, REAL *S, int64_t i0, int64_t m,
                          int64_t j0, int64_t n)
{
    for (int64_t r = 0; r < m; r++) {
        REAL *s = S + r * n;
        REAL L = Lse[r];
        int64_t na = FN(bwd_allowed)(f, i0 + r, j0, n);
        if (L == (REAL)(-INFINITY))
            na = 0;
        if (na > 0) {
            FN(mask_row)(f, ops, mb, bb, s, i0 + r, j0, na);
            if (mb || bb)
                (void)FN(ops_expsub_masked)(ops, s, na, L);
            else
                (void)FN(ops_expsub)(ops, s, na, L);
        }
        if (na < n)
            memset(s + na, 0, (size_t)(n - na) * sizeof(REAL));
    }
}

/* dS = P o (dP - D) in place of dP (m x n, row stride n); causally forbidden
 * entries (dP need not hold them) and rows with lse = -inf exact zeros. */
static void FN(bwd_dscores)(const fa_sdpa_args *f, const fa_rowops *ops, const REAL *P,
                            REAL *dP, const double *D, const REAL *Lse, int64_t i0, int64_t m,
                            int64_t j0, int64_t n)
{
    for (int64_t r = 0; r < m; r++) {
        REAL *g = dP + r * n;
        int64_t na = Lse[r] == (REAL)(-INFINITY) ? 0 : FN(bwd_allowed)(f, i0 + r, j0, n);
        /* D in double: dP - D often cancels, and D rounded to REAL was the
         * largest error of dS there */
        if (na > 0)
            FN(ops_bwd_ds)(ops, P + r * n, g, D[r], na);
        if (na < n)
            memset(g + na, 0, (size_t)(n - na) * sizeof(REAL));
    }
}

/* Causal limits of our products (csrc/fa_rowops.h's lim) for the tile of
 * query rows [i0, i0+m) and keys [j0, j0+n): row block r (FA_PACK_ROWS rows)
 * uses the keys its last row may see. */
static void FN(bwd_lims)(const fa_sdpa_args *f, int64_t i0, int64_t m, int64_t j0, int64_t n,
                         int64_t *Lim)
{
    for (int64_t r0 = 0; r0 < m; r0 += FA_PACK_ROWS) {
        int64_t last = r0 + FA_PACK_ROWS - 1 < m - 1 ? r0 + FA_PACK_ROWS - 1 : m - 1;
        Lim[r0 / FA_PACK_ROWS] = FN(bwd_allowed)(f, i0 + last, j0, n);
    }
}

typedef struct {
    const fa_sdpa_bwd_args *a;
    const fa_rowops *ops;
    int64_t nbatch;          /* batch items of the broadcast batch */
    int64_t nqb, nkb;
    int64_t ngroups;
    const int64_t *gstart;   /* key blocks [gstart[g], gstart[g+1]) form group g */
    size_t need;
    size_t acc_off;          /* bytes from the scratch start to the double accumulators */
    size_t lim_off;          /* ... to the causal limits (2 x row blocks of int64) */
    int status;
    fa_stop_poll poll;
} FN(bjob);

static inline const unsigned char *FN(bwd_bmask)(const fa_sdpa_args *f, int64_t b)
{
    return f->mask_kind == FA_MASK_BOOL
               ? (const unsigned char *)f->mask + FN(batch_off)(f, f->m_bs, b) : NULL;
}

static inline const REAL *FN(bwd_amask)(const fa_sdpa_args *f, int64_t b)
{
    return f->mask_kind == FA_MASK_ADD ? (const REAL *)f->mask + FN(batch_off)(f, f->m_bs, b)
                                       : NULL;
}

/* The dQ buffer of group g of batch item b: dq itself for g = 0, else a
 * C-contiguous (Lq x d) partial in a->dq_part. */
static inline REAL *FN(bwd_dq_buf)(const fa_sdpa_bwd_args *a, const FN(bjob) *j, int64_t b,
                                   int64_t g, int64_t *ld)
{
    const fa_sdpa_args *f = &a->f;
    if (g == 0) {
        *ld = a->lddq;
        return (REAL *)a->dq + FN(batch_off)(f, a->dq_bs, b);
    }
    *ld = f->d;
    return (REAL *)a->dq_part + ((g - 1) * j->nbatch + b) * f->Lq * f->d;
}

/* Task t of a run over (batch item b, query block from row i0, m rows). */
static inline void FN(bwd_rows)(const FN(bjob) *j, int64_t t, int64_t *b, int64_t *i0,
                                int64_t *m)
{
    const fa_sdpa_args *f = &j->a->f;
    *b = t / j->nqb;
    *i0 = (t % j->nqb) * f->block_q;
    *m = f->Lq - *i0 < f->block_q ? f->Lq - *i0 : f->block_q;
}

/* Pass 0: D[b, i] = sum_c dO[i, c] O[i, c] (summed in double); dQ buffers zeroed. */
static void FN(bwd_delta_task)(void *ctx, int64_t t, int slot)
{
    (void)slot;
    FN(bjob) *j = (FN(bjob) *)ctx;
    const fa_sdpa_bwd_args *a = j->a;
    const fa_sdpa_args *f = &a->f;
    int64_t b, i0, m;
    FN(bwd_rows)(j, t, &b, &i0, &m);
    const REAL *G = (const REAL *)a->grad_out + FN(batch_off)(f, a->g_bs, b) + i0 * a->ldg;
    const REAL *O = (const REAL *)f->out + FN(batch_off)(f, f->o_bs, b) + i0 * f->ldo;
    double *D = (double *)a->delta + b * f->Lq + i0;
    for (int64_t r = 0; r < m; r++)
        D[r] = FN(ops_dot64)(j->ops, G + r * a->ldg, O + r * f->ldo, f->dv);
    for (int64_t g = 0; g < j->ngroups; g++) {
        int64_t ld;
        REAL *dQ = FN(bwd_dq_buf)(a, j, b, g, &ld) + i0 * ld;
        for (int64_t r = 0; r < m; r++)
            memset(dQ + r * ld, 0, (size_t)f->d * sizeof(REAL));
    }
}

static void FN(bwd_reduce_task)(void *ctx, int64_t t, int slot);

/* Pass 1: the key blocks of group g of batch item b (with one group a batch
 * item, also its passes 0 and 2: one pool run instead of three). */
static void FN(bwd_group_task)(void *ctx, int64_t t, int slot)
{
    FN(bjob) *j = (FN(bjob) *)ctx;
    const fa_sdpa_bwd_args *a = j->a;
    const fa_sdpa_args *f = &a->f;
    if (fa_stop_poll_stopped(&j->poll))
        return;
    REAL *S = (REAL *)fa_arena(j->need);
    if (!S) {
        __atomic_store_n(&j->status, FA_ENOMEM, __ATOMIC_RELAXED);
        return;
    }
    const int64_t bq = f->block_q, bk = f->block_k;
    REAL *dP = S + bq * bk;
    REAL *T = dP + bq * bk;
    /* key block j packed for the products (csrc/fa_rowops.h): scale K_j^T and
     * V_j^T as the forward packs them (so S has the forward's bits and P its
     * weights), K_j row panels for dQ in chunks of FA_BWD_SUM_ROWS keys */
    REAL *kp = T + (bq > bk ? bq : bk) * (f->d > f->dv ? f->d : f->dv);
    REAL *vp = kp + FA_PACK_ROUND(bk) * f->d;
    REAL *kr = vp + FA_PACK_ROUND(bk) * f->dv;
    double *accK = (double *)((char *)S + j->acc_off);
    /* causal limits of our products: for S and dP, and per dQ chunk */
    int64_t *Lim = (int64_t *)((char *)S + j->lim_off);
    int64_t *LimC = Lim + (bq + FA_PACK_ROWS - 1) / FA_PACK_ROWS;
    const int64_t b = t / j->ngroups, g = t % j->ngroups;
    /* the forward's products: our packed ones (f->direct) or BLAS, so that S
     * has the bits the forward's lse was computed from */
    const int own = f->direct;
    const REAL scale = (REAL)f->scale;
    const REAL *Q = (const REAL *)f->q + FN(batch_off)(f, f->q_bs, b);
    const REAL *K = (const REAL *)f->k + FN(batch_off)(f, f->k_bs, b);
    const REAL *V = (const REAL *)f->v + FN(batch_off)(f, f->v_bs, b);
    const REAL *G = (const REAL *)a->grad_out + FN(batch_off)(f, a->g_bs, b);
    const REAL *Lse = (const REAL *)f->lse + FN(batch_off)(f, f->l_bs, b);
    const double *D = (const double *)a->delta + b * f->Lq;
    int64_t lddq;
    REAL *dQ = FN(bwd_dq_buf)(a, j, b, g, &lddq);
    REAL *dM = a->dmask ? (REAL *)a->dmask + FN(batch_off)(f, a->dm_bs, b) : NULL;
    const unsigned char *mb = FN(bwd_bmask)(f, b);
    const REAL *bb = FN(bwd_amask)(f, b);
    if (j->ngroups == 1)   /* this task is the batch item's only one: pass 0 here */
        for (int64_t qb = 0; qb < j->nqb; qb++)
            FN(bwd_delta_task)(ctx, b * j->nqb + qb, slot);
    for (int64_t jb = j->gstart[g]; jb < j->gstart[g + 1]; jb++) {
        const int64_t j0 = jb * bk;
        const int64_t n = f->Lk - j0 < bk ? f->Lk - j0 : bk;
        const REAL *Kj = K + j0 * f->ldk;
        const REAL *Vj = V + j0 * f->ldv;
        REAL *dKj = (REAL *)a->dk + FN(batch_off)(f, a->dk_bs, b) + j0 * a->lddk;
        REAL *dVj = (REAL *)a->dv + FN(batch_off)(f, a->dv_bs, b) + j0 * a->lddv;
        double *accV = accK + n * f->d;
        memset(accK, 0, (size_t)(n * (f->d + f->dv)) * sizeof(double));
        if (own) {
            FN(ops_pack_kt)(j->ops, n, f->d, scale, Kj, f->ldk, kp);
            FN(ops_pack_kt)(j->ops, n, f->dv, (REAL)1, Vj, f->ldv, vp);
            for (int64_t c0 = 0; c0 < n; c0 += FA_BWD_SUM_ROWS) {
                int64_t nc = n - c0 < FA_BWD_SUM_ROWS ? n - c0 : FA_BWD_SUM_ROWS;
                FN(ops_pack_v)(j->ops, nc, f->d, Kj + c0 * f->ldk, f->ldk,
                               kr + c0 * FA_PACK_ROUND(f->d));
            }
        }
        /* the first query row that may see key j0: i + offset >= j0 */
        int64_t ifirst = 0;
        if (f->causal) {
            ifirst = j0 - f->causal_offset;
            ifirst = ifirst < 0 ? 0 : ifirst > f->Lq ? f->Lq : ifirst;
            ifirst = ifirst / bq * bq;
        }
        if (dM)   /* rows above the causal diagonal of this key block */
            for (int64_t r = 0; r < ifirst; r++)
                memset(dM + r * a->lddm + j0, 0, (size_t)n * sizeof(REAL));
        for (int64_t i0 = ifirst; i0 < f->Lq; i0 += bq) {
            if (fa_stop_poll_check(&j->poll, slot))
                return;
            const int64_t m = f->Lq - i0 < bq ? f->Lq - i0 : bq;
            if (mb && fa_tile_masked_out(mb, f->ldm, i0, m, j0, n))
                continue;
            const REAL *Qi = Q + i0 * f->ldq;
            const REAL *Gi = G + i0 * a->ldg;
            /* causal: a tile crossing the diagonal computes, per block of
             * FA_PACK_ROWS query rows, only the keys those rows may see (our
             * products; BLAS computes the whole tile), and the transposed
             * products skip the key rows no query of a chunk sees */
            const int diag = f->causal && i0 + f->causal_offset - j0 < n - 1;
            const int64_t *lim = NULL;
            if (own && diag) {
                FN(bwd_lims)(f, i0, m, j0, n, Lim);
                lim = Lim;
            }
            const int64_t mcap = f->causal ? i0 + f->causal_offset - j0 : n;
            if (own)
                FN(ops_gemm_pb)(j->ops, m, n, f->d, Qi, f->ldq, kp, S, n, 0, lim, 0);
            else
                FN(rm_gemm)('N', 'T', m, n, f->d, scale, Qi, f->ldq, Kj, f->ldk, (REAL)0, S, n);
            FN(bwd_probs)(f, j->ops, mb, bb, Lse + i0, S, i0, m, j0, n);
            /* dV_j += P^T dO_i */
            FN(bwd_gemm_acc)(j->ops, 1, n, f->dv, m, (REAL)1, S, n, Gi, a->ldg, T, accV, mcap);
            /* dP = dO_i V_j^T, then dS in its place */
            if (own)
                FN(ops_gemm_pb)(j->ops, m, n, f->dv, Gi, a->ldg, vp, dP, n, 0, lim, 0);
            else
                FN(rm_gemm)('N', 'T', m, n, f->dv, (REAL)1, Gi, a->ldg, Vj, f->ldv, (REAL)0, dP, n);
            FN(bwd_dscores)(f, j->ops, S, dP, D + i0, Lse + i0, i0, m, j0, n);
            if (dM)
                for (int64_t r = 0; r < m; r++)
                    memcpy(dM + (i0 + r) * a->lddm + j0, dP + r * n, (size_t)n * sizeof(REAL));
            /* dK_j += scale dS^T Q_i */
            FN(bwd_gemm_acc)(j->ops, 1, n, f->d, m, scale, dP, n, Qi, f->ldq, T, accK, mcap);
            /* dQ_i += scale dS K_j, in products of at most FA_BWD_SUM_ROWS keys */
            if (own)
                FN(ops_scale)(j->ops, dP, m * n, scale);   /* dS * scale for dQ (BLAS: alpha) */
            for (int64_t c0 = 0; c0 < n; c0 += FA_BWD_SUM_ROWS) {
                int64_t nc = n - c0 < FA_BWD_SUM_ROWS ? n - c0 : FA_BWD_SUM_ROWS;
                if (own) {
                    const int64_t *limc = NULL;
                    if (lim) {   /* each row block's terms in this chunk of keys */
                        int64_t any = 0;
                        for (int64_t rb = 0; rb < (m + FA_PACK_ROWS - 1) / FA_PACK_ROWS; rb++) {
                            int64_t t = lim[rb] - c0;
                            LimC[rb] = t < 0 ? 0 : t > nc ? nc : t;
                            any |= LimC[rb];
                        }
                        if (!any)
                            break;   /* later chunks: further right still */
                        limc = LimC;
                    }
                    FN(ops_gemm_pb)(j->ops, m, f->d, nc, dP + c0, n,
                                    kr + c0 * FA_PACK_ROUND(f->d), dQ + i0 * lddq, lddq, 1, limc, 1);
                } else {
                    FN(rm_gemm)('N', 'N', m, f->d, nc, scale, dP + c0, n, Kj + c0 * f->ldk,
                                f->ldk, (REAL)1, dQ + i0 * lddq, lddq);
                }
            }
        }
        FN(bwd_store)(j->ops, dKj, a->lddk, accK, n, f->d);
        FN(bwd_store)(j->ops, dVj, a->lddv, accV, n, f->dv);
    }
    if (j->ngroups == 1)   /* and pass 2 (no partials: only the rows without a key) */
        for (int64_t qb = 0; qb < j->nqb; qb++)
            FN(bwd_reduce_task)(ctx, b * j->nqb + qb, slot);
}

/* Pass 2: dq rows of query block qb of batch item b += the partials, in group
 * order; rows with no allowed key set to exact zeros (their dS is 0, but a
 * NaN or inf in a masked-out key would still reach them through 0 * NaN). */
static void FN(bwd_reduce_task)(void *ctx, int64_t t, int slot)
{
    (void)slot;
    FN(bjob) *j = (FN(bjob) *)ctx;
    const fa_sdpa_bwd_args *a = j->a;
    const fa_sdpa_args *f = &a->f;
    int64_t b, i0, m;
    FN(bwd_rows)(j, t, &b, &i0, &m);
    int64_t ld0, ldg;
    REAL *dq = FN(bwd_dq_buf)(a, j, b, 0, &ld0) + i0 * ld0;
    for (int64_t g = 1; g < j->ngroups; g++) {
        const REAL *part = FN(bwd_dq_buf)(a, j, b, g, &ldg) + i0 * ldg;
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < f->d; c++)
                dq[r * ld0 + c] += part[r * ldg + c];
    }
    const REAL *Lse = (const REAL *)f->lse + FN(batch_off)(f, f->l_bs, b) + i0;
    for (int64_t r = 0; r < m; r++)
        if (Lse[r] == (REAL)(-INFINITY))
            memset(dq + r * ld0, 0, (size_t)f->d * sizeof(REAL));
}

/* Split the nkb key blocks into ngroups runs of about equal work (query rows
 * that see each block: fewer for late blocks under causality). */
static void FN(bwd_groups)(const fa_sdpa_args *f, int64_t nkb, int64_t ngroups, int64_t *gstart)
{
    fa_bwd_key_groups(f->causal, f->causal_offset, f->block_k, f->Lq, nkb, ngroups, gstart);
}

int FN(fa_sdpa_bwd)(const fa_sdpa_bwd_args *a)
{
    const fa_sdpa_args *f = &a->f;
    if (!GEMM || f->block_q < 1 || f->block_k < 1 || f->n_threads < 1 || !f->lse || !a->delta
        || f->d < 1 || f->dv < 1 || a->ngroups < 1 || a->ngroups > FA_BWD_MAX_GROUPS
        || (a->ngroups > 1 && !a->dq_part))
        return FA_EINVAL;
    if (!(fa_blas_fits(f->block_q) && fa_blas_fits(f->block_k) && fa_blas_fits(f->d)
          && fa_blas_fits(f->dv) && fa_blas_fits(f->ldq) && fa_blas_fits(f->ldk)
          && fa_blas_fits(f->ldv) && fa_blas_fits(a->ldg) && fa_blas_fits(a->lddq)
          && fa_blas_fits(a->lddk) && fa_blas_fits(a->lddv)))
        return FA_EINVAL;   /* BLAS takes 32-bit ints: never truncate a size */
    int64_t nbatch = 1;
    for (int i = 0; i < f->nbatch; i++)
        nbatch *= f->batch_shape[i];
    int64_t gstart[FA_BWD_MAX_GROUPS + 1];
    FN(bjob) j;
    j.a = a;
    j.ops = fa_get_rowops();
    j.nbatch = nbatch;
    j.nqb = (f->Lq + f->block_q - 1) / f->block_q;
    j.nkb = (f->Lk + f->block_k - 1) / f->block_k;
    j.ngroups = a->ngroups;
    j.gstart = gstart;
    {
        int64_t bq = f->block_q, bk = f->block_k, mx = bq > bk ? bq : bk;
        int64_t w = f->d > f->dv ? f->d : f->dv;
        size_t reals = (size_t)(2 * bq * bk + mx * w + FA_PACK_ROUND(bk) * (f->d + f->dv)
                                + FA_PACK_ROUND(f->d) * bk) * sizeof(REAL);
        j.acc_off = (reals + 63) / 64 * 64;
        j.lim_off = j.acc_off + (size_t)(bk * (f->d + f->dv)) * sizeof(double);
        j.need = j.lim_off + 2 * (size_t)((bq + FA_PACK_ROWS - 1) / FA_PACK_ROWS) * sizeof(int64_t);
    }
    j.status = FA_OK;
    fa_stop_poll_init(&j.poll, f->stop, f->stop_ctx);
    if (nbatch == 0 || f->Lq == 0)
        return FA_OK;
    FN(bwd_groups)(f, j.nkb, j.ngroups, gstart);
    fa_stop_fn stop = f->stop ? fa_stop_poll_fn : NULL;
    int nt = f->n_threads;
    fa_blas_set_threads_fn hook = fa_blas_threads_enter();
    int stopped = 0;
    const int fused = j.ngroups == 1 && f->Lk > 0;   /* passes 0 and 2 inside pass 1 */
    if (!fused)
        stopped = fa_pool_run(nbatch * j.nqb, nt, FN(bwd_delta_task), &j, stop, &j.poll);
    if (!stopped && f->Lk > 0)
        stopped = fa_pool_run(nbatch * j.ngroups, nt, FN(bwd_group_task), &j, stop, &j.poll);
    if (!stopped && j.status == FA_OK && !fused)
        stopped = fa_pool_run(nbatch * j.nqb, nt, FN(bwd_reduce_task), &j, stop, &j.poll);
    fa_blas_threads_exit(hook);
    if (stopped || fa_stop_poll_stopped(&j.poll))
        return FA_EINTR;
    return j.status;
}

#undef FN
#undef CAT
#undef CAT_
