/*
 * Register-blocked products for problems too small for a BLAS call to pay:
 *   S (m x n)  = scale * Q (m x d) . K (n x d)^T     (small_qk)
 *   O (m x dv) = P (m x n) . V (n x dv)              (small_pv)
 * AVX2/FMA, instantiated for float and double by fa_simd.c with VEC, W
 * (lanes) and the intrinsic names defined.  small_qk works on blocks of
 * 2 query rows x 4 keys as dot products; small_pv on 2 rows that share every
 * load of V, with the column-block width NC a compile-time constant in each
 * instance so the accumulators stay in registers.
 */


#ifndef FA_SMALL_DISPATCH
/* call F(NC, TWO) with both as compile-time constants */
#define FA_SMALL_DISPATCH(F, nc, two)                                   \
    do {                                                                \
        if (two) {                                                      \
            switch (nc) {                                               \
            case 4: F(4, 1); break;                                     \
            case 3: F(3, 1); break;                                     \
            case 2: F(2, 1); break;                                     \
            default: F(1, 1); break;                                    \
            }                                                           \
        } else {                                                        \
            switch (nc) {                                               \
            case 4: F(4, 0); break;                                     \
            case 3: F(3, 0); break;                                     \
            case 2: F(2, 0); break;                                     \
            default: F(1, 0); break;                                    \
            }                                                           \
        }                                                               \
    } while (0)
#endif

/* S rows i, i+1 by keys j..j+3 as dot products over d: eight accumulators
 * (enough independent FMAs to hide their latency), one horizontal reduction
 * per block.  Missing keys repeat the last one; only valid results are stored. */
AVX2 static void SM(qk_2x4)(int64_t d, const ELT *q0, const ELT *q1, const ELT *k0,
                            const ELT *k1, const ELT *k2, const ELT *k3, ELT scale,
                            ELT *s0, ELT *s1, int nkeys, int second)
{
    VEC a00 = ZERO(), a01 = ZERO(), a02 = ZERO(), a03 = ZERO();
    VEC a10 = ZERO(), a11 = ZERO(), a12 = ZERO(), a13 = ZERO();
    int64_t c = 0;
    for (; c + W <= d; c += W) {
        VEC x0 = LOADU(q0 + c), x1 = LOADU(q1 + c);
        VEC y0 = LOADU(k0 + c), y1 = LOADU(k1 + c), y2 = LOADU(k2 + c), y3 = LOADU(k3 + c);
        a00 = FMADD(x0, y0, a00); a01 = FMADD(x0, y1, a01);
        a02 = FMADD(x0, y2, a02); a03 = FMADD(x0, y3, a03);
        a10 = FMADD(x1, y0, a10); a11 = FMADD(x1, y1, a11);
        a12 = FMADD(x1, y2, a12); a13 = FMADD(x1, y3, a13);
    }
    if (c < d) {
        int64_t r = d - c;
        VEC x0 = SM(load_part)(q0 + c, r), x1 = SM(load_part)(q1 + c, r);
        VEC y0 = SM(load_part)(k0 + c, r), y1 = SM(load_part)(k1 + c, r);
        VEC y2 = SM(load_part)(k2 + c, r), y3 = SM(load_part)(k3 + c, r);
        a00 = FMADD(x0, y0, a00); a01 = FMADD(x0, y1, a01);
        a02 = FMADD(x0, y2, a02); a03 = FMADD(x0, y3, a03);
        a10 = FMADD(x1, y0, a10); a11 = FMADD(x1, y1, a11);
        a12 = FMADD(x1, y2, a12); a13 = FMADD(x1, y3, a13);
    }
    SM(store4)(s0, SM(hsum4)(a00, a01, a02, a03), scale, nkeys);
    if (second)
        SM(store4)(s1, SM(hsum4)(a10, a11, a12, a13), scale, nkeys);
}

