/*
 * Backward of the fused additive kernel (fa_additive.h, fa_additive_bwd_args),
 * instantiated once per precision by fa_additive.c right after
 * fa_additive_impl.h, with REAL, SFX, GEMM and TANH1 (the scalar tanh)
 * defined; it reuses that header's boff.  Not a public header.
 *
 * Tasks over (batch item, key group), as csrc/fa_sdpa_bwd_impl.h: a group is
 * a fixed run of key blocks (a function of the shape and ngroups only).  Its
 * task owns dkp and dV of those keys and sums them over every query block
 * that sees them; it adds its dqp sums into its own partial (dq_part) and its
 * dvec sums into its own vector (dvec_part), both summed in group order
 * afterwards.  For a tile of m queries x n keys:
 *
 *   dP = dO_i V_j^T                                  (BLAS)
 *   per query row: the allowed keys of the row (mask, causal) listed;
 *     t = tanh(qp_i + kp_j) for those keys (n x d scratch) and s = v . t, with
 *     the forward's summation order (the forward's bits, so P is its weights);
 *     P = exp(s + bias - lse_i); ds = P (dP - D_i)  (D in double);
 *     per feature c: sum_j ds_j (1 - t_jc^2) onto the row's double dq sum,
 *     ds_j (1 - t_jc^2) onto the tile's dkp sum of key j (REAL, m terms),
 *     sum_j ds_j t_jc onto the task's double dvec sum;
 *   the tile's dkp sums added into a double accumulator; dV_j += P^T dO_i
 *   (BLAS, into a double accumulator).
 *
 * The factor v_c of dqp and dkp is applied once, in double, when they are
 * written.  Extra memory: D, the dq partials (ngroups x items x Lq x d
 * doubles), dvec partials, and per thread one tile's scratch.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* ----------------------------------------------------- portable row kernels */

/* For the na keys kr[0..na): T[a][c] = tanh(q[c] + kr[a][c]) (row stride d)
 * and s[a] = sum_c v[c] T[a][c], summed as fa_additive_score's scalar loop. */
static void FN(ab_tanh_rows_scalar)(const REAL *q, const REAL *const *kr, int64_t na, int64_t d,
                                    const REAL *v, REAL *T, REAL *s)
{
    for (int64_t a = 0; a < na; a++) {
        const REAL *k = kr[a];
        REAL *t = T + a * d;
        REAL acc = 0;
        for (int64_t c = 0; c < d; c++) {
            REAL x = TANH1(q[c] + k[c]);
            t[c] = x;
            acc += v[c] * x;
        }
        s[a] = acc;
    }
}

/* For the na keys of a row: e = ds[a] (1 - T[a]^2); hq[c] += sum_a e (double),
 * dkr[a][c] += e, dw[c] += sum_a ds[a] T[a][c] (double). */
static void FN(ab_grad_rows_scalar)(const REAL *T, int64_t d, const REAL *ds, REAL *const *dkr,
                                    int64_t na, double *hq, double *dw)
{
    for (int64_t c = 0; c < d; c++) {
        REAL h = 0, w = 0;
        for (int64_t a = 0; a < na; a++) {
            REAL t = T[a * d + c];
            REAL e = ds[a] * ((REAL)1 - t * t);
            h += e;
            dkr[a][c] += e;
            w += ds[a] * t;
        }
        hq[c] += (double)h;
        dw[c] += (double)w;
    }
}

typedef void (*FN(ab_tanh_fn))(const REAL *q, const REAL *const *kr, int64_t na, int64_t d,
                               const REAL *v, REAL *T, REAL *s);
typedef void (*FN(ab_grad_fn))(const REAL *T, int64_t d, const REAL *ds, REAL *const *dkr,
                               int64_t na, double *hq, double *dw);

/* ------------------------------------------------------------------ tasks */

/* row-major C (M x N, ldc) = alpha op(A) op(B) + beta C through the Fortran gemm */
static void FN(ab_gemm)(char ta, char tb, int64_t M, int64_t N, int64_t K, REAL alpha,
                        const REAL *A, int64_t lda, const REAL *B, int64_t ldb, REAL beta,
                        REAL *C, int64_t ldc)
{
    int m = (int)N, n = (int)M, k = (int)K;
    int ia = (int)ldb, ib = (int)lda, ic = (int)ldc;
    GEMM(&tb, &ta, &m, &n, &k, &alpha, (REAL *)B, &ia, (REAL *)A, &ib, &beta, C, &ic);
}

