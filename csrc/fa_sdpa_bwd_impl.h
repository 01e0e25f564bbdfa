/*
 * Backward of the scaled-dot-product attention kernel (fastattn.h,
 * fa_sdpa_bwd_args), instantiated once per precision by fa_sdpa.c right after
 * fa_sdpa_impl.h, with REAL, SFX and GEMM defined; it reuses that header's
 * batch_off, mask_row, key_end and rm_gemm.  Not a public header.
 *
 * With P = exp(S - lse) recomputed per tile (S = scale Q K^T + mask, masked
 * and causally forbidden entries -inf), dP = dO V^T and D = rowsum(dO o O):
 *     dS = P o (dP - D),  dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K.
 * Pass 1 (tasks: batch item x key block) sums dK_j and dV_j over the query
 * blocks that see key block j; pass 2 (batch item x query block) sums dQ_i
 * over its key tiles.  Each output element belongs to one task, which adds
 * its terms in a fixed order (deterministic for any thread count); the price
 * is recomputing S and dP in pass 2 (7 tile products instead of 5).
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* P = exp(S - lse) for the m x n tile S (row stride n) of query rows
 * [i0, i0+m), keys [j0, j0+n); rows with lse = -inf (no allowed key) become
 * exact zeros.  Lse points at row i0. */
static void FN(bwd_probs)(const fa_sdpa_args *f, const fa_rowops *ops, const unsigned char *mb,
                          const REAL *bb, const REAL *Lse, REAL *S, int64_t i0, int64_t m,
                          int64_t j0, int64_t n)
{
    for (int64_t r = 0; r < m; r++) {
        REAL *s = S + r * n;
        REAL L = Lse[r];
        if (L == (REAL)(-INFINITY)) {
            memset(s, 0, (size_t)n * sizeof(REAL));
            continue;
        }
        FN(mask_row)(f, ops, mb, bb, s, i0 + r, j0, n);
        for (int64_t c = 0; c < n; c++)
            s[c] -= L;
        ops->CAT(exp, SFX)(s, s, n);
    }
}

/* dS = P o (dP - D) in place of dP (m x n, row stride n); rows with lse = -inf
 * exact zeros (whatever dP holds). */
static void FN(bwd_dscores)(const REAL *P, REAL *dP, const REAL *D, const REAL *Lse, int64_t m,
                            int64_t n)
{
    for (int64_t r = 0; r < m; r++) {
        REAL *g = dP + r * n;
        const REAL *p = P + r * n;
        if (Lse[r] == (REAL)(-INFINITY)) {
            memset(g, 0, (size_t)n * sizeof(REAL));
            continue;
        }
        const REAL dr = D[r];
        for (int64_t c = 0; c < n; c++)
            g[c] = p[c] * (g[c] - dr);
    }
}