AVX2 static void SM(small_qk)(int64_t m, int64_t n, int64_t d, ELT scale,
                              const ELT *Q, int64_t ldq, const ELT *K, int64_t ldk,
                              ELT *S, int64_t lds)
{
    for (int64_t i = 0; i < m; i += 2) {
        int second = i + 1 < m;
        const ELT *q0 = Q + i * ldq, *q1 = second ? q0 + ldq : q0;
        ELT *s0 = S + i * lds, *s1 = s0 + lds;
        for (int64_t j = 0; j < n; j += 4) {
            int nk = n - j < 4 ? (int)(n - j) : 4;
            const ELT *k0 = K + j * ldk;
            const ELT *k1 = nk > 1 ? k0 + ldk : k0;
            const ELT *k2 = nk > 2 ? k0 + 2 * ldk : k0;
            const ELT *k3 = nk > 3 ? k0 + 3 * ldk : k0;
            SM(qk_2x4)(d, q0, q1, k0, k1, k2, k3, scale, s0 + j, s1 + j, nk, second);
        }
    }
}

/* rows i, i+1 (TWO = 1) or i alone, columns [c0, c0 + NC*W) of O; rem = dv - c0;
 * FULL: every column block is whole (no masked loads) */
#define PV_BLOCK(NC, TWO, FULL)                                                           \
    AVX2 static void SM(pv_block_##NC##_##TWO##_##FULL)(int64_t n, int64_t rem,            \
                                                       const ELT *p0, const ELT *p1,     \
                                                       const ELT *V, int64_t ldv,        \
                                                       ELT *o0, ELT *o1)                 \
    {                                                                                    \
        VEC a0[4], a1[4];                                                                \
        for (int u = 0; u < NC; u++)                                                     \
            a0[u] = a1[u] = ZERO();                                                      \
        for (int64_t j = 0; j < n; j++) {                                                \
            const ELT *vr = V + j * ldv;                                                 \
            VEC b0 = SET1(p0[j]);                                                        \
            VEC b1 = TWO ? SET1(p1[j]) : b0;                                             \
            for (int u = 0; u < NC; u++) {                                               \
                VEC vv = FULL ? LOADU(vr + u * W) : SM(load_part)(vr + u * W, rem - u * W); \
                a0[u] = FMADD(b0, vv, a0[u]);                                            \
                if (TWO)                                                                 \
                    a1[u] = FMADD(b1, vv, a1[u]);                                        \
            }                                                                            \
        }                                                                                \
        for (int u = 0; u < NC; u++) {                                                   \
            SM(store_part)(o0 + u * W, a0[u], rem - u * W);                              \
            if (TWO)                                                                     \
                SM(store_part)(o1 + u * W, a1[u], rem - u * W);                          \
        }                                                                                \
    }
PV_BLOCK(1, 0, 0) PV_BLOCK(2, 0, 0) PV_BLOCK(3, 0, 0) PV_BLOCK(4, 0, 0)
PV_BLOCK(1, 1, 0) PV_BLOCK(2, 1, 0) PV_BLOCK(3, 1, 0) PV_BLOCK(4, 1, 0)
PV_BLOCK(1, 0, 1) PV_BLOCK(2, 0, 1) PV_BLOCK(3, 0, 1) PV_BLOCK(4, 0, 1)
PV_BLOCK(1, 1, 1) PV_BLOCK(2, 1, 1) PV_BLOCK(3, 1, 1) PV_BLOCK(4, 1, 1)
#undef PV_BLOCK

AVX2 static void SM(small_pv)(int64_t m, int64_t dv, int64_t n, const ELT *P, int64_t ldp,
                              const ELT *V, int64_t ldv, ELT *O, int64_t ldo)
{
    for (int64_t c0 = 0; c0 < dv; c0 += 4 * W) {
        const int64_t rem = dv - c0;
        const int nc = (int)(rem >= 4 * W ? 4 : (rem + W - 1) / W);
        const int full = rem >= (int64_t)nc * W;
        for (int64_t i = 0; i < m; i += 2) {
            int two = i + 1 < m;
            const ELT *p0 = P + i * ldp, *p1 = two ? p0 + ldp : p0;
            ELT *o0 = O + i * ldo + c0, *o1 = two ? o0 + ldo : o0;
#define PVF(NC, TWO) SM(pv_block_##NC##_##TWO##_1)(n, rem, p0, p1, V + c0, ldv, o0, o1)
#define PVP(NC, TWO) SM(pv_block_##NC##_##TWO##_0)(n, rem, p0, p1, V + c0, ldv, o0, o1)
            if (full)
                FA_SMALL_DISPATCH(PVF, nc, two);
            else
                FA_SMALL_DISPATCH(PVP, nc, two);
#undef PVF
#undef PVP
        }
    }
}

