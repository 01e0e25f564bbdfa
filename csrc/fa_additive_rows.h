/*
 * The float additive-score rows of fa_additive.c, instantiated twice by it:
 * FA_ROWS_ATTR / FA_ROWS_SFX / FA_ROWS_WIDE = AVX2 / avx2 / 0 and
 * AVX512 / avx512 / 1.  With FA_ROWS_WIDE the tanh of 16 features is one
 * tanh16_f32 (fa_avx512_math.h: tanh8_f32's bits lane for lane) whose two
 * halves go into the same 8-lane sums, in the same order, as the 256-bit
 * loop's two steps: every score and every tanh has the same bits on both.
 * Not a public header.
 */
#define FA_ROWS_CAT_(a, b) a##_##b
#define FA_ROWS_CAT(a, b) FA_ROWS_CAT_(a, b)
#define FA_ROWS_SCORE FA_ROWS_CAT(additive_score_f32, FA_ROWS_SFX)
#define FA_ROWS_TANH FA_ROWS_CAT(FA_ROWS_CAT(ab_tanh_rows, FA_ROWS_SFX), f32)

#if FA_ROWS_WIDE
#define FA_LO(x) _mm512_castps512_ps256(x)
#define FA_HI(x) _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))
#endif

/* s_ij = sum_a v_a tanh(q_ia + k_ja): four keys at a time (four independent
 * chains), d in steps of 8 (16 with FA_ROWS_WIDE, then 8), a scalar tail
 * for d % 8 */
FA_ROWS_ATTR static int FA_ROWS_SCORE(const float *v, const float *q, int64_t ldq,
                                      const float *k, int64_t ldk, int64_t tq, int64_t tk,
                                      int64_t d, float *s, int64_t lds)
{
    const int64_t d8 = d & ~(int64_t)7;
    for (int64_t i = 0; i < tq; i++) {
        const float *qi = q + i * ldq;
        float *si = s + i * lds;
        int64_t j = 0;
        for (; j + 4 <= tk; j += 4) {
            const float *k0 = k + j * ldk, *k1 = k0 + ldk, *k2 = k1 + ldk, *k3 = k2 + ldk;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t c = 0;
#if FA_ROWS_WIDE
            for (; c + 16 <= d8; c += 16) {
                __m512 vq = _mm512_loadu_ps(qi + c);
                __m256 v0 = _mm256_loadu_ps(v + c), v1 = _mm256_loadu_ps(v + c + 8);
                __m512 t0 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(k0 + c)));
                __m512 t1 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(k1 + c)));
                __m512 t2 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(k2 + c)));
                __m512 t3 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(k3 + c)));
                a0 = _mm256_fmadd_ps(v1, FA_HI(t0), _mm256_fmadd_ps(v0, FA_LO(t0), a0));
                a1 = _mm256_fmadd_ps(v1, FA_HI(t1), _mm256_fmadd_ps(v0, FA_LO(t1), a1));
                a2 = _mm256_fmadd_ps(v1, FA_HI(t2), _mm256_fmadd_ps(v0, FA_LO(t2), a2));
                a3 = _mm256_fmadd_ps(v1, FA_HI(t3), _mm256_fmadd_ps(v0, FA_LO(t3), a3));
            }
#endif
            for (; c < d8; c += 8) {
                __m256 vq = _mm256_loadu_ps(qi + c), vv = _mm256_loadu_ps(v + c);
                a0 = _mm256_fmadd_ps(vv, tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(k0 + c))), a0);
                a1 = _mm256_fmadd_ps(vv, tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(k1 + c))), a1);
                a2 = _mm256_fmadd_ps(vv, tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(k2 + c))), a2);
                a3 = _mm256_fmadd_ps(vv, tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(k3 + c))), a3);
            }
            __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
            float out[4];
            _mm_storeu_ps(out, r);
            for (int t = 0; t < 4; t++) {
                const float *kt = k + (j + t) * ldk;
                for (int64_t cc = d8; cc < d; cc++)
                    out[t] += v[cc] * tanhf(qi[cc] + kt[cc]);
                si[j + t] = out[t];
            }
        }
        for (; j < tk; j++) {
            const float *kj = k + j * ldk;
            __m256 a0 = _mm256_setzero_ps();
            int64_t c = 0;
#if FA_ROWS_WIDE
            for (; c + 16 <= d8; c += 16) {
                __m512 t = tanh16_f32(_mm512_add_ps(_mm512_loadu_ps(qi + c), _mm512_loadu_ps(kj + c)));
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + c), FA_LO(t), a0);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + c + 8), FA_HI(t), a0);
            }
#endif
            for (; c < d8; c += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + c),
                                     tanh8_f32(_mm256_add_ps(_mm256_loadu_ps(qi + c),
                                                             _mm256_loadu_ps(kj + c))), a0);
            float acc = hsum8_f32(a0);
            for (int64_t cc = d8; cc < d; cc++)
                acc += v[cc] * tanhf(qi[cc] + kj[cc]);
            si[j] = acc;
        }
    }
    return 0;
}

