// cuflash CUDA simulator: __half and __nv_bfloat16 for the CPU.
//
// Storage is the IEEE binary16 / bfloat16 bit pattern in a 16-bit integer, so the types have the
// size, alignment and bit layout of CUDA's (kernels reinterpret_cast them to and from uint32
// fragments). Conversions from float round to nearest, ties to even (CUDA's __float2half_rn and
// __float2bfloat16_rn), with subnormals, infinities and NaN handled; they are written out bit by
// bit so they do not depend on the host compiler's _Float16 support. Arithmetic operators compute
// in float and round once to the 16-bit type.
#pragma once
#include <cstdint>
#include <cstring>

namespace cusim {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// float -> binary16, round to nearest even.
inline uint16_t f32_to_f16_bits(float f) {
    const uint32_t x = f32_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)  // inf or NaN (NaN stays quiet NaN, payload's top bits kept)
        return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u));
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
    const uint32_t e = ax >> 23;
    if (e < 113) {  // result is subnormal (or zero): value = m * 2^-24
        if (e < 102) return uint16_t(sign);  // below 2^-25: rounds to zero
        const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e;  // 14..24
        uint32_t m = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (m & 1u))) ++m;
        return uint16_t(sign | m);
    }
    uint32_t r = ((e - 112) << 10) | ((ax >> 13) & 0x3ffu);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // may carry into the exponent: right
    return uint16_t(sign | r);
}

inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = float(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

// float -> bfloat16, round to nearest even; NaN stays a quiet NaN.
inline uint16_t f32_to_bf16_bits(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

// float -> OCP E4M3 (float8_e4m3fn) as cvt.rn.satfinite.e4m3x2.f32 converts one element (PTX ISA,
// "cvt"): round to nearest even, subnormals kept (m * 2^-9), a magnitude reaching 448 or beyond
// (inf included) saturates to +-448 (0x7e), NaN becomes the canonical NaN 0x7f; the sign of a zero
// result is kept.
inline uint8_t f32_to_e4m3_satfinite_bits(float f) {
    const uint32_t x = f32_bits(f);
    const uint32_t sign = (x >> 24) & 0x80u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fu;                  // NaN
    if (ax >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // >= 448 (and inf): saturate
    const uint32_t e = ax >> 23;
    if (e >= 121) {  // normal e4m3 (>= 2^-6): exponent e - 120, 3 mantissa bits
        uint32_t r = ((e - 120) << 3) | ((ax >> 20) & 7u);
        const uint32_t rem = ax & 0xfffffu;
        if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) ++r;  // may carry into the exponent: right
        return uint8_t(sign | r);
    }
    if (e < 117) return uint8_t(sign);  // below 2^-10 (half the smallest subnormal): zero
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141 - e;  // 21..24: value * 2^9 = mant >> shift
    uint32_t m = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (m & 1u))) ++m;  // 8 is the smallest normal's encoding: right
    return uint8_t(sign | m);
}

// OCP E4M3 (float8_e4m3fn) -> float, exactly (every e4m3 value is a float): bias 7, subnormals
// m * 2^-9, no infinities, 0x7f / 0xff NaN.
inline float e4m3_bits_to_f32(uint8_t b) {
    const uint32_t em = b & 0x7fu;
    float mag = em >= 8 ? bits_f32(((em >> 3) + 120u) << 23 | (em & 7u) << 20) : float(em) * 0.001953125f;
    if (em == 0x7fu) mag = bits_f32(0x7fc00000u);
    return (b & 0x80u) ? -mag : mag;
}

}  // namespace cusim

struct __align__(2) __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(cusim::f32_to_f16_bits(f)) {}
    __half(double f) : __x(cusim::f32_to_f16_bits(float(f))) {}
    __half(int i) : __x(cusim::f32_to_f16_bits(float(i))) {}
    operator float() const { return cusim::f16_bits_to_f32(__x); }
};

struct __align__(2) __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(cusim::f32_to_bf16_bits(f)) {}
    __nv_bfloat16(double f) : __x(cusim::f32_to_bf16_bits(float(f))) {}
    __nv_bfloat16(int i) : __x(cusim::f32_to_bf16_bits(float(i))) {}
    operator float() const { return cusim::bf16_bits_to_f32(__x); }
};

struct __align__(4) __half2 { __half x, y; };
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit types");
static_assert(sizeof(__half2) == 4 && sizeof(__nv_bfloat162) == 4, "packed pairs");

#define CUSIM_HALF_OPS(T)                                                                  \
    inline T operator+(T a, T b) { return T(float(a) + float(b)); }                        \
    inline T operator-(T a, T b) { return T(float(a) - float(b)); }                        \
    inline T operator*(T a, T b) { return T(float(a) * float(b)); }                        \
    inline T operator/(T a, T b) { return T(float(a) / float(b)); }                        \
    inline T operator-(T a) { T r; r.__x = uint16_t(a.__x ^ 0x8000u); return r; }         \
    inline T& operator+=(T& a, T b) { return a = a + b; }                                  \
    inline T& operator-=(T& a, T b) { return a = a - b; }                                  \
    inline T& operator*=(T& a, T b) { return a = a * b; }                                  \
    inline T& operator/=(T& a, T b) { return a = a / b; }                                  \
    inline bool operator==(T a, T b) { return float(a) == float(b); }                      \
    inline bool operator!=(T a, T b) { return float(a) != float(b); }                      \
    inline bool operator<(T a, T b) { return float(a) < float(b); }                        \
    inline bool operator<=(T a, T b) { return float(a) <= float(b); }                      \
    inline bool operator>(T a, T b) { return float(a) > float(b); }                        \
    inline bool operator>=(T a, T b) { return float(a) >= float(b); }
CUSIM_HALF_OPS(__half)
CUSIM_HALF_OPS(__nv_bfloat16)
#undef CUSIM_HALF_OPS

// --- cuda_fp16.h subset
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __half __int2half_rn(int i) { return __half(float(i)); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline short __half_as_short(__half h) { return short(h.__x); }
inline __half __short_as_half(short s) { __half h; h.__x = uint16_t(s); return h; }
inline __half2 __halves2half2(__half lo, __half hi) { return {lo, hi}; }
inline __half2 __floats2half2_rn(float lo, float hi) { return {__half(lo), __half(hi)}; }
inline __half2 __float2half2_rn(float f) { return {__half(f), __half(f)}; }
inline __half2 make_half2(__half x, __half y) { return {x, y}; }
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half __hadd(__half a, __half b) { return a + b; }
inline __half __hmul(__half a, __half b) { return a * b; }
inline __half __hmax(__half a, __half b) { return float(a) >= float(b) || float(b) != float(b) ? a : b; }
inline __half __hmin(__half a, __half b) { return float(a) <= float(b) || float(b) != float(b) ? a : b; }
inline bool __hisnan(__half a) { return float(a) != float(a); }

// --- cuda_bf16.h subset
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.__x = u; return b; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) { return {lo, hi}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {__nv_bfloat16(lo), __nv_bfloat16(hi)}; }
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return {__nv_bfloat16(f), __nv_bfloat16(f)}; }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) { return {x, y}; }
inline float __low2float(__nv_bfloat162 h) { return float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return float(h.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline bool __hisnan(__nv_bfloat16 a) { return float(a) != float(a); }