typedef struct {
    const fa_additive_bwd_args *a;
    const fa_rowops *ops;
    FN(ab_tanh_fn) tanh_rows;
    FN(ab_grad_fn) grad_rows;
    int64_t nbatch, nqb, nkb, ngroups;
    const int64_t *gstart;   /* key blocks [gstart[g], gstart[g+1]) form group g */
    size_t need;             /* scratch bytes a task */
    int status;              /* atomic: first failure */
    fa_stop_poll poll;
} FN(abjob);

static inline double *FN(ab_part)(const FN(abjob) *j, int64_t g, int64_t b)
{
    const fa_tiled_args *f = &j->a->f;
    return j->a->dq_part + ((size_t)g * (size_t)j->nbatch + (size_t)b) * (size_t)(f->Lq * f->d);
}

/* Pass 0: D[b, i] = sum_c dO[i, c] O[i, c] in double; the dq partials zeroed. */
static void FN(ab_delta_task)(void *ctx, int64_t t, int slot)
{
    (void)slot;
    FN(abjob) *j = (FN(abjob) *)ctx;
    const fa_additive_bwd_args *a = j->a;
    const fa_tiled_args *f = &a->f;
    int64_t b = t / j->nqb, i0 = (t % j->nqb) * f->block_q;
    int64_t m = f->Lq - i0 < f->block_q ? f->Lq - i0 : f->block_q;
    const REAL *G = (const REAL *)a->grad_out + FN(boff)(f, a->g_bs, b) + i0 * a->ldg;
    const REAL *O = (const REAL *)f->out + FN(boff)(f, f->o_bs, b) + i0 * f->ldo;
    double *D = a->delta + b * f->Lq + i0;
    for (int64_t r = 0; r < m; r++) {
        double s = 0;
        for (int64_t c = 0; c < f->dv; c++)
            s += (double)G[r * a->ldg + c] * (double)O[r * f->ldo + c];
        D[r] = s;
    }
    for (int64_t g = 0; g < j->ngroups; g++)
        memset(FN(ab_part)(j, g, b) + i0 * f->d, 0, (size_t)(m * f->d) * sizeof(double));
}