/* fa_additive_bwd_impl.h's ab_tanh_rows: T[a] = tanh(q + kr[a]) (row stride
 * d) and s[a] = v . T[a], with the arithmetic of the score rows above (four
 * keys at a time, the same sums): the forward's bits. */
FA_ROWS_ATTR static void FA_ROWS_TANH(const float *q, const float *const *kr, int64_t na,
                                      int64_t d, const float *v, float *T, float *s)
{
    const int64_t d8 = d & ~(int64_t)7;
    int64_t a = 0;
    for (; a + 4 <= na; a += 4) {
        const float *ks[4] = {kr[a], kr[a + 1], kr[a + 2], kr[a + 3]};
        float *t0 = T + a * d, *t1 = t0 + d, *t2 = t1 + d, *t3 = t2 + d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t c = 0;
#if FA_ROWS_WIDE
        for (; c + 16 <= d8; c += 16) {
            __m512 vq = _mm512_loadu_ps(q + c);
            __m256 v0 = _mm256_loadu_ps(v + c), v1 = _mm256_loadu_ps(v + c + 8);
            __m512 x0 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(ks[0] + c)));
            __m512 x1 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(ks[1] + c)));
            __m512 x2 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(ks[2] + c)));
            __m512 x3 = tanh16_f32(_mm512_add_ps(vq, _mm512_loadu_ps(ks[3] + c)));
            _mm512_storeu_ps(t0 + c, x0);
            _mm512_storeu_ps(t1 + c, x1);
            _mm512_storeu_ps(t2 + c, x2);
            _mm512_storeu_ps(t3 + c, x3);
            a0 = _mm256_fmadd_ps(v1, FA_HI(x0), _mm256_fmadd_ps(v0, FA_LO(x0), a0));
            a1 = _mm256_fmadd_ps(v1, FA_HI(x1), _mm256_fmadd_ps(v0, FA_LO(x1), a1));
            a2 = _mm256_fmadd_ps(v1, FA_HI(x2), _mm256_fmadd_ps(v0, FA_LO(x2), a2));
            a3 = _mm256_fmadd_ps(v1, FA_HI(x3), _mm256_fmadd_ps(v0, FA_LO(x3), a3));
        }
#endif
        for (; c < d8; c += 8) {
            __m256 vq = _mm256_loadu_ps(q + c), vv = _mm256_loadu_ps(v + c);
            __m256 x0 = tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(ks[0] + c)));
            __m256 x1 = tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(ks[1] + c)));
            __m256 x2 = tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(ks[2] + c)));
            __m256 x3 = tanh8_f32(_mm256_add_ps(vq, _mm256_loadu_ps(ks[3] + c)));
            _mm256_storeu_ps(t0 + c, x0);
            _mm256_storeu_ps(t1 + c, x1);
            _mm256_storeu_ps(t2 + c, x2);
            _mm256_storeu_ps(t3 + c, x3);
            a0 = _mm256_fmadd_ps(vv, x0, a0);
            a1 = _mm256_fmadd_ps(vv, x1, a1);
            a2 = _mm256_fmadd_ps(vv, x2, a2);
            a3 = _mm256_fmadd_ps(vv, x3, a3);
        }
        __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        float out[4];
        _mm_storeu_ps(out, r);
        for (int t = 0; t < 4; t++) {
            float *tt = T + (a + t) * d;
            for (int64_t cc = d8; cc < d; cc++) {
                float x = tanhf(q[cc] + ks[t][cc]);
                tt[cc] = x;
                out[t] += v[cc] * x;
            }
            s[a + t] = out[t];
        }
    }
    for (; a < na; a++) {
        const float *kj = kr[a];
        float *tt = T + a * d;
        __m256 a0 = _mm256_setzero_ps();
        int64_t c = 0;
#if FA_ROWS_WIDE
        for (; c + 16 <= d8; c += 16) {
            __m512 x = tanh16_f32(_mm512_add_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(kj + c)));
            _mm512_storeu_ps(tt + c, x);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + c), FA_LO(x), a0);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + c + 8), FA_HI(x), a0);
        }
#endif
        for (; c < d8; c += 8) {
            __m256 x = tanh8_f32(_mm256_add_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(kj + c)));
            _mm256_storeu_ps(tt + c, x);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + c), x, a0);
        }
        float acc = hsum8_f32(a0);
        for (int64_t cc = d8; cc < d; cc++) {
            float x = tanhf(q[cc] + kj[cc]);
            tt[cc] = x;
            acc += v[cc] * x;
        }
        s[a] = acc;
    }
}

#if FA_ROWS_WIDE
#undef FA_LO
#undef FA_HI
#endif
#undef FA_ROWS_SCORE
#undef FA_ROWS_TANH
#undef FA_ROWS_CAT
#undef FA_ROWS_CAT_