typedef struct {
    const fa_sdpa_bwd_args *a;
    const fa_rowops *ops;
    int64_t nqb, nkb;
    size_t need;
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

/* Pass 0: D[b, i] = sum_c dO[i, c] O[i, c], summed in double. */
static void FN(bwd_delta_task)(void *ctx, int64_t t, int slot)
{
    (void)slot;
    FN(bjob) *j = (FN(bjob) *)ctx;
    const fa_sdpa_bwd_args *a = j->a;
    const fa_sdpa_args *f = &a->f;
    int64_t b = t / j->nqb, i0 = (t % j->nqb) * f->block_q;
    int64_t m = f->Lq - i0 < f->block_q ? f->Lq - i0 : f->block_q;
    const REAL *G = (const REAL *)a->grad_out + FN(batch_off)(f, a->g_bs, b) + i0 * a->ldg;
    const REAL *O = (const REAL *)f->out + FN(batch_off)(f, f->o_bs, b) + i0 * f->ldo;
    REAL *D = (REAL *)a->delta + b * f->Lq + i0;
    for (int64_t r = 0; r < m; r++) {
        double s = 0;
        for (int64_t c = 0; c < f->dv; c++)
            s += (double)G[r * a->ldg + c] * (double)O[r * f->ldo + c];
        D[r] = (REAL)s;
    }
}

/* Pass 1: dK and dV of key block kb of batch item b. */
static void FN(bwd_kv_task)(void *ctx, int64_t t, int slot)
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
    int64_t b = t / j->nkb, j0 = (t % j->nkb) * bk;
    int64_t n = f->Lk - j0 < bk ? f->Lk - j0 : bk;
    const REAL scale = (REAL)f->scale;
    const REAL *Q = (const REAL *)f->q + FN(batch_off)(f, f->q_bs, b);
    const REAL *Kj = (const REAL *)f->k + FN(batch_off)(f, f->k_bs, b) + j0 * f->ldk;
    const REAL *Vj = (const REAL *)f->v + FN(batch_off)(f, f->v_bs, b) + j0 * f->ldv;
    const REAL *G = (const REAL *)a->grad_out + FN(batch_off)(f, a->g_bs, b);
    const REAL *Lse = (const REAL *)f->lse + FN(batch_off)(f, f->l_bs, b);
    const REAL *D = (const REAL *)a->delta + b * f->Lq;
    REAL *dKj = (REAL *)a->dk + FN(batch_off)(f, a->dk_bs, b) + j0 * a->lddk;
    REAL *dVj = (REAL *)a->dv + FN(batch_off)(f, a->dv_bs, b) + j0 * a->lddv;
    REAL *dM = a->dmask ? (REAL *)a->dmask + FN(batch_off)(f, a->dm_bs, b) : NULL;
    const unsigned char *mb = FN(bwd_bmask)(f, b);
    const REAL *bb = FN(bwd_amask)(f, b);
    for (int64_t r = 0; r < n; r++) {
        memset(dKj + r * a->lddk, 0, (size_t)f->d * sizeof(REAL));
        memset(dVj + r * a->lddv, 0, (size_t)f->dv * sizeof(REAL));
    }
    int started = 0;
    /* the first query row that may see key j0: i + offset >= j0 */
    int64_t ifirst = 0;
    if (f->causal) {
        ifirst = j0 - f->causal_offset;
        if (ifirst < 0)
            ifirst = 0;
        ifirst = ifirst / bq * bq;
    }
    for (int64_t i0 = ifirst; i0 < f->Lq; i0 += bq) {
        if (fa_stop_poll_check(&j->poll, slot))
            return;
        int64_t m = f->Lq - i0 < bq ? f->Lq - i0 : bq;
        if (mb && fa_tile_masked_out(mb, f->ldm, i0, m, j0, n)) {
            if (dM)
                for (int64_t r = 0; r < m; r++)
                    memset(dM + (i0 + r) * a->lddm + j0, 0, (size_t)n * sizeof(REAL));
            continue;
        }
        const REAL *Qi = Q + i0 * f->ldq;
        const REAL *Gi = G + i0 * a->ldg;
        FN(rm_gemm)('N', 'T', m, n, f->d, scale, Qi, f->ldq, Kj, f->ldk, (REAL)0, S, n);
        FN(bwd_probs)(f, j->ops, mb, bb, Lse + i0, S, i0, m, j0, n);
        /* dV_j += P^T dO_i */
        FN(rm_gemm)('T', 'N', n, f->dv, m, (REAL)1, S, n, Gi, a->ldg, started ? (REAL)1 : (REAL)0,
                    dVj, a->lddv);
        /* dP = dO_i V_j^T, then dS */
        FN(rm_gemm)('N', 'T', m, n, f->dv, (REAL)1, Gi, a->ldg, Vj, f->ldv, (REAL)0, dP, n);
        FN(bwd_dscores)(S, dP, D + i0, Lse + i0, m, n);
        if (dM)
            for (int64_t r = 0; r < m; r++)
                memcpy(dM + (i0 + r) * a->lddm + j0, dP + r * n, (size_t)n * sizeof(REAL));
        /* dK_j += scale dS^T Q_i */
        FN(rm_gemm)('T', 'N', n, f->d, m, scale, dP, n, Qi, f->ldq, started ? (REAL)1 : (REAL)0,
                    dKj, a->lddk);
        started = 1;
    }
    if (dM && ifirst > 0)   /* rows above the causal diagonal of this key block */
        for (int64_t r = 0; r < ifirst; r++)
            memset(dM + r * a->lddm + j0, 0, (size_t)n * sizeof(REAL));
}