/* Pass 1: the key blocks of group g of batch item b. */
static void FN(ab_group_task)(void *ctx, int64_t t, int slot)
{
    FN(abjob) *j = (FN(abjob) *)ctx;
    const fa_additive_bwd_args *a = j->a;
    const fa_tiled_args *f = &a->f;
    if (fa_stop_poll_stopped(&j->poll) || __atomic_load_n(&j->status, __ATOMIC_RELAXED))
        return;
    char *base = (char *)fa_arena(j->need);
    if (!base) {
        int expected = FA_OK;
        __atomic_compare_exchange_n(&j->status, &expected, FA_ENOMEM, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
        return;
    }
    const int64_t bq = f->block_q, bk = f->block_k, d = f->d, dv = f->dv;
    /* scratch: doubles, then REALs, then indices and pointers (64-byte aligned runs) */
    double *accK = (double *)base;                 /* bk x d: dkp sums of the key block */
    double *accV = accK + bk * d;                  /* bk x dv: dV sums */
    double *pe = accV + bk * dv;                   /* bk: s - lse, then P, of one row */
    REAL *P = (REAL *)(pe + bk);                   /* bq x bk probabilities (0: not allowed) */
    REAL *dP = P + bq * bk;                        /* bq x bk: dO V^T */
    REAL *Tmp = dP + bq * bk;                      /* bk x dv: P^T dO of one tile */
    REAL *T = Tmp + bk * dv;                       /* bk x d: tanh of one row's keys */
    REAL *dKt = T + bk * d;                        /* bk x d: the tile's dkp sums */
    REAL *s = dKt + bk * d;                        /* bk: scores, then P, of one row */
    REAL *ds = s + bk;                             /* bk */
    int64_t *idx = (int64_t *)(((uintptr_t)(ds + bk) + 63) & ~(uintptr_t)63);
    const REAL **kr = (const REAL **)(idx + bk);
    REAL **dkr = (REAL **)(kr + bk);

    const int64_t b = t / j->ngroups, g = t % j->ngroups;
    const REAL *Q = (const REAL *)f->q + FN(boff)(f, f->q_bs, b);
    const REAL *K = (const REAL *)f->k + FN(boff)(f, f->k_bs, b);
    const REAL *V = (const REAL *)f->v + FN(boff)(f, f->v_bs, b);
    const REAL *G = (const REAL *)a->grad_out + FN(boff)(f, a->g_bs, b);
    const REAL *Lse = (const REAL *)f->lse + FN(boff)(f, f->l_bs, b);
    const REAL *vv = (const REAL *)f->score_params;
    const double *D = a->delta + b * f->Lq;
    double *dQ = FN(ab_part)(j, g, b);
    double *dw = a->dvec_part + ((size_t)b * (size_t)j->ngroups + (size_t)g) * (size_t)d;
    const unsigned char *mb = f->mask_kind == FA_MASK_BOOL
        ? (const unsigned char *)f->mask + FN(boff)(f, f->m_bs, b) : NULL;
    const REAL *bb = f->mask_kind == FA_MASK_ADD
        ? (const REAL *)f->mask + FN(boff)(f, f->m_bs, b) : NULL;
    REAL *dKo = (REAL *)a->dk + FN(boff)(f, a->dk_bs, b);
    REAL *dVo = (REAL *)a->dv + FN(boff)(f, a->dv_bs, b);
    const int acc = a->accumulate;   /* add to dk and dv instead of writing them */

    for (int64_t jb = j->gstart[g]; jb < j->gstart[g + 1]; jb++) {
        const int64_t j0 = jb * bk;
        const int64_t n = f->Lk - j0 < bk ? f->Lk - j0 : bk;
        const REAL *Kj = K + j0 * f->ldk;
        const REAL *Vj = V + j0 * f->ldv;
        /* the first query row that may see key j0: i + offset >= j0 */
        int64_t ifirst = 0;
        if (f->causal) {
            ifirst = j0 - f->causal_offset;
            ifirst = ifirst < 0 ? 0 : ifirst > f->Lq ? f->Lq : ifirst;
            ifirst = ifirst / bq * bq;
        }
        /* one query block sees these keys (a decoder step's few queries): its
         * tile is written straight out -- the double sums of one tile would be
         * (double)dKt and (double)Tmp exactly, so the same floats */
        const int single = f->Lq - ifirst <= bq;
        int written = 0;
        if (!single) {
            memset(accK, 0, (size_t)(n * d) * sizeof(double));
            memset(accV, 0, (size_t)(n * dv) * sizeof(double));
        }
        for (int64_t i0 = ifirst; i0 < f->Lq; i0 += bq) {
            if (fa_stop_poll_check(&j->poll, slot))
                return;
            const int64_t m = f->Lq - i0 < bq ? f->Lq - i0 : bq;
            if (mb && fa_tile_masked_out(mb, f->ldm, i0, m, j0, n))
                continue;
            int live = 0;
            for (int64_t r = 0; r < m && !live; r++)
                live = Lse[i0 + r] != (REAL)(-INFINITY);
            if (!live)
                continue;
            const REAL *Gi = G + i0 * a->ldg;
            FN(ab_gemm)('N', 'T', m, n, dv, (REAL)1, Gi, a->ldg, Vj, f->ldv, (REAL)0, dP, n);
            memset(P, 0, (size_t)(m * n) * sizeof(REAL));
            memset(dKt, 0, (size_t)(n * d) * sizeof(REAL));
            int any = 0;
            for (int64_t r = 0; r < m; r++) {
                const int64_t gi = i0 + r;
                const REAL L = Lse[gi];
                if (L == (REAL)(-INFINITY))
                    continue;   /* no allowed key: no gradient */
                int64_t lim = n;
                if (f->causal) {
                    int64_t c1 = gi + f->causal_offset - j0 + 1;   /* keys [0, c1) allowed */
                    lim = c1 < lim ? c1 : lim;
                }
                const unsigned char *mr = mb ? mb + gi * f->ldm + j0 : NULL;
                const REAL *br = bb ? bb + gi * f->ldm + j0 : NULL;
                int64_t na = 0;
                for (int64_t c = 0; c < lim; c++) {
                    if ((mr && !mr[c]) || (br && br[c] == (REAL)(-INFINITY)))
                        continue;
                    idx[na] = c;
                    kr[na] = Kj + c * f->ldk;
                    dkr[na] = dKt + c * d;
                    na++;
                }
                if (na == 0)
                    continue;
                j->tanh_rows(Q + gi * f->ldq, kr, na, d, vv, T, s);
                /* P = exp(s + bias - lse), the forward's s (and s + bias);
                 * the difference and exp in double */
                if (br)
                    for (int64_t x = 0; x < na; x++)
                        s[x] += br[idx[x]];
                for (int64_t x = 0; x < na; x++)
                    pe[x] = (double)s[x] - (double)L;
                j->ops->exp_f64(pe, pe, na);
                /* ds = P (dP - D), D in double (dP - D often cancels) */
                const double Dr = D[gi];
                const REAL *dpr = dP + r * n;
                REAL *pr = P + r * n;
                for (int64_t x = 0; x < na; x++) {
                    REAL p = (REAL)pe[x];
                    pr[idx[x]] = p;
                    ds[x] = p * (REAL)((double)dpr[idx[x]] - Dr);
                }
                j->grad_rows(T, d, ds, (REAL *const *)dkr, na, dQ + gi * d, dw);
                any = 1;
            }
            if (!any)
                continue;
            /* dV_j += P^T dO_i (one product of at most bq terms, into double) */
            FN(ab_gemm)('T', 'N', n, dv, m, (REAL)1, P, n, Gi, a->ldg, (REAL)0, Tmp, dv);
            if (single) {
                for (int64_t r = 0; r < n; r++) {
                    REAL *dk = dKo + (j0 + r) * a->lddk;
                    const REAL *tk = dKt + r * d;
                    REAL *dvo = dVo + (j0 + r) * a->lddv;
                    const REAL *tv = Tmp + r * dv;
                    if (acc) {
                        for (int64_t c = 0; c < d; c++)
                            dk[c] += (REAL)((double)vv[c] * (double)tk[c]);
                        for (int64_t c = 0; c < dv; c++)
                            dvo[c] += tv[c];
                    } else {
                        for (int64_t c = 0; c < d; c++)
                            dk[c] = (REAL)((double)vv[c] * (double)tk[c]);
                        memcpy(dvo, tv, (size_t)dv * sizeof(REAL));
                    }
                }
                written = 1;
                continue;
            }
            for (int64_t x = 0; x < n * d; x++)
                accK[x] += (double)dKt[x];
            for (int64_t x = 0; x < n * dv; x++)
                accV[x] += (double)Tmp[x];
        }
        if (single) {
            if (!written && !acc)   /* no query sees these keys: v times zero sums, zero dV */
                for (int64_t r = 0; r < n; r++) {
                    REAL *dk = dKo + (j0 + r) * a->lddk;
                    for (int64_t c = 0; c < d; c++)
                        dk[c] = (REAL)((double)vv[c] * 0.0);
                    memset(dVo + (j0 + r) * a->lddv, 0, (size_t)dv * sizeof(REAL));
                }
            continue;
        }
        for (int64_t r = 0; r < n; r++) {
            REAL *dk = dKo + (j0 + r) * a->lddk;
            const double *ak = accK + r * d;
            REAL *dvo = dVo + (j0 + r) * a->lddv;
            const double *av = accV + r * dv;
            if (acc) {
                for (int64_t c = 0; c < d; c++)
                    dk[c] += (REAL)((double)vv[c] * ak[c]);
                for (int64_t c = 0; c < dv; c++)
                    dvo[c] += (REAL)av[c];
            } else {
                for (int64_t c = 0; c < d; c++)
                    dk[c] = (REAL)((double)vv[c] * ak[c]);
                for (int64_t c = 0; c < dv; c++)
                    dvo[c] = (REAL)av[c];
            }
        }
    }
}

/* Pass 2: dq rows of query block qb of item b = v o (the partials summed in
 * group order); rows with lse = -inf exact zeros. */
static void FN(ab_reduce_task)(void *ctx, int64_t t, int slot)
{
    (void)slot;
    FN(abjob) *j = (FN(abjob) *)ctx;
    const fa_additive_bwd_args *a = j->a;
    const fa_tiled_args *f = &a->f;
    const int64_t d = f->d;
    int64_t b = t / j->nqb, i0 = (t % j->nqb) * f->block_q;
    int64_t m = f->Lq - i0 < f->block_q ? f->Lq - i0 : f->block_q;
    REAL *dq = (REAL *)a->dq + FN(boff)(f, a->dq_bs, b) + i0 * a->lddq;
    const REAL *Lse = (const REAL *)f->lse + FN(boff)(f, f->l_bs, b) + i0;
    const REAL *vv = (const REAL *)f->score_params;
    const double *p0 = FN(ab_part)(j, 0, b) + i0 * d;
    for (int64_t r = 0; r < m; r++) {
        REAL *o = dq + r * a->lddq;
        if (Lse[r] == (REAL)(-INFINITY)) {
            memset(o, 0, (size_t)d * sizeof(REAL));
            continue;
        }
        for (int64_t c = 0; c < d; c++) {
            double sum = p0[r * d + c];
            for (int64_t g = 1; g < j->ngroups; g++)
                sum += FN(ab_part)(j, g, b)[(i0 + r) * d + c];
            o[c] = (REAL)((double)vv[c] * sum);
        }
    }
}

/* Split the nkb key blocks into ngroups runs of about equal work (as
 * fa_sdpa_bwd_impl.h's bwd_groups: query rows that see each block). */
static void FN(ab_groups)(const fa_tiled_args *f, int64_t nkb, int64_t ngroups, int64_t *gstart)
{
    fa_bwd_key_groups(f->causal, f->causal_offset, f->block_k, f->Lq, nkb, ngroups, gstart);
}

int FN(fa_additive_bwd)(fa_additive_bwd_args *a)
{
    const fa_tiled_args *f = &a->f;
    if (!GEMM || f->block_q < 1 || f->block_k < 1 || f->n_threads < 1 || !f->lse || !a->delta
        || !f->score_params || f->d < 1 || f->dv < 1 || a->ngroups < 1
        || a->ngroups > FA_BWD_MAX_GROUPS || !a->dq_part || !a->dvec_part || !a->dvec)
        return FA_EINVAL;
    if (!(fa_blas_fits(f->block_q) && fa_blas_fits(f->block_k) && fa_blas_fits(f->dv)
          && fa_blas_fits(f->ldv) && fa_blas_fits(a->ldg)))
        return FA_EINVAL;   /* BLAS takes 32-bit ints: never truncate a size */
    int64_t nbatch = 1;
    for (int i = 0; i < f->nbatch; i++)
        nbatch *= f->batch_shape[i];
    int64_t gstart[FA_BWD_MAX_GROUPS + 1];
    FN(abjob) j;
    j.a = a;
    j.ops = fa_get_rowops();
    j.tanh_rows = FN(ab_tanh_rows_scalar);
    j.grad_rows = FN(ab_grad_rows_scalar);
#if FA_ADD_AVX2
    if (fa_simd_active()) {
        j.tanh_rows = fa_simd_level() >= 2 ? FN(ab_tanh_rows_wide) : FN(ab_tanh_rows_avx2);
        j.grad_rows = FN(ab_grad_rows_avx2);
    }
#endif
    j.nbatch = nbatch;
    j.nqb = (f->Lq + f->block_q - 1) / f->block_q;
    j.nkb = (f->Lk + f->block_k - 1) / f->block_k;
    j.ngroups = a->ngroups;
    j.gstart = gstart;
    {
        const int64_t bq = f->block_q, bk = f->block_k, d = f->d, dv = f->dv;
        size_t bytes = (size_t)(bk * (d + dv + 1)) * sizeof(double)
                       + (size_t)(2 * bq * bk + bk * dv + 2 * bk * d + 2 * bk) * sizeof(REAL);
        bytes = (bytes + 63) / 64 * 64 + 64;
        bytes += (size_t)bk * (sizeof(int64_t) + 2 * sizeof(void *));
        j.need = bytes;
    }
    j.status = FA_OK;
    fa_stop_poll_init(&j.poll, f->stop, f->stop_ctx);
    memset(a->dvec, 0, (size_t)f->d * sizeof(double));
    if (nbatch == 0 || f->Lq == 0)
        return FA_OK;
    memset(a->dvec_part, 0, (size_t)nbatch * (size_t)a->ngroups * (size_t)f->d * sizeof(double));
    FN(ab_groups)(f, j.nkb, j.ngroups, gstart);
    fa_stop_fn stop = f->stop ? fa_stop_poll_fn : NULL;
    int nt = f->n_threads;
    fa_blas_set_threads_fn hook = add_blas_enter();
    int stopped = add_pool_run(nbatch * j.nqb, nt, FN(ab_delta_task), &j, stop, &j.poll);
    if (!stopped && f->Lk > 0)
        stopped = add_pool_run(nbatch * j.ngroups, nt, FN(ab_group_task), &j, stop, &j.poll);
    if (!stopped && j.status == FA_OK)
        stopped = add_pool_run(nbatch * j.nqb, nt, FN(ab_reduce_task), &j, stop, &j.poll);
    add_blas_exit(hook);
    if (stopped || fa_stop_poll_stopped(&j.poll))
        return FA_EINTR;
    if (j.status != FA_OK)
        return j.status;
    /* dvec: the (item, group) partials in a fixed order */
    for (int64_t b = 0; b < nbatch; b++)
        for (int64_t g = 0; g < j.ngroups; g++) {
            const double *p = a->dvec_part + ((size_t)b * (size_t)j.ngroups + (size_t)g) * (size_t)f->d;
            for (int64_t c = 0; c < f->d; c++)
                a->dvec[c] += p[c];
        }
    return FA_OK;
}

#undef FN
#undef CAT
#undef CAT_
