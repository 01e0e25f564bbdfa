/*
 * 512-bit versions of fa_exp_avx2.h's exp8_nonpos_f32 and fa_tanh_avx2.h's
 * tanh8_f32, lane for lane the same bits (shared by fa_simd.c and
 * fa_additive.c).  The includer defines AVX512 (the target attribute, with
 * avx512f) and includes <immintrin.h>.  Only AVX512F instructions: the
 * float bit operations go through the integer ones (and/or/andnot of floats
 * are AVX512DQ).
 */
#ifndef FA_AVX512_MATH_H
#define FA_AVX512_MATH_H

/* exp16_nonpos_f32: exp8_nonpos_f32 (fa_exp_avx2.h) lane for lane, the same
 * operations in the same order, so the same bits. */
AVX512 static inline __m512 exp16_nonpos_f32(__m512 x)
{
    const __m512 magic = _mm512_set1_ps(12582912.0f); /* 1.5 * 2^23 */
    x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);   /* a NaN x is kept */
    __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic);
    __m512 n = _mm512_sub_ps(t, magic);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.381461275741458e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.368710055947304e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166838899254799e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666652113199234e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999999403953552e-1f));
    __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    /* e * 2^n rounded once (vscalefps), which is what the AVX2 version's
     * exact multiply (normal results) and two-step scaling (subnormal ones,
     * one rounding) give: the same bits, in one instruction */
    return _mm512_scalef_ps(e, n);
}

/* tanh16_f32: tanh8_f32 (fa_tanh_avx2.h) lane for lane, the same operations
 * in the same order (IEEE division, exp16_nonpos_f32's bits), so the same bits. */
AVX512 static inline __m512 tanh16_f32(__m512 x)
{
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512i xi = _mm512_castps_si512(x);
    const __m512i xsign = _mm512_and_si512(sign, xi);
    __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, xi));
    __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(-0.00570508511736989f), _mm512_set1_ps(0.020639173686504364f));
    p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-0.05373974144458771f));
    p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(0.13331443071365356f));
    p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-0.3333328068256378f));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(x2, x), p, x);
    small = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(small), xsign));
    __m512 z = _mm512_mul_ps(_mm512_set1_ps(-2.0f),
                             _mm512_min_ps(_mm512_set1_ps(9.05f), _mm512_max_ps(_mm512_set1_ps(0.625f), a)));
    __m512 e = exp16_nonpos_f32(z);
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    big = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), xsign));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), big, small);
}

#endif