/* Pass 2: dQ of query block qb of batch item b. */
static void FN(bwd_q_task)(void *ctx, int64_t t, int slot)
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
    int64_t b = t / j->nqb, i0 = (t % j->nqb) * bq;
    int64_t m = f->Lq - i0 < bq ? f->Lq - i0 : bq;
    const REAL scale = (REAL)f->scale;
    const REAL *Qi = (const REAL *)f->q + FN(batch_off)(f, f->q_bs, b) + i0 * f->ldq;
    const REAL *K = (const REAL *)f->k + FN(batch_off)(f, f->k_bs, b);
    const REAL *V = (const REAL *)f->v + FN(batch_off)(f, f->v_bs, b);
    const REAL *Gi = (const REAL *)a->grad_out + FN(batch_off)(f, a->g_bs, b) + i0 * a->ldg;
    const REAL *Lse = (const REAL *)f->lse + FN(batch_off)(f, f->l_bs, b) + i0;
    const REAL *D = (const REAL *)a->delta + b * f->Lq + i0;
    REAL *dQi = (REAL *)a->dq + FN(batch_off)(f, a->dq_bs, b) + i0 * a->lddq;
    const unsigned char *mb = FN(bwd_bmask)(f, b);
    const REAL *bb = FN(bwd_amask)(f, b);
    for (int64_t r = 0; r < m; r++)
        memset(dQi + r * a->lddq, 0, (size_t)f->d * sizeof(REAL));
    const int64_t kend = FN(key_end)(f, i0, m);
    int started = 0;
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        if (fa_stop_poll_check(&j->poll, slot))
            return;
        int64_t n = kend - j0 < bk ? kend - j0 : bk;
        if (mb && fa_tile_masked_out(mb, f->ldm, i0, m, j0, n))
            continue;
        FN(rm_gemm)('N', 'T', m, n, f->d, scale, Qi, f->ldq, K + j0 * f->ldk, f->ldk, (REAL)0, S, n);
        FN(bwd_probs)(f, j->ops, mb, bb, Lse, S, i0, m, j0, n);
        FN(rm_gemm)('N', 'T', m, n, f->dv, (REAL)1, Gi, a->ldg, V + j0 * f->ldv, f->ldv, (REAL)0,
                    dP, n);
        FN(bwd_dscores)(S, dP, D, Lse, m, n);
        /* dQ_i += scale dS K_j */
        FN(rm_gemm)('N', 'N', m, f->d, n, scale, dP, n, K + j0 * f->ldk, f->ldk,
                    started ? (REAL)1 : (REAL)0, dQi, a->lddq);
        started = 1;
    }
}

int FN(fa_sdpa_bwd)(const fa_sdpa_bwd_args *a)
{
    const fa_sdpa_args *f = &a->f;
    if (!GEMM || f->block_q < 1 || f->block_k < 1 || f->n_threads < 1 || !f->lse || !a->delta
        || f->d < 1 || f->dv < 1)
        return FA_EINVAL;
    if (!(fa_blas_fits(f->block_q) && fa_blas_fits(f->block_k) && fa_blas_fits(f->d)
          && fa_blas_fits(f->dv) && fa_blas_fits(f->ldq) && fa_blas_fits(f->ldk)
          && fa_blas_fits(f->ldv) && fa_blas_fits(a->ldg) && fa_blas_fits(a->lddq)
          && fa_blas_fits(a->lddk) && fa_blas_fits(a->lddv)))
        return FA_EINVAL;   /* BLAS takes 32-bit ints: never truncate a size */
    int64_t nbatch = 1;
    for (int i = 0; i < f->nbatch; i++)
        nbatch *= f->batch_shape[i];
    FN(bjob) j;
    j.a = a;
    j.ops = fa_get_rowops();
    j.nqb = (f->Lq + f->block_q - 1) / f->block_q;
    j.nkb = (f->Lk + f->block_k - 1) / f->block_k;
    j.need = (size_t)(2 * f->block_q * f->block_k) * sizeof(REAL);
    j.status = FA_OK;
    fa_stop_poll_init(&j.poll, f->stop, f->stop_ctx);
    if (nbatch == 0 || f->Lq == 0)
        return FA_OK;
    fa_stop_fn stop = f->stop ? fa_stop_poll_fn : NULL;
    int nt = f->n_threads;
    fa_blas_set_threads_fn hook = fa_blas_threads_enter();
    int stopped = fa_pool_run(nbatch * j.nqb, nt, FN(bwd_delta_task), &j, stop, &j.poll);
    if (!stopped && f->Lk > 0)
        stopped = fa_pool_run(nbatch * j.nkb, nt, FN(bwd_kv_task), &j, stop, &j.poll);
    if (!stopped && j.status == FA_OK)
        stopped = fa_pool_run(nbatch * j.nqb, nt, FN(bwd_q_task), &j, stop, &j.poll);
    fa_blas_threads_exit(hook);
    if (stopped || fa_stop_poll_stopped(&j.poll))
        return FA_EINTR;
    return j.status;
}

#undef FN
#undef CAT
#undef CAT_
