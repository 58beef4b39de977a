// out (M, N) = x (M, K) @ dequant(qweight, scales, zeros) on tensor cores (mma.sync m16n8k16,
// float16 or bfloat16 inputs, float32 accumulators), int4 weights dequantized in registers.
//
// The packed format is quantize_int4's, unchanged: qweight (K/2, N) uint8, byte [r, n] holds
// k = 2r (low nibble) and k = 2r + 1 (high nibble) of column n. That byte is exactly one B-fragment
// register of m16n8k16 (two consecutive k of one column), so no repacking is needed:
//   B frag of lane (g = lane/4, t = lane%4) for the k16 step at packed row r0:
//     b0 = {w[2(r0+t)], w[2(r0+t)+1]} of column n(g),  b1 = the same at packed row r0+t+4.
// A thread loads NWORD 32-bit words of a packed row (4*NWORD consecutive columns); byte j of word
// w feeds n-tile nt = 4w + j, so n-tile nt holds the columns col0 + g'*NT + nt (g' = 0..7) and a
// warp covers BC = 32*NWORD consecutive columns with NT = 4*NWORD n-tiles; rows of a warp's load
// are BC contiguous bytes (coalesced).
// Dequantization of one register (two weights): PRMT puts the byte's low nibble in half 0 and its
// high nibble (from v >> 4) in half 1, LOP3 masks and ORs the exponent of 1024 (float16) / 128
// (bfloat16), so the halves are M + q exactly; FMA with -(M + z) gives q - z exactly; a multiply
// by the group's scale rounds (q - z) * s once to the input type. The mma then multiplies exactly
// and accumulates in float32. (w4a16_wk at MT <= 0 leaves the zero and the scale to its float32 sums, and in float16
// enters the weights as the subnormals q * 2^-24: wk_body, dq_sub.)
// Work split: a chunk is 64 k (32 packed rows, 4 k16 steps, always inside one group: group size
// % 64 == 0). Warp w of block (x, y) owns columns [(x*WARPS + w)*BC, +BC) and every block takes the
// chunks [y*cpb, +cpb): the warps of a block share the activation chunk, staged in shared memory
// (two buffers, rows padded to 72 halves so the A-fragment reads hit 32 distinct banks). The next
// chunk's weights, scales, zeros and activations are loaded into registers before the current one
// is computed; one barrier per chunk. With ksplit = gridDim.y > 1 the blocks write float32 partial
// tiles and the last block of a column tile (counter, fences, as in gemm_w4a16.cu) adds them in a
// fixed order and resets its counter.
// Host guarantees: N % BC == 0, K % 64 == 0, group_rows % 32 == 0, 16-byte aligned contiguous
// arrays; M > 16*MT runs as several m-blocks (the weights are read again); no device-side assert.

#ifndef W4_BFSZ
#define W4_BFSZ 1  // bfloat16: a chunk's scales and zeros converted two per cvt.rn.bf16x2.f32 (0: probe builds only)
#endif
// two float16 (low, high half) to two bfloat16 in the same halves, each rounded to nearest even (sm_80)
__device__ __forceinline__ u32 f16x2_to_bf16x2(u32 h) {
  u32 d;
  asm("{\n\t.reg .b16 l, h;\n\t.reg .f32 a, b;\n\tmov.b32 {l, h}, %1;\n\tcvt.f32.f16 a, l;\n\tcvt.f32.f16 b, h;\n\t"
      "cvt.rn.bf16x2.f32 %0, b, a;\n\t}" : "=r"(d) : "r"(h));
  return d;
}

template <class X> struct MmaOps;
template <> struct MmaOps<F16> {
  static constexpr u32 MAGIC = 0x64006400u, ONE = 0x3C003C00u;
  static constexpr float MAGIC_F = 1024.f;  // the value of MAGIC's halves
  static constexpr bool SUB = true;  // W4_SUB: a nibble q as the subnormal q * 2^-24 is exact, and the mma takes it
  static __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
  }
  static __device__ __forceinline__ u16 from_f(float f) { return f2h(f); }
  // scales/zeros words of columns (c, c+1) -> {s,s} and {-(1024+z), -(1024+z)} per column, no conversions
  static __device__ __forceinline__ void sz(u32 sw, u32 zw, u32* s2, u32* nz) {
    const u32 zz = fma2(zw, 0xBC00BC00u, 0xE400E400u);  // -z - 1024, exact
    s2[0] = __byte_perm(sw, sw, 0x1010); s2[1] = __byte_perm(sw, sw, 0x3232);
    nz[0] = __byte_perm(zz, zz, 0x1010); nz[1] = __byte_perm(zz, zz, 0x3232);
  }
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct MmaOps<BF16> {
  static constexpr u32 MAGIC = 0x43004300u, ONE = 0x3F803F80u;
  static constexpr float MAGIC_F = 128.f;
  static constexpr bool SUB = false;  // q * 2^-133 times an activation would leave float32's normal range: MAGIC + q
  static __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
  }
  static __device__ __forceinline__ u16 from_f(float f) { return f2b(f); }
  // float16 scales rounded to bfloat16 (nearest even, as f2b; a NaN scale stays NaN); -(128 + z) exact (made in
  // float16, exactly: z is a small integer); both columns' values in one hardware conversion each (W4_BFSZ; 0, probe
  // builds only: f2b per value, nine instructions each)
  static __device__ __forceinline__ void sz(u32 sw, u32 zw, u32* s2, u32* nz) {
#if W4_BFSZ
    const u32 zz = MmaOps<F16>::fma2(zw, 0xBC00BC00u, 0xD800D800u);  // -z - 128 per half, exact
    const u32 sb = f16x2_to_bf16x2(sw), zb = f16x2_to_bf16x2(zz);
    s2[0] = __byte_perm(sb, sb, 0x1010); s2[1] = __byte_perm(sb, sb, 0x3232);
    nz[0] = __byte_perm(zb, zb, 0x1010); nz[1] = __byte_perm(zb, zb, 0x3232);
#else
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u16 sx = f2b(h2f((u16)(sw >> (16 * h)))), zx = f2b(-(128.f + h2f((u16)(zw >> (16 * h)))));
      s2[h] = (u32)sx | ((u32)sx << 16);
      nz[h] = (u32)zx | ((u32)zx << 16);
    }
#endif
  }
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// The B fragments of n-tile 4w + j (one register per packed row: two weights, k = 2r and 2r + 1) from a lane's
// words v0 (packed row r0) and v1 (r0 + 4), v0s = v0 >> 4, v1s = v1 >> 4 (one shift per word, shared by its four
// n-tiles): PRMT puts byte j's low nibble in half 0 and its high nibble in half 1, LOP3 masks and ORs the exponent
// of MAGIC (halves = MAGIC + q, exact), FMA with nz = -(MAGIC + z) gives q - z exactly, the multiply by s2 rounds
// (q - z) * s once to the input type. j is a compile-time constant in every caller (unrolled loops).
#ifndef W4_LOP
#define W4_LOP 1  // 0 (probe builds only): (t & mask) | MAGIC written in C++, which compiles to two LOP3 (two immediates)
#endif
// (t & 0x000F000F) | magic in ONE lop3: the mask and the magic as register operands (SASS LOP3 takes one immediate, so
// the C++ expression with two constants compiles to two; the compiler keeps the two constants in registers)
__device__ __forceinline__ u32 and_or(u32 t, u32 magic) {
#if W4_LOP
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(t), "r"(0x000F000Fu), "r"(magic));  // 0xEA: (a & b) | c
  return d;
#else
  return (t & 0x000F000Fu) | magic;
#endif
}

template <class X>
__device__ __forceinline__ void dq_pair(u32 v0, u32 v0s, u32 v1, u32 v1s, int j, u32 nz, u32 s2, u32* b0, u32* b1) {
  typedef MmaOps<X> O;
  const u32 sel = (u32)(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12));
  const u32 t0 = and_or(__byte_perm(v0, v0s, sel), O::MAGIC);
  const u32 t1 = and_or(__byte_perm(v1, v1s, sel), O::MAGIC);
  *b0 = O::fma2(O::fma2(t0, O::ONE, nz), s2, 0x80008000u);
  *b1 = O::fma2(O::fma2(t1, O::ONE, nz), s2, 0x80008000u);
}

// The same pair as dq_pair without the zero and the scale: halves MAGIC + q, exact (w4a16_wk at MT = 0 with W4_FIX: the
// zero and the scale are applied to the float32 sums of each chunk instead, wk_body).
template <class X>
__device__ __forceinline__ u32 dq_raw(u32 v, u32 vs, int j) {
  const u32 sel = (u32)(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12));
  return and_or(__byte_perm(v, vs, sel), MmaOps<X>::MAGIC);
}

// W4_SUB (float16, w4a16_wk's FIX path): the pair of byte j as two float16 subnormals, halves q * 2^-24, exact: lo = the
// word's low nibbles (v & 0x0F0F0F0F), hi = its high nibbles ((v >> 4) & 0x0F0F0F0F), both masked once per word; one PRMT
// per pair takes byte j of lo and of hi, and fills the two high bytes with the sign of lo's byte j (prmt's sign mode,
// selector bit 3), which is 0. So a pair costs one PRMT (and a quarter of the word's two LOP3 and shift) where dq_raw
// costs PRMT + LOP3, and the sums carry no MAGIC to take off again: the chunk's float32 sums are 2^-24 sum(q x) exactly
// as the mma adds them (wk_body's m-block end multiplies by 2^24)
__device__ __forceinline__ u32 dq_sub(u32 lo, u32 hi, int j) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"((u32)(j | ((8 | j) << 4) | ((4 + j) << 8) | ((8 | j) << 12))));
  return d;
}

// dq_sub's pair times {s * 2^17, s * 2^16} plus -z * s / 16 (ss, zs; one HFMA2): (q - z) * s / 16 in float16, from
// lo = (v << 3) & 0x78787878 (the low nibbles at bits 3..6: q * 2^-21) and hi = v & 0xF0F0F0F0 (q * 2^-20). The
// wgmma kernels (W4_WGSUB) and w4a16_wk at MT >= 1 (W4_WKSUB) in float16; the rounding and the scales it cannot take
// (|s| >= 0.5, not finite: computed again by w4_fix4) are described at W4_WGSUB in w4a16_wg.cu
__device__ __forceinline__ u32 dq_wsub(u32 lo, u32 hi, int j, u32 ss, u32 zs) {
  return MmaOps<F16>::fma2(dq_sub(lo, hi, j), ss, zs);
}

// dq_wsub's ss and zs for the columns c, c + 1 of a scales word sw and a zeros word zw: ss[0], zs[0] for c; ss[1],
// zs[1] for c + 1 (lo at q * 2^-21, hi at q * 2^-20, so ss = {s * 2^17, s * 2^16}, which float16 holds while |s| < 0.5;
// lo cannot be at 2^-20 too: its byte's bit 7 fills the high bytes in dq_sub, and must be 0)
__device__ __forceinline__ void sz_wsub(u32 sw, u32 zw, u32* ss, u32* zs) {
  typedef MmaOps<F16> O;
  const u32 s15 = O::fma2(sw, 0x78007800u, 0x80008000u);  // s * 2^15, exact, under 2^14
  const u32 z = O::fma2(O::fma2(zw, 0xAC00AC00u, 0x80008000u), sw, 0x80008000u);  // -z / 16 (exact for the zeros
                                                                                   // quantize_int4 makes), times s
  ss[0] = O::fma2(__byte_perm(s15, s15, 0x1010), 0x40004400u, 0x80008000u);  // {s * 2^17, s * 2^16}
  ss[1] = O::fma2(__byte_perm(s15, s15, 0x3232), 0x40004400u, 0x80008000u);
  zs[0] = __byte_perm(z, z, 0x1010); zs[1] = __byte_perm(z, z, 0x3232);
}

// dq_wsub's scales: the sums of outputs (row, col .. col + 3) over k in [k0, k1) in float32 on CUDA cores, the weights
// dequantized as dequantize_int4 does: where a scale dq_wsub cannot take was found in those columns
template <class X>
__device__ __forceinline__ float4 w4_fix4(const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
                                          const u16* __restrict__ scales, const u16* __restrict__ zeros, int row, int col,
                                          int k0, int k1, int K, int N, int group_rows) {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  const u16* xr = x + (u64)row * K;
  for (int pr = k0 >> 1; pr < (k1 >> 1); ++pr) {  // packed rows: k = 2 pr (low nibbles), 2 pr + 1 (high)
    const u32 w4 = *reinterpret_cast<const u32*>(qweight + (u64)pr * N + col);
    const u64 gz = (u64)(pr / group_rows) * N + col;
    const float x0 = X::load(xr[2 * pr]), x1 = X::load(xr[2 * pr + 1]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 b = (w4 >> (8 * j)) & 255u;
      const float sc = h2f(scales[gz + j]), z = h2f(zeros[gz + j]);
      a[j] += x0 * (((float)(b & 15u) - z) * sc) + x1 * (((float)(b >> 4) - z) * sc);
    }
  }
  return make_float4(a[0], a[1], a[2], a[3]);
}
// w4_fix4 as a call (w4a16_wk's epilogues: its code stays out of the chunk loop's register allocation; the mma.sync
// kernels may call, where a call in a wgmma kernel serializes its wgmma instructions)
template <class X>
__device__ __noinline__ float4 w4_fix4_call(const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
                                            const u16* __restrict__ scales, const u16* __restrict__ zeros, int row,
                                            int col, int k0, int k1, int K, int N, int group_rows) {
  return w4_fix4<X>(x, qweight, scales, zeros, row, col, k0, k1, K, N, group_rows);
}

// v >> 4 as the high word of v * 2^28 (IMAD.HI: the FMA pipe, which the loop leaves idle, instead of a SHF on the ALU pipe
// that the dequantization keeps busy)
__device__ __forceinline__ u32 shr4_fma(u32 v) {
  u32 d;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(d) : "r"(v), "r"(1u << 28));
  return d;
}

__device__ __forceinline__ u32 ld_nc_u32(const void* p) {
  u32 r; asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}

template <int NWORD>
__device__ __forceinline__ void ld_words(const unsigned char* p, u32* w) {
  if (NWORD == 4) {
    const uint4 v = ld_nc_v4(p); w[0] = v.x; w[1 % NWORD] = v.y; w[2 % NWORD] = v.z; w[3 % NWORD] = v.w;
  } else if (NWORD == 2) {
    uint2 v; asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    w[0] = v.x; w[1 % NWORD] = v.y;
  } else {
    w[0] = ld_nc_u32(p);
  }
}

// NT float16 values (scales or zeros of NT consecutive columns) as NT/2 words
template <int NT>
__device__ __forceinline__ void ld_halves(const u16* p, u32* w) {
  if (NT >= 8) {
#pragma unroll
    for (int q = 0; q < NT / 8; ++q) {
      const uint4 v = ld_nc_v4(p + 8 * q); w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
    }
  } else {
    uint2 v; asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    w[0] = v.x; w[1] = v.y;
  }
}

// The block's float32 tile through shared memory `ot` (row stride OW floats; warp w's columns from w*BC, lane
// (g, t)'s n-tile nt at column (2t + e%2)*NT + nt of rows mt*16 + g (+8)), then row by row as float4: 8-byte stores of
// outputs (ksplit 1) or 16-byte stores of this block's partials. One barrier inside; the caller synchronizes after.
template <class O, int MT, int NT, int BC, int OW, int WARPS>
__device__ __forceinline__ void tile_out(float* ot, float (&acc)[MT][NT][4], bool cols_ok, int m0, int M, int N,
                                         int colb, int ksplit, float* partial, u16* out) {
  constexpr int MR = 16 * MT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (cols_ok) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          ot[(mt * 16 + g + (e >> 1) * 8) * OW + warp * BC + (2 * t + (e & 1)) * NT + nt] = acc[mt][nt][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < MR * (WARPS * BC / 4); idx += WARPS * 32) {
    const int r = idx / (WARPS * BC / 4), c = 4 * (idx % (WARPS * BC / 4)), m = m0 + r;
    if (m < M && colb + c < N) {
      const float4 v = *reinterpret_cast<const float4*>(ot + r * OW + c);
      if (ksplit == 1) {
        *reinterpret_cast<uint2*>(out + (u64)m * N + colb + c) =
            make_uint2((u32)O::from_f(v.x) | ((u32)O::from_f(v.y) << 16), (u32)O::from_f(v.z) | ((u32)O::from_f(v.w) << 16));
      } else {
        *reinterpret_cast<float4*>(partial + ((u64)blockIdx.y * M + m) * N + colb + c) = v;
      }
    }
  }
}

// The last block of a column tile (last_of_split): the ksplit partials of columns [col_begin, +width) added in
// split order, 4 columns per step (16-byte loads past L1), written as the output type; the tile's counter reset.
template <class O>
__device__ __forceinline__ void add_partials4(const float* partial, u16* out, int M, int N, int col_begin, int width,
                                              int ksplit, int nthreads, unsigned int* counters) {
  for (int idx = threadIdx.x; idx < M * (width / 4); idx += nthreads) {
    const int m = idx / (width / 4), col = col_begin + 4 * (idx % (width / 4));
    if (col < N) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int sp = 0; sp < ksplit; ++sp) {
        const float* p = partial + ((u64)sp * M + m) * N + col;
        float4 u; asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(u.x), "=f"(u.y), "=f"(u.z), "=f"(u.w) : "l"(p));
        v.x += u.x; v.y += u.y; v.z += u.z; v.w += u.w;
      }
      *reinterpret_cast<uint2*>(out + (u64)m * N + col) =
          make_uint2((u32)O::from_f(v.x) | ((u32)O::from_f(v.y) << 16), (u32)O::from_f(v.z) | ((u32)O::from_f(v.w) << 16));
    }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

template <class X, int MT, int NWORD, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) w4a16_mma(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  typedef MmaOps<X> O;
  constexpr int NT = 4 * NWORD, BC = 32 * NWORD, MR = 16 * MT, XS = 72;  // XS: x row stride in smem (halves)
  constexpr int XP = MR * 8 / (WARPS * 32) > 0 ? MR * 8 / (WARPS * 32) : 1;  // 16-byte x pieces per thread
  constexpr int OW = WARPS * BC + 4;  // output tile row stride (floats)
  constexpr int XROWS = (MR * OW * 4 + 2 * MR * XS * 2 - 1) / (2 * MR * XS * 2) * MR;  // x buffers sized to hold the tile too
  __shared__ __align__(16) u16 xs[2][XROWS][XS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int colb = blockIdx.x * (WARPS * BC), col0 = colb + warp * BC, colt = col0 + g * NT;
  const bool cols_ok = col0 < N;
  const int n_chunks = K >> 6;
  const int c_begin = min((int)blockIdx.y * cpb, n_chunks), c_end = min(c_begin + cpb, n_chunks);
  const int ksplit = gridDim.y;

  for (int m0 = 0; m0 < M; m0 += MR) {
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

    u32 wc[4][2][NWORD], sc[NT / 2], zc[NT / 2];
    uint4 xr[XP];
    auto load_w = [&](int ch, u32 (&w)[4][2][NWORD], u32* s, u32* z) {
      if (!cols_ok) return;
      const int pr = ch * 32;
      const unsigned char* p = qweight + (u64)(pr + t) * N + colt;
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        ld_words<NWORD>(p + (u64)(8 * st) * N, w[st][0]);
        ld_words<NWORD>(p + (u64)(8 * st + 4) * N, w[st][1]);
      }
      const u64 go = (u64)(pr / group_rows) * N + colt;
      ld_halves<NT>(scales + go, s);
      ld_halves<NT>(zeros + go, z);
    };
    auto load_x = [&](int ch) {  // piece i: row (idx / 8), 8 halves at k = ch*64 + 8*(idx % 8)
#pragma unroll
      for (int i = 0; i < XP; ++i) {
        const int idx = i * WARPS * 32 + threadIdx.x, r = idx >> 3, m = m0 + r;
        xr[i] = make_uint4(0u, 0u, 0u, 0u);
        if (idx < MR * 8 && m < M) xr[i] = *reinterpret_cast<const uint4*>(x + (u64)m * K + ch * 64 + 8 * (idx & 7));
      }
    };
    auto store_x = [&](int buf) {
#pragma unroll
      for (int i = 0; i < XP; ++i) {
        const int idx = i * WARPS * 32 + threadIdx.x;
        if (idx < MR * 8) *reinterpret_cast<uint4*>(&xs[buf][idx >> 3][8 * (idx & 7)]) = xr[i];
      }
    };
    u32 w1[4][2][NWORD], s1[NT / 2], z1[NT / 2];  // chunk ch + 1 (weights run two chunks ahead)
    if (c_begin < c_end) {
      load_w(c_begin, wc, sc, zc);
      if (c_begin + 1 < c_end) load_w(c_begin + 1, w1, s1, z1);
      load_x(c_begin);
      store_x(c_begin & 1);
    }
    __syncthreads();
    for (int ch = c_begin; ch < c_end; ++ch) {
      u32 wn[4][2][NWORD], sn[NT / 2], zn[NT / 2];
      const bool more = ch + 1 < c_end;
      if (ch + 2 < c_end) load_w(ch + 2, wn, sn, zn);
      if (more) load_x(ch + 1);
      if (cols_ok) {
        // per column: s2 = {s, s}, nz = {-(magic + z), -(magic + z)} in X
        u32 s2[NT], nz[NT];
#pragma unroll
        for (int c = 0; c < NT; c += 2) O::sz(sc[c >> 1], zc[c >> 1], s2 + c, nz + c);
        const u32* xw = reinterpret_cast<const u32*>(&xs[ch & 1][0][0]);
#pragma unroll
        for (int st = 0; st < 4; ++st) {
          u32 a[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const int ra = (mt * 16 + g) * (XS / 2) + 8 * st + t, rb = ra + 8 * (XS / 2);
            a[mt][0] = xw[ra]; a[mt][1] = xw[rb]; a[mt][2] = xw[ra + 4]; a[mt][3] = xw[rb + 4];
          }
#pragma unroll
          for (int w = 0; w < NWORD; ++w) {
            const u32 v0 = wc[st][0][w], v0s = v0 >> 4, v1 = wc[st][1][w], v1s = v1 >> 4;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              u32 b0, b1;
              dq_pair<X>(v0, v0s, v1, v1s, j, nz[4 * w + j], s2[4 * w + j], &b0, &b1);
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) O::mma(acc[mt][4 * w + j], a[mt], b0, b1);
            }
          }
        }
      }
      if (more) {
        store_x((ch + 1) & 1);  // the other buffer: its last readers passed the barrier below
#pragma unroll
        for (int st = 0; st < 4; ++st)
#pragma unroll
          for (int w = 0; w < NWORD; ++w) {
            wc[st][0][w] = w1[st][0][w]; wc[st][1][w] = w1[st][1][w];
            w1[st][0][w] = wn[st][0][w]; w1[st][1][w] = wn[st][1][w];
          }
#pragma unroll
        for (int c = 0; c < NT / 2; ++c) { sc[c] = s1[c]; zc[c] = z1[c]; s1[c] = sn[c]; z1[c] = zn[c]; }
      }
      __syncthreads();
    }
    // the block's (MR, WARPS*BC) float32 tile through shared memory (over the x buffers), then
    // written row by row: 16-byte float4 stores of partials, 8-byte stores of outputs
    float* ot = reinterpret_cast<float*>(&xs[0][0][0]);
    tile_out<O, MT, NT, BC, OW, WARPS>(ot, acc, cols_ok, m0, M, N, colb, ksplit, partial, out);
    __syncthreads();
  }
  if (ksplit == 1 || !last_of_split(counters, ksplit)) return;
  add_partials4<O>(partial, out, M, N, colb, WARPS * BC, ksplit, WARPS * 32, counters);
}

// w4a16_mma_async: the same product, with the weights, scales, zeros and activations of S chunks in
// flight through shared memory (cp.async, S stages, one barrier per chunk) instead of registers.
// Stage layout (bytes): per warp [32 packed rows][BC] weights, per warp [scales BC halves][zeros BC
// halves], then x [MR rows][XS halves] (rows >= M zero-filled by the copy itself).
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u64 a; asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p)); return (u32)a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16_s(u32 dst, const void* src) {  // dst: a shared-window address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N_PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N_PENDING)); }

template <class X, int MT, int NWORD, int WARPS, int S>
__global__ void __launch_bounds__(WARPS * 32) w4a16_mma_async(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  typedef MmaOps<X> O;
  constexpr int NT = 4 * NWORD, BC = 32 * NWORD, MR = 16 * MT, XS = 72;
  constexpr int WB = 32 * BC, SZB = 4 * BC, XB = MR * XS * 2;
  constexpr int STAGE = WARPS * (WB + SZB) + XB;
  constexpr int OW = WARPS * BC + 4;
  constexpr int SMEM = S * STAGE > MR * OW * 4 ? S * STAGE : MR * OW * 4;
  __shared__ __align__(16) unsigned char smem[SMEM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int colb = blockIdx.x * (WARPS * BC), col0 = colb + warp * BC;
  const bool cols_ok = col0 < N;
  const int n_chunks = K >> 6;
  const int c_begin = min((int)blockIdx.y * cpb, n_chunks), c_end = min(c_begin + cpb, n_chunks);
  const int nloc = c_end - c_begin;
  const int ksplit = gridDim.y;

  for (int m0 = 0; m0 < M; m0 += MR) {
    auto issue = [&](int ch, int stage) {
      unsigned char* st = smem + stage * STAGE;
      const int pr = ch * 32;
      if (cols_ok) {
        unsigned char* wdst = st + warp * WB;
#pragma unroll
        for (int i = 0; i < WB / 16 / 32; ++i) {
          const int p = i * 32 + lane, row = p / (BC / 16), c16 = p % (BC / 16);
          cp_async16(wdst + row * BC + 16 * c16, qweight + (u64)(pr + row) * N + col0 + 16 * c16, 16);
        }
        if (lane < BC / 4) {  // BC/8 pieces of scales, then BC/8 of zeros
          const int which = lane / (BC / 8), off = lane % (BC / 8);
          const u16* src = (which ? zeros : scales) + (u64)(pr / group_rows) * N + col0 + 8 * off;
          cp_async16(st + WARPS * WB + warp * SZB + which * 2 * BC + 16 * off, src, 16);
        }
      }
      unsigned char* xdst = st + WARPS * (WB + SZB);
      for (int p = threadIdx.x; p < MR * 8; p += WARPS * 32) {
        const int r = p >> 3, m = m0 + r;
        const u16* src = m < M ? x + (u64)m * K + ch * 64 + 8 * (p & 7) : x;
        cp_async16(xdst + r * (XS * 2) + 16 * (p & 7), src, m < M ? 16 : 0);
      }
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < nloc) issue(c_begin + s, s);
      cp_async_commit();
    }
    for (int i = 0; i < nloc; ++i) {
      cp_async_wait<S - 2>();
      __syncthreads();
      if (i + S - 1 < nloc) issue(c_begin + i + S - 1, (i + S - 1) % S);
      cp_async_commit();
      if (!cols_ok) continue;
      const unsigned char* st = smem + (i % S) * STAGE;
      const unsigned char* wsrc = st + warp * WB + g * (4 * NWORD);
      const u32* szw = reinterpret_cast<const u32*>(st + WARPS * WB + warp * SZB + g * NT * 2);
      u32 s2[NT], nz[NT];
#pragma unroll
      for (int c = 0; c < NT; c += 2) O::sz(szw[c >> 1], szw[(BC / 2) + (c >> 1)], s2 + c, nz + c);  // zeros: BC/2 words on
      const u32* xw = reinterpret_cast<const u32*>(st + WARPS * (WB + SZB));
#pragma unroll
      for (int stp = 0; stp < 4; ++stp) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int ra = (mt * 16 + g) * (XS / 2) + 8 * stp + t, rb = ra + 8 * (XS / 2);
          a[mt][0] = xw[ra]; a[mt][1] = xw[rb]; a[mt][2] = xw[ra + 4]; a[mt][3] = xw[rb + 4];
        }
        u32 w0[NWORD], w1[NWORD];
        const unsigned char* r0 = wsrc + (8 * stp + t) * BC;
        const unsigned char* r1 = r0 + 4 * BC;
#pragma unroll
        for (int w = 0; w < NWORD; ++w) { w0[w] = reinterpret_cast<const u32*>(r0)[w]; w1[w] = reinterpret_cast<const u32*>(r1)[w]; }
#pragma unroll
        for (int w = 0; w < NWORD; ++w) {
          const u32 v0 = w0[w], v0s = v0 >> 4, v1 = w1[w], v1s = v1 >> 4;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            u32 b0, b1;
            dq_pair<X>(v0, v0s, v1, v1s, j, nz[4 * w + j], s2[4 * w + j], &b0, &b1);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) O::mma(acc[mt][4 * w + j], a[mt], b0, b1);
          }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    float* ot = reinterpret_cast<float*>(smem);
    tile_out<O, MT, NT, BC, OW, WARPS>(ot, acc, cols_ok, m0, M, N, colb, ksplit, partial, out);
    __syncthreads();
  }
  if (ksplit == 1 || !last_of_split(counters, ksplit)) return;
  add_partials4<O>(partial, out, M, N, colb, WARPS * BC, ksplit, WARPS * 32, counters);
}

// w4a16_wk: the same product with every warp on its own: a block is WK warps over ONE column slab of
// BC = 32*NWORD columns, and its warps split the block's chunks between them (warp w takes chunks
// c_begin + w, + WK, ...: at any time the WK warps read neighbouring rows). Each warp runs its own
// cp.async pipeline of S stages (weights [32 packed rows][BC] with 16-byte pieces swizzled so the
// fragment reads hit distinct banks, its chunk's scales and zeros, and with XSM the activation chunk
// [MR rows][72 halves]; without XSM the A fragments are read from global memory through L1), waits
// with cp.async.wait_group + __syncwarp: no block barrier in the loop. At MT > 0 (W4_HALF) a chunk is two copy groups,
// packed rows 0-15 with the rest, then rows 16-31, and its k16 steps 0-1 run once the first has landed.
// MT = 0 (M <= 8 per m-block): the operands swapped, out^T = W^T x^T: the dequantized weights are the A
// operand (16 columns x 16 k: bytes j0 = 2p & 3 and j0 + 1 of a lane's word are rows g and g + 8 of A-tile
// p, i.e. the columns g*NT + 2p and g*NT + 2p + 1) and 8 activation rows are B (b0 = x[g][k0+2t..],
// b1 = x[g][k0+2t+8..], rows >= M zero): one mma per 8 weights per lane instead of one per 4, half the
// mma.sync of MT = 1 for the same columns. MT = -NB (NB >= 2; M <= 8*NB per m-block): the same with NB
// B operands of 8 activation rows each (tile b: rows 8b..8b+7), every dequantized A-tile used by NB mma.sync: the
// weights dequantized once for 8*NB rows as at MT = 0 (W4_FIX: no zero or scale per pair).
// Epilogue (W4_EPI = 1, the default): each warp writes its float32 tile into its own pipeline stages (free
// once its copies are done) as NS float4 "slots" per lane, slot-major (slot s of lane l at float4 s*32 + l:
// conflict-free 16-byte stores and loads); one __syncthreads; then thread (warp w, lane l) takes the slots
// w, w + WK, ... of lane l, adds the WK warps' float4 in warp order (deterministic) and writes the 4
// consecutive outputs the slot holds (wk_slot: its row and column). W4_EPI = 0 (probe builds only): the
// earlier epilogue, the tiles added one warp after another into one shared tile, WK barriers.
// K split: with gridDim.y == 1 the sums are the outputs. w4a16_wk with gridDim.y > 1: float32 partials,
// fence, counter; the last block of the column tile adds them in split order and resets its counter.
// w4a16_wkc<..., CL> (__cluster_dims__(1, CL, 1), gridDim.y == CL): the CL blocks of a column tile form a
// cluster; each puts its block sum in a shared tile, a cluster barrier, then rank r adds the CL tiles' slots
// of its share in rank order through distributed shared memory (mapa + ld.shared::cluster) and writes the
// outputs; a second barrier keeps every tile alive until all ranks have read it: no global partials, fences
// or counters. With CL = 2 and one m-block (M <= MB, the table's case) rank 1 instead stores its block sum into rank
// 0's tile (st.async, counted by an mbarrier of rank 0) and leaves; rank 0 adds it to its own and writes every output:
// one cluster barrier (arrived at the start, waited for before the stores) instead of two around the reads.
// Dynamic shared memory: WK*S*STAGE + MB*(BC+4)*4 bytes, STAGE = 36*BC + XSM*MB*XROW, MB = 16*MT (8*NB for
// MT = -NB, 8 for MT = 0), XROW = 144 (padded rows) or, where that would pass 227 KiB, 128 (swizzled rows) (host: quant.py);
// the last tile is the block's sum (w4a16_wkc, then 16 bytes for its mbarrier) or the shared tile of W4_EPI = 0;
// w4a16_wkm adds 16*WK*S bytes of mbarriers after it and always pads the rows (as packed by w4_xpack).
// A fragments (MT > 0, XSM): one ldmatrix.x4 per m-tile per k16 step (W4_LDSM = 0, probe builds only: 32-bit loads,
// as before).
// W4_PROBE (probe builds only, bench/gpu/w4a16_probe.py): bit 0 no dequant + mma (loads only), bit 1 no
// weight loads after the first S-1 stages (math only), bit 2 raw words as B fragments (no dequant), bit 3
// no mma (dequantized words folded into a register instead), bit 4 no chunk loop at all (launch, zeroing and
// the epilogue only), bit 5 no epilogue (the chunk loop only; nothing written), bit 6 nothing at all (an
// empty kernel of the same geometry and shared memory: the launch).
#ifndef W4_PROBE
#define W4_PROBE 0
#endif
#ifndef W4_EPI
#define W4_EPI 1
#endif
#ifndef W4_FIX
#define W4_FIX 1  // 0 (probe builds only): MT = 0 dequantizes with the zero and the scale per pair (dq_pair), as before
#endif
#ifndef W4_SUB
#define W4_SUB 1  // float16 at FIX enters the weights as q * 2^-24 (dq_sub), the high nibbles by a shift; 2: by IMAD.HI
                  // (shr4_fma); 0: as MAGIC + q (dq_raw). 0 and 2: probe builds
#endif
#ifndef W4_WKSUB
#define W4_WKSUB 1  // float16 at MT >= 1: the weights through subnormals, two instructions per pair (dq_wsub) instead of
                    // dq_pair's four; 0: dq_pair
#endif
#ifndef W4_PDL
#define W4_PDL 1  // 0 (probe builds only): no griddepcontrol (pdl_begin does nothing)
#endif
#ifndef W4_PDL_PF
#define W4_PDL_PF 1  // chunks per warp whose weights wk_body prefetches into L2 before pdl_begin (0, 2, 8: probe builds)
#endif
#ifndef W4_PUSH
#define W4_PUSH 1  // 0 (test and probe builds only): w4a16_wkc at CL = 2 keeps the two cluster barriers at one m-block too
#endif
#ifndef W4_HALF
#define W4_HALF 2  // 2: at MT > 0, each chunk's copies in two cp.async groups (packed rows 0-15 with the scales, zeros and
                   // activations, then rows 16-31), the k16 steps 0-1 started once the first group has landed; 1 (probe
                   // builds only): at every MT; 0 (probe builds only): one group per chunk
#endif
#ifndef W4_M1
#define W4_M1 1  // at M = 1 (one activation row) the chunk's correction only for batch row 2t (0: probe builds only)
#endif
#ifndef W4_ZLATE
#define W4_ZLATE 1  // the staged activation rows >= M zeroed after an m-block's first copies are issued, not before
#endif              // them (0: probe builds only)
#ifndef W4_EDEAD
#define W4_EDEAD 1  // MT = 0 without a cluster: the epilogue stores and adds only the slots of rows < M (0: probe builds)
#endif
#ifndef W4_SZV
#define W4_SZV 1  // MT = 0: the chunk's correction reads its scales and zeros as 16-byte words (0: probe builds only)
#endif
#ifndef W4_LDSM
#define W4_LDSM 1  // 0 (probe builds only): the A fragments read as 32-bit words, all four k16 steps before the math
#endif

// Programmatic dependent launch (quant.wk_launch launches w4a16_wk, wkc, wkm, wg and wgc with the stream-serialization
// attribute when asked; otherwise both instructions do nothing): the next kernel of the stream may be launched now, and
// its blocks start as this kernel's leave their SMs; then this block waits for the kernel before it to complete, before
// it reads anything that kernel may write (x, the split-K partials and counters) or writes anything. Called by every
// thread before its first global access.
__device__ __forceinline__ void pdl_begin() {
#if W4_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The four 8x8 matrices of an m16n8k16 A fragment (rows 0-7 / 8-15, k 0-7 / 8-15) from shared memory: a[0..3] as
// the mma wants them; addr: this lane's row (lanes 0-15 rows 0-15 at k 0, lanes 16-31 the same rows at k 8).
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
}

// Staged activations: the 16-byte piece (8 k) where logical piece c (0..7) of a row with row & 7 == r7 lies (XSW:
// 128-byte rows, pieces swizzled; else 144-byte padded rows, in order), and 32-bit word kw (0..31) of row `row`.
// The copies (issue), the ldmatrix reads and the word reads all go through these.
template <bool XSW>
__device__ __forceinline__ int x_piece(int r7, int c) { return XSW ? c ^ r7 : c; }
template <bool XSW>
__device__ __forceinline__ int x_word(int row, int kw) {
  return row * (XSW ? 32 : 36) + 4 * x_piece<XSW>(row & 7, kw >> 2) + (kw & 3);
}
template <int NWORD>
__device__ __forceinline__ int wk_swz(int row) {  // 16-byte piece of a B-tile row ^ this
  return NWORD == 4 ? ((row & 3) << 1) : NWORD == 2 ? (((row >> 1) & 1) << 1) : 0;
}
__device__ __forceinline__ u32 ld_x32(const u16* p) {
  u32 r; asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}
// sm_90 thread block clusters in PTX (no headers under NVRTC)
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(u32 local_addr, u32 rank) {  // the same offset in block `rank`'s shared memory
  u32 a; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(local_addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void add4(float4& v, const float4 u) { v.x += u.x; v.y += u.y; v.z += u.z; v.w += u.w; }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// an arrival that orders nothing before it (the block has nothing to publish; its reads of peers' shared memory are done)
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
// v into block `rank`'s shared memory at the offset local_addr has here; the bytes complete_tx on that block's mbarrier
// at the offset local_bar has here (sm_90, PTX 8.1)
__device__ __forceinline__ void st_async_f4(u32 local_addr, float4 v, u32 local_bar, u32 rank) {
  asm volatile("{\n\t.reg .b32 ra, rb;\n\tmapa.shared::cluster.u32 ra, %0, %5;\n\tmapa.shared::cluster.u32 rb, %6, %5;\n\t"
               "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [ra], {%1, %2, %3, %4}, [rb];\n\t}"
               :: "r"(local_addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rank), "r"(local_bar) : "memory");
}
// mbarriers and the bulk copy multicast to the blocks of a cluster (w4a16_wkm; sm_90, PTX 8.0)
__device__ __forceinline__ void mbar_init(u32 addr, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(u32 addr, u32 bytes) {  // this block's one arrival of the phase
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(addr), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 addr, u32 parity) {  // the phase of this parity complete (acquire, cta)
  u32 ok = 0;
  while (!ok)
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(ok) : "r"(addr), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_wait_cluster(u32 addr, u32 parity) {  // the same, acquire at cluster scope
  u32 ok = 0;
  while (!ok)
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(ok) : "r"(addr), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive_at(u32 local_addr, u32 rank) {  // one arrival on block `rank`'s barrier (release)
  asm volatile("{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, %0, %1;\n\t"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n\t}" :: "r"(local_addr), "r"(rank) : "memory");
}
// `bytes` from global memory to the same shared offset `dst` in every block of `mask`; each block's barrier at offset
// `mbar` counts them (complete_tx)
__device__ __forceinline__ void bulk_multicast(u32 dst, const void* src, u32 bytes, u32 mbar, u16 mask) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(mbar), "h"(mask) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 mbar) {  // the same, this block only
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Slot s of lane (g, t) of a w4a16_wk tile: its row in the m-block and its first column in the slab (4 columns).
// MT > 0: s = (mt*4 + e)*NWORD + q holds acc[mt][4q..4q+3][e]: row mt*16 + g + 8*(e >> 1), column (2t + (e & 1))*NT + 4q.
// MT <= 0: s = (nb*2 + b)*NWORD + q holds {acc[nb][2q][b], acc[nb][2q][2+b], acc[nb][2q+1][b], acc[nb][2q+1][2+b]}:
// batch row 8*nb + 2t + b, column g*NT + 4q (C[column g*NT + 2p + (e >> 1)][batch row 8*nb + 2t + (e & 1)] =
// acc[nb][p][e]).
template <int MT, int NWORD>
__device__ __forceinline__ void wk_slot(int s, int lane, int* r, int* c) {
  const int g = lane >> 2, t = lane & 3, q = s % NWORD;
  if (MT <= 0) {
    *r = 8 * (s / (2 * NWORD)) + 2 * t + (s / NWORD) % 2; *c = g * 4 * NWORD + 4 * q;
  } else {
    const int e = (s / NWORD) & 3, mt = s / (4 * NWORD);
    *r = mt * 16 + g + 8 * (e >> 1); *c = (2 * t + (e & 1)) * 4 * NWORD + 4 * q;
  }
}

template <class X>
__device__ __forceinline__ void st_out4(u16* p, const float4 v) {  // 4 outputs, one 8-byte store
  typedef MmaOps<X> O;
  *reinterpret_cast<uint2*>(p) =
      make_uint2((u32)O::from_f(v.x) | ((u32)O::from_f(v.y) << 16), (u32)O::from_f(v.z) | ((u32)O::from_f(v.w) << 16));
}

template <class X, int MT, int NWORD, int WK, int S, int XSM, int CL, int XM>
__device__ __forceinline__ void wk_body(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  typedef MmaOps<X> O;
  constexpr bool TR = MT <= 0;
  constexpr int NB = TR ? (MT == 0 ? 1 : -MT) : 0;  // TR: B operands of 8 activation rows
  constexpr bool LDSM = XSM && !TR && W4_LDSM;  // A fragments from the staged activations by ldmatrix
  // MT <= 0: the weights enter the mma as MAGIC + q (dq_raw: PRMT + LOP3 per pair, no HADD2 / HMUL2), into per-chunk
  // float32 sums; a ones-mma sums each activation row over the chunk; at the chunk's end per column
  // acc += s * (sum - (MAGIC + z) * rowsum), in float32 (the weights never rounded to the input type). In float16
  // (SUB) as q * 2^-24 instead (dq_sub: one PRMT per pair), the ones 2^-24 too, without MAGIC in the correction
  constexpr bool FIX = TR && W4_FIX;
  constexpr bool SUB = FIX && W4_SUB && O::SUB;  // the weights enter as q * 2^-24 (dq_sub), float16 only
  // MT >= 1 in float16 (W4_WKSUB): the weights as (q - z) * s / 16 by dq_wsub (PRMT, HFMA2 per pair), the sums times 16
  // at the m-block's end. Scales dq_wsub cannot take (|s| >= 0.5, not finite): s * 2^17 is then not finite, which two
  // HFMA2 per pair of columns and chunk note (0 * s * 2^17 added into a word that stays +-0 unless one was not); the loop
  // runs as it is, a flag per warp goes to shared memory after it, and a block with one flagged warp computes its sums
  // again, over its own chunks, in float32 (w4_fix4_call), before they are stored, pushed or added to the other blocks'
  // (so every K split stays right). Not in the bulk-copy kernel (XM) nor the earlier epilogue's probe builds (W4_EPI 0)
  constexpr bool WSUB = !TR && XM == 0 && W4_WKSUB && O::SUB && W4_EPI == 1;
  constexpr bool HALF = XM == 0 && (W4_HALF == 1 || (W4_HALF == 2 && MT > 0));  // two copy groups per chunk
  // no cluster (every slot stays in this block), one B operand (M <= 8, rows often < MR; at MT -2 measured slower)
  constexpr bool EDEAD = W4_EDEAD && CL == 1 && W4_EPI == 1 && MT == 0;
  constexpr bool ZLATE = W4_ZLATE && XM == 0;  // (w4a16_wkm: its rows come by bulk copy, zeroed before as always)
  constexpr int MTA = TR ? NB : MT;  // m-tiles held (TR: NB 8-row B operands)
  constexpr int NT = 4 * NWORD, BC = 32 * NWORD, MR = TR ? 8 * NB : 16 * MT, NP = BC / 16, XS = 72;
  // staged activation rows padded to 144 bytes (the reads of 8 rows at one k hit 32 banks); where that would not fit
  // in 227 KiB (MT > 0 only: S = 3 at MT 2 NWORD 4), 128 bytes with 16-byte piece c of row r at c ^ (r & 7)
  // (ldmatrix reads 8 rows of one piece: 8 distinct pieces, 32 banks). The host's _wk_smem follows the same rule.
  constexpr int PADDED = WK * S * (36 * BC + (XSM ? MR * 2 * XS : 0)) + MR * (BC + 4) * 4;
  // XM > 0 (w4a16_wkm): x is the packed activations (w4_xpack: padded 144-byte rows, MR rows per chunk, one
  // contiguous block), each chunk's rows copied by XM bulk copies, multicast to the cluster of CN = XM blocks
  constexpr int CN = XM > 0 ? XM : 1;
  constexpr bool XSW = !TR && XSM && XM == 0 && PADDED > 227 * 1024;
  constexpr int XROW = XSW ? 128 : 2 * XS;
  constexpr int WB = 32 * BC, SZB = 4 * BC, XB = XSM ? MR * XROW : 0, STAGE = WB + SZB + XB;
  constexpr int OW = BC + 4;
  static_assert(XM == 0 || (XSM && !TR && CL == 1 && W4_PROBE == 0 && W4_EPI == 1 && PADDED <= 227 * 1024),
                "packed activations: staged padded rows, no K split, not in probe builds");
  extern __shared__ __align__(16) unsigned char dsm[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.x * BC;
  const int n_chunks = K >> 6;
  const int c_begin = min((int)blockIdx.y * cpb, n_chunks), c_end = min(c_begin + cpb, n_chunks);
  const int nloc = (W4_PROBE & 16) ? 0 : c_end - c_begin > warp ? (c_end - c_begin - warp + WK - 1) / WK : 0;
  const int ksplit = gridDim.y;
  if (W4_PROBE & 64) return;
  unsigned char* wsm = dsm + warp * (S * STAGE);
  float* tile = reinterpret_cast<float*>(dsm + WK * S * STAGE);
  // WSUB: per warp, whether its chunks' scales held one dq_wsub cannot take; in the tile's last bytes,
  // which the epilogue's block sums (NS float4 per lane, NS below) leave unused (no static shared memory: it would move
  // the dynamic stages off their 128-byte alignment)
  u32* const wk_flag = reinterpret_cast<u32*>(dsm + WK * S * STAGE + (TR ? MTA * NT / 2 : MTA * NT) * 32 * 16);
  static_assert(!WSUB || (MTA * NT * 32 * 16 + WK * 4 <= MR * (BC + 4) * 4), "the flags fit after the block sums");
  // XM > 0 (w4a16_wkm): after the tile, per warp S "full" mbarriers (its stage's activation rows have landed: one
  // arrival, this block's expect_tx, and the bytes of the CN blocks' copies) then S "empty" ones (the CN blocks' warps
  // of this index have released the stage: CN arrivals). Stages are counted over the m-blocks (gb) for the phases.
  const u32 fbar = smem_addr(dsm + WK * S * STAGE + MR * OW * 4) + warp * (16 * S), ebar = fbar + 8 * S;
  const u32 crank = CN > 1 ? cluster_rank() : 0u;
  int gb = 0;
  if (XM > 0) {
    if (lane == 0)
      for (int s = 0; s < S; ++s) { mbar_init(fbar + 8 * s, 1u); mbar_init(ebar + 8 * s, (u32)CN); }
    mbar_init_fence();
    cluster_sync();  // every block's barriers initialized before any copy or arrival reaches them
  }
  // PUSH (w4a16_wkc, CL = 2, one m-block: M <= MR, the same in both blocks): rank 1 stores its block sum into rank 0's
  // tile (st.async), counted by one mbarrier of rank 0 (after the tile; expecting the tile's bytes); rank 0 adds and
  // writes every output; one cluster barrier, arrived at here and waited for in the epilogue, orders the mbarrier's
  // initialization before rank 1's stores
  constexpr int NS = TR ? MTA * NT / 2 : MTA * NT;  // float4 slots per lane
  constexpr bool PUSH = W4_PUSH && CL == 2 && XM == 0 && W4_EPI == 1 && !(W4_PROBE & 32);
  const bool push = PUSH && M <= MR;
  const u32 rbar = smem_addr(dsm + WK * S * STAGE + MR * OW * 4);
  if (push) {
    if (threadIdx.x == 0 && cluster_rank() == 0) {
      mbar_init(rbar, 1u);
      mbar_expect_tx(rbar, (u32)(NS * 32 * 16));  // its one arrival
      mbar_init_fence();
    }
    cluster_arrive();
  }
  // lane's B bytes inside a tile row: logical 16-byte piece and offset in it
  const int bpiece = (g * 4 * NWORD) >> 4, boff = (g * 4 * NWORD) & 15;
  // the copies of a chunk, set up once (the chunk loop adds a chunk's offset): 16-byte piece p = i*32 + lane of the
  // weights is row i*RPI + lane/NP, piece lane % NP, swizzled by its row's low bits (which i does not change: RPI is a
  // multiple of 4); the lanes < BC/4 copy a piece of the chunk's scales (then zeros), group ch / cpg
  constexpr int RPI = 32 / NP;
  static_assert(RPI % 4 == 0 || NWORD == 1, "the swizzle of a lane's pieces is the same for every i");
  const int lrow = lane / NP, lc16 = lane % NP;
  const u32 wsm_s = smem_addr(wsm), w_dst = (u32)(lrow * BC + 16 * (lc16 ^ wk_swz<NWORD>(lrow)));
  const unsigned char* w_src = qweight + (u64)lrow * N + col0 + 16 * lc16;
  const u64 w_chunk = 32ull * (u64)N, w_piece = (u64)RPI * (u64)N;
  const bool sz_lane = lane < BC / 4;
  const int sz_which = lane / (BC / 8), sz_off = lane % (BC / 8);
  const u16* sz_src = (sz_which ? zeros : scales) + col0 + 8 * sz_off;
  const u32 sz_dst = (u32)(WB + sz_which * 2 * BC + 16 * sz_off);
  const int cpg = group_rows >> 5, cpg_shift = (cpg & (cpg - 1)) == 0 ? __ffs(cpg) - 1 : -1;  // chunks per group
#if W4_PDL_PF > 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  {  // the weights of each warp's first W4_PDL_PF chunks prefetched into L2 before the wait (lane l: packed row l of a
     // chunk, its BC bytes): with a dependent launch they come while the kernel before ends. One chunk measured 0.3-0.9
     // µs faster than none, eight slower than none (docs/kernels.md, "Programmatic dependent launch")
    const unsigned char* pf = qweight + (u64)lane * N + col0;
    const int npf = min(nloc, W4_PDL_PF);
    for (int j = 0; j < npf; ++j) {
      const unsigned char* p = pf + (u64)(c_begin + warp + WK * j) * w_chunk;
#pragma unroll
      for (int b = 0; b < BC; b += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(p + b));
    }
  }
#endif
  pdl_begin();
  u32 wk_chk = 0u;  // WSUB: 0 * s * 2^17 of every scale of this warp's chunks, added up: +-0 while all were finite

  for (int m0 = 0; m0 < M; m0 += MR) {
    const int mrows = min(MR, M - m0);
    const bool m1 = mrows == 1;  // W4_M1 only
    auto zero_rows = [&]() {  // rows >= M stay zero: copies only ever write rows < mrows
      if (XSM && mrows < MR) {
        for (int s = 0; s < S; ++s)
          for (int i = lane; i < (MR - mrows) * (XROW / 4); i += 32)
            reinterpret_cast<u32*>(wsm + s * STAGE + WB + SZB + mrows * XROW)[i] = 0u;
        __syncwarp();
      }
    };
    if (!ZLATE) zero_rows();
    // the next chunk to copy: its index, its stage and its sources, advanced by one of this warp's chunks per issue (the
    // calls come in order j = 0, 1, ...), so a chunk's copies cost adds, not 64-bit products and a division by S.
    // This lane's activation pieces: p = lane + 32 it, row p / 8 = lane / 8 + 4 it, piece p % 8 = lane % 8
    int nx_ch = c_begin + warp, nx_stage = gb % S;
    const unsigned char* nx_w = w_src + (u64)nx_ch * w_chunk;
    const u16* nx_x = x + (u64)(m0 + (lane >> 3)) * K + (u64)nx_ch * 64 + 8 * (lane & 7);
    const u64 x_it = 4ull * (u64)K;  // 4 rows of x
    // part: 0 the whole chunk; HALF: 1 its packed rows 0-15, scales, zeros and activations, 2 its rows 16-31 (then the
    // running sources advance)
    auto issue = [&](int j, int part) {  // the warp's j-th chunk of this m-block into stage (gb + j) % S
      const int ch = nx_ch, stage = nx_stage;
      const u32 st_s = wsm_s + (u32)(stage * STAGE);
#pragma unroll
      for (int i = part == 2 ? NP / 2 : 0; i < (part == 1 ? NP / 2 : NP); ++i)
        cp_async16_s(st_s + w_dst + (u32)(i * RPI * BC), nx_w + (u64)i * w_piece);
      if (part == 2) {
        nx_ch += WK;
        nx_stage = nx_stage + 1 == S ? 0 : nx_stage + 1;
        nx_w += WK * w_chunk;
        nx_x += WK * 64;
        return;
      }
      if (sz_lane) cp_async16_s(st_s + sz_dst, sz_src + (u64)(cpg_shift >= 0 ? ch >> cpg_shift : ch / cpg) * N);
      if (XM > 0) {
        unsigned char* st = wsm + stage * STAGE;
        // NOTE: order is important here: the stage released by the CN blocks (empty phase of chunk J - S) -> this
        // block's expect_tx (all mrows rows, 144 bytes each) -> this block's share of the rows < mrows of the packed
        // chunk, one bulk copy, multicast to the CN blocks (CN = 1: to this block alone)
        const int J = gb + j;
        if (lane == 0) {
          if (J >= S) mbar_wait_cluster(ebar + 8 * stage, (u32)((J / S - 1) & 1));
          mbar_expect_tx(fbar + 8 * stage, (u32)(mrows * XROW));
          const int rb = (mrows + CN - 1) / CN, r0 = (int)crank * rb, nr = min(rb, mrows - r0);  // this block's rows
          if (nr > 0) {
            const u16* src = x + (((u64)(m0 / MR) * (u64)(K >> 6) + (u64)ch) * MR + (u64)r0) * (XROW / 2);
            const u32 dst = smem_addr(st + WB + SZB) + (u32)(r0 * XROW);
            if (CN > 1) bulk_multicast(dst, src, (u32)(nr * XROW), fbar + 8 * stage, (u16)((1u << CN) - 1u));
            else bulk_copy(dst, src, (u32)(nr * XROW), fbar + 8 * stage);
          }
        }
      } else if (XSM) {
#pragma unroll
        for (int it = 0; it < (MR * 8 + 31) / 32; ++it) {
          const int row = (lane >> 3) + 4 * it;
          if (row < mrows)
            cp_async16_s(st_s + (u32)(WB + SZB + row * XROW + 16 * x_piece<XSW>(row & 7, lane & 7)), nx_x + it * x_it);
        }
      }
      if (part == 1) return;
      nx_ch += WK;
      nx_stage = nx_stage + 1 == S ? 0 : nx_stage + 1;
      nx_w += WK * w_chunk;
      nx_x += WK * 64;
    };
    float acc[MTA][NT][4];  // TR: acc[nb][p] for B operand nb, A-tile p < NT/2
    u32 sink = 0u;           // W4_PROBE bit 3 only
#pragma unroll
    for (int mt = 0; mt < MTA; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
    // HALF: two commit groups per chunk (issue parts 1 and 2): chunk i's first is complete once at most 2 (S - 2) + 1
    // groups are pending, its second (after chunk i + S - 1's two are committed) once at most 2 (S - 1)
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < nloc) issue(s, HALF ? 1 : 0);
      cp_async_commit();
      if (HALF) {
        if (s < nloc) issue(s, 2);
        cp_async_commit();
      }
    }
    if (ZLATE) zero_rows();  // (the copies write rows < mrows only: no race with them)
    int rd_stage = gb % S;  // the stage of chunk i
    for (int i = 0; i < nloc; ++i) {
      const int rs = rd_stage;
      rd_stage = rd_stage + 1 == S ? 0 : rd_stage + 1;
      cp_async_wait<HALF ? 2 * (S - 2) + 1 : S - 2>();
      __syncwarp();
      if (XM > 0) mbar_wait(fbar + 8 * ((gb + i) % S), (u32)(((gb + i) / S) & 1));  // the CN blocks' rows landed
      if (i + S - 1 < nloc && !(W4_PROBE & 2)) issue(i + S - 1, HALF ? 1 : 0);
      cp_async_commit();
      if (HALF) {
        if (i + S - 1 < nloc && !(W4_PROBE & 2)) issue(i + S - 1, 2);
        cp_async_commit();
      }
      if (W4_PROBE & 1) continue;
      const int ch = c_begin + warp + WK * i;
      const unsigned char* st = wsm + rs * STAGE;
      u32 a[4][MTA][4];  // TR: [stp][nb][0] and [stp][nb][2] are B operand nb (x rows 8*nb + g)
      // LDSM: a[stp] is read by ldmatrix inside the k16 loop below (fewer live registers, a quarter of the loads)
      if (LDSM) {
      } else if (XSM) {
        const u32* xw = reinterpret_cast<const u32*>(st + WB + SZB);
#pragma unroll
        for (int stp = 0; stp < 4; ++stp)
#pragma unroll
          for (int mt = 0; mt < MTA; ++mt) {
            const int ra = mt * (TR ? 8 : 16) + g, rb = ra + 8, kw = 8 * stp + t;  // rows, 32-bit word along k
            a[stp][mt][0] = xw[x_word<XSW>(ra, kw)]; a[stp][mt][2] = xw[x_word<XSW>(ra, kw + 4)];
            if (!TR) { a[stp][mt][1] = xw[x_word<XSW>(rb, kw)]; a[stp][mt][3] = xw[x_word<XSW>(rb, kw + 4)]; }
          }
      } else {
#pragma unroll
        for (int stp = 0; stp < 4; ++stp)
#pragma unroll
          for (int mt = 0; mt < MTA; ++mt) {
            const int ra = m0 + mt * (TR ? 8 : 16) + g, rb = ra + 8, k = ch * 64 + 16 * stp + 2 * t;
            const u16* pa = x + (u64)ra * K + k;
            const u16* pb = x + (u64)rb * K + k;
            const bool oka = TR ? mt * 8 + g < mrows : ra < M;
            a[stp][mt][0] = oka ? ld_x32(pa) : 0u; a[stp][mt][2] = oka ? ld_x32(pa + 8) : 0u;
            if (!TR) { a[stp][mt][1] = rb < M ? ld_x32(pb) : 0u; a[stp][mt][3] = rb < M ? ld_x32(pb + 8) : 0u; }
          }
      }
      const u32* szw = reinterpret_cast<const u32*>(st + WB + g * NT * 2);
      u32 s2[FIX ? 1 : NT], nz[FIX ? 1 : NT];  // FIX: unused (the zero and the scale go to the chunk's sums)
      if (!FIX) {  // WSUB: {s * 2^17, s * 2^16} and -z * s / 16
#pragma unroll
        for (int c = 0; c < NT; c += 2) {
          if (WSUB) {  // 0 * {s * 2^17, s * 2^16} of columns c and c + 1 into the check
            sz_wsub(szw[c >> 1], szw[(BC / 2) + (c >> 1)], s2 + c, nz + c);
            wk_chk = MmaOps<F16>::fma2(s2[c], 0u, MmaOps<F16>::fma2(s2[c + 1], 0u, wk_chk));
          } else {
            O::sz(szw[c >> 1], szw[(BC / 2) + (c >> 1)], s2 + c, nz + c);
          }
        }
      }
      constexpr int NC = FIX ? NT / 2 : 1;  // FIX: the A-tiles' per-chunk sums
      constexpr bool SZV = W4_SZV && NC % 4 == 0 && MT == 0;  // (at MT -2 measured slower)
      float accc[MTA][NC][4], xsum[MTA][4];  // FIX: this chunk's sums, row sums (per B operand)
      if (FIX) {
#pragma unroll
        for (int nb = 0; nb < MTA; ++nb) {
          xsum[nb][0] = xsum[nb][1] = xsum[nb][2] = xsum[nb][3] = 0.f;
#pragma unroll
          for (int p = 0; p < NC; ++p) accc[nb][p][0] = accc[nb][p][1] = accc[nb][p][2] = accc[nb][p][3] = 0.f;
        }
      }
      // ldmatrix.x4 row addresses: lanes 0-15 rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8 of an m-tile's k16 step
      // (logical piece 2 stp + lane/16 of row mt*16 + (lane & 15), whose row & 7 is lane & 7)
      const u32 xa = smem_addr(st + WB + SZB) + (lane & 15) * XROW;
#pragma unroll
      for (int stp = 0; stp < 4; ++stp) {
        if (HALF && stp == 2) {  // packed rows 16-31 of chunk i
          cp_async_wait<2 * (S - 1)>();
          __syncwarp();
        }
        if (LDSM) {
#pragma unroll
          for (int mt = 0; mt < MTA; ++mt)
            ldsm_x4(xa + mt * 16 * XROW + 16 * x_piece<XSW>(lane & 7, 2 * stp + (lane >> 4)), a[stp][mt]);
        }
        u32 w0[NWORD], w1[NWORD];
        const int r0 = 8 * stp + t, r1 = r0 + 4;
        const unsigned char* p0 = st + r0 * BC + 16 * (bpiece ^ wk_swz<NWORD>(r0)) + boff;
        const unsigned char* p1 = st + r1 * BC + 16 * (bpiece ^ wk_swz<NWORD>(r1)) + boff;
#pragma unroll
        for (int w = 0; w < NWORD; ++w) { w0[w] = reinterpret_cast<const u32*>(p0)[w]; w1[w] = reinterpret_cast<const u32*>(p1)[w]; }
#pragma unroll
        for (int w = 0; w < NWORD; ++w) {
          const u32 v0 = w0[w], v0s = v0 >> 4, v1 = w1[w], v1s = v1 >> 4;
          // WSUB: the low nibbles at bits 3..6 of each byte, the high ones at 4..7
          const u32 lo0 = (v0 << 3) & 0x78787878u, hi0 = v0 & 0xF0F0F0F0u, lo1 = (v1 << 3) & 0x78787878u, hi1 = v1 & 0xF0F0F0F0u;
          u32 d0[4], d1[4];  // dequantized pairs of n-tile 4w + j: packed rows r0 (d0) and r1 (d1)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int nt = 4 * w + j;
            if (W4_PROBE & 4) {
              d0[j] = v0 ^ (u32)nt; d1[j] = v1 ^ (u32)nt;
            } else if (SUB) {  // the masks are made once per word (the compiler keeps them for the four j)
              d0[j] = dq_sub(v0 & 0x0F0F0F0Fu, (W4_SUB == 2 ? shr4_fma(v0) : v0s) & 0x0F0F0F0Fu, j);
              d1[j] = dq_sub(v1 & 0x0F0F0F0Fu, (W4_SUB == 2 ? shr4_fma(v1) : v1s) & 0x0F0F0F0Fu, j);
            } else if (FIX) {
              d0[j] = dq_raw<X>(v0, v0s, j); d1[j] = dq_raw<X>(v1, v1s, j);
            } else if (WSUB) {
              d0[j] = dq_wsub(lo0, hi0, j, s2[nt], nz[nt]); d1[j] = dq_wsub(lo1, hi1, j, s2[nt], nz[nt]);
            } else {
              dq_pair<X>(v0, v0s, v1, v1s, j, nz[nt], s2[nt], &d0[j], &d1[j]);
            }
          }
          if (W4_PROBE & 8) {
#pragma unroll
            for (int j = 0; j < 4; ++j) sink ^= d0[j] ^ d1[j];
          } else if (TR) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // A-tile p = 2w + h: columns g*NT + 2p (row g), + 1 (row g + 8)
              const u32 af[4] = {d0[2 * h], d0[2 * h + 1], d1[2 * h], d1[2 * h + 1]};
#pragma unroll
              for (int nb = 0; nb < MTA; ++nb)  // % NC: in bounds when !FIX
                O::mma(FIX ? accc[nb][(2 * w + h) % NC] : acc[nb][2 * w + h], af, a[stp][nb][0], a[stp][nb][2]);
            }
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int mt = 0; mt < MTA; ++mt) O::mma(acc[mt][4 * w + j], a[stp][mt], d0[j], d1[j]);
          }
        }
        if (FIX) {  // xsum[nb][e] = the chunk's sum of activation row 8*nb + 2t + (e & 1) so far (A all ones; SUB: all 2^-24)
          constexpr u32 ONE = SUB ? 0x00010001u : O::ONE;
          const u32 ones[4] = {ONE, ONE, ONE, ONE};
#pragma unroll
          for (int nb = 0; nb < MTA; ++nb) O::mma(xsum[nb], ones, a[stp][nb][0], a[stp][nb][2]);
        }
      }
      if (FIX) {  // acc[nb][p][e] (column g*NT + 2p + (e >> 1), batch row 8*nb + 2t + (e & 1)) += s * (sum - (MAGIC + z) * rowsum)
        const u16* sh = reinterpret_cast<const u16*>(st + WB) + g * NT;  // this lane's NT scales; its zeros BC later
        u32 szs[SZV ? NC : 1], szz[SZV ? NC : 1];  // W4_SZV: word p holds the halves 2p, 2p + 1
        if (SZV) {
#pragma unroll
          for (int q = 0; q < NC / 4; ++q) {
            const uint4 a4 = reinterpret_cast<const uint4*>(sh)[q], b4 = reinterpret_cast<const uint4*>(sh + BC)[q];
            szs[4 * q] = a4.x; szs[4 * q + 1] = a4.y; szs[4 * q + 2] = a4.z; szs[4 * q + 3] = a4.w;
            szz[4 * q] = b4.x; szz[4 * q + 1] = b4.y; szz[4 * q + 2] = b4.z; szz[4 * q + 3] = b4.w;
          }
        }
        // SUB: sum = 2^-24 sum(q x) and rowsum = 2^-24 sum(x) (the ones are 2^-24 too), so acc gathers 2^-24 s (sum(q x)
        // - z sum(x)), which the m-block's end multiplies by 2^24 (powers of two: exact in float32)
        auto fix = [&](int nbs) {  // batch rows 2t + b for b < nbs
#pragma unroll
          for (int p = 0; p < NC; ++p)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const u16 sv = SZV ? (u16)(szs[p % (SZV ? NC : 1)] >> (16 * c)) : sh[2 * p + c];
              const u16 zv = SZV ? (u16)(szz[p % (SZV ? NC : 1)] >> (16 * c)) : sh[BC + 2 * p + c];
              const float sc = h2f(sv), mz = SUB ? -h2f(zv) : -(O::MAGIC_F + h2f(zv));
#pragma unroll
              for (int nb = 0; nb < MTA; ++nb)
#pragma unroll
                for (int b = 0; b < nbs; ++b)
                  acc[nb][p][2 * c + b] = fmaf(sc, fmaf(mz, xsum[nb][b], accc[nb][p][2 * c + b]), acc[nb][p][2 * c + b]);
            }
        };
        if (W4_M1 && MTA == 1 && m1) fix(1);  // one activation row: batch row 2t + 1 is zero, never written out
        else fix(2);
      }
      if (XM > 0) {  // this warp's reads of the stage are done (values in registers): release it in the CN blocks
        __syncwarp();
        if (lane < CN) mbar_arrive_at(ebar + 8 * ((gb + i) % S), (u32)lane);
      }
    }
    if ((W4_PROBE & 8) && sink == 0x9E3779B9u) acc[0][0][0] = 1.f;
    if (SUB) {  // the sums were gathered in units of 2^-24 (the chunk loop's correction)
#pragma unroll
      for (int mt = 0; mt < MTA; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= 0x1p24f;
    }
    if (WSUB) {  // the sums were the products / 16 (dq_wsub); whether a scale of this warp's chunks was not taken
#pragma unroll
      for (int mt = 0; mt < MTA; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= 16.f;
      const bool big = __any_sync(0xffffffffu, (wk_chk & 0x7FFF7FFFu) != 0u);
      if (lane == 0) wk_flag[warp] = big ? 1u : 0u;  // read after the epilogue's first barrier
    }
    cp_async_wait<0>();
    if (W4_PROBE & 32) {
      float keep = 0.f;
#pragma unroll
      for (int mt = 0; mt < MTA; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) keep += acc[mt][nt][0] + acc[mt][nt][1] + acc[mt][nt][2] + acc[mt][nt][3];
      if (keep == 1234.5f) out[0] = 0;
      return;
    }
    static_assert(NS * 32 * 16 <= S * STAGE, "a warp's tile fits in its own stages");
    static_assert(NS * 32 * 16 <= MR * OW * 4, "a block's sum fits in the last tile");
    if constexpr (W4_EPI == 0 && CL == 1) {  // the earlier epilogue (probe builds)
      // the WK warps' tiles added in warp order in shared memory
      for (int w = 0; w < WK; ++w) {
        if (warp == w && TR) {
#pragma unroll
          for (int nb = 0; nb < MTA; ++nb)
#pragma unroll
            for (int p = 0; p < NT / 2; ++p)
#pragma unroll
              for (int e = 0; e < 4; ++e) {  // C[row = column g*NT + 2p + (e >> 1)][col = batch row 8*nb + 2t + (e & 1)]
                float* q = tile + (8 * nb + 2 * t + (e & 1)) * OW + g * NT + 2 * p + (e >> 1);
                *q = w == 0 ? acc[nb][p][e] : *q + acc[nb][p][e];
              }
        } else if (warp == w) {
#pragma unroll
          for (int mt = 0; mt < MTA; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                float* p = tile + (mt * 16 + g + (e >> 1) * 8) * OW + (2 * t + (e & 1)) * NT + nt;
                *p = w == 0 ? acc[mt][nt][e] : *p + acc[mt][nt][e];
              }
        }
        __syncthreads();
      }
      for (int idx = threadIdx.x; idx < mrows * (BC / 4); idx += WK * 32) {
        const int r = idx / (BC / 4), c = 4 * (idx % (BC / 4)), m = m0 + r;
        const float4 v = *reinterpret_cast<const float4*>(tile + r * OW + c);
        if (ksplit == 1) {
          *reinterpret_cast<uint2*>(out + (u64)m * N + col0 + c) =
              make_uint2((u32)O::from_f(v.x) | ((u32)O::from_f(v.y) << 16), (u32)O::from_f(v.z) | ((u32)O::from_f(v.w) << 16));
        } else {
          *reinterpret_cast<float4*>(partial + ((u64)blockIdx.y * M + m) * N + col0 + c) = v;
        }
      }
      __syncthreads();
    } else {
      // each warp's tile into its own stages (its copies are done: wait_group 0 above, then __syncwarp)
      __syncwarp();
      float4* mine = reinterpret_cast<float4*>(wsm);
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        const int q = s % NWORD;
        float4 v;
        if (TR) {
          const int b = (s / NWORD) % 2, nb = s / (2 * NWORD);
          v = make_float4(acc[nb][2 * q][b], acc[nb][2 * q][2 + b], acc[nb][2 * q + 1][b], acc[nb][2 * q + 1][2 + b]);
        } else {
          const int e = (s / NWORD) & 3, mt = s / (4 * NWORD);
          v = make_float4(acc[mt][4 * q][e], acc[mt][4 * q + 1][e], acc[mt][4 * q + 2][e], acc[mt][4 * q + 3][e]);
        }
        if (EDEAD) {
          int r, c;
          wk_slot<MT, NWORD>(s, lane, &r, &c);
          if (r >= mrows) continue;
        }
        mine[s * 32 + lane] = v;
      }
      __syncthreads();
      float4* bsum = reinterpret_cast<float4*>(tile);
      u32 prank = 0;  // push: this block's rank
      if (push) {
        // NOTE: order is important here: rank 0's mbarrier initialized and armed -> cluster barrier (arrived at the
        // start, waited for here) -> rank 1's block sum stored into rank 0's tile (st.async, complete_tx) -> rank 0
        // waits for the mbarrier's phase 0 (acquire) before it reads the tile
        cluster_wait();
        prank = cluster_rank();
        if (prank == 0) mbar_wait_cluster(rbar, 0u);
      }
      for (int s = warp; s < NS; s += WK) {
        if (EDEAD) {
          int r, c;
          wk_slot<MT, NWORD>(s, lane, &r, &c);
          if (r >= mrows) continue;
        }
        float4 v = reinterpret_cast<const float4*>(dsm)[s * 32 + lane];
#pragma unroll
        for (int w = 1; w < WK; ++w) add4(v, reinterpret_cast<const float4*>(dsm + w * (S * STAGE))[s * 32 + lane]);
        if (WSUB) {  // a flagged block's sums over its own chunks again, in float32
          u32 f = 0u;
#pragma unroll
          for (int w = 0; w < WK; ++w) f |= wk_flag[w];
          int r, c;
          wk_slot<MT, NWORD>(s, lane, &r, &c);
          if (f && r < mrows)
            v = w4_fix4_call<X>(x, qweight, scales, zeros, m0 + r, col0 + c, 64 * c_begin, 64 * c_end, K, N, group_rows);
        }
        if (push) {
          if (prank != 0) {
            st_async_f4(smem_addr(bsum + s * 32 + lane), v, rbar, 0u);
          } else {  // rank 0's sum, then rank 1's (the order the loads below add them in: the same bits)
            add4(v, bsum[s * 32 + lane]);
            int r, c;
            wk_slot<MT, NWORD>(s, lane, &r, &c);
            if (r < mrows) st_out4<X>(out + (u64)(m0 + r) * N + col0 + c, v);
          }
        } else if (CL > 1) {
          bsum[s * 32 + lane] = v;
        } else {
          int r, c;
          wk_slot<MT, NWORD>(s, lane, &r, &c);
          if (r < mrows) {
            if (ksplit == 1) st_out4<X>(out + (u64)(m0 + r) * N + col0 + c, v);
            else *reinterpret_cast<float4*>(partial + ((u64)blockIdx.y * M + m0 + r) * N + col0 + c) = v;
          }
        }
      }
      if (push) {
        // one m-block: done (rank 1's stores went to rank 0, which has written every output; no stage is reused)
      } else if (CL > 1) {
        // NOTE: order is important here: block sums written -> cluster barrier (release / acquire) -> reads
        // of the other blocks' sums -> cluster barrier (no block leaves or reuses its tile while one still reads)
        cluster_sync();
        const u32 rank = cluster_rank(), base = smem_addr(bsum);
        for (int idx = (int)rank * (WK * 32) + (int)threadIdx.x; idx < NS * 32; idx += CL * WK * 32) {
          float4 v = ld_cluster_f4(base + 16 * idx, 0);
#pragma unroll
          for (int rk = 1; rk < CL; ++rk) add4(v, ld_cluster_f4(base + 16 * idx, rk));
          int r, c;
          wk_slot<MT, NWORD>(idx >> 5, idx & 31, &r, &c);
          if (r < mrows) st_out4<X>(out + (u64)(m0 + r) * N + col0 + c, v);
        }
        cluster_sync();
      } else if (XM > 0) {
        // every warp's tile read, and the generic writes into the stages ordered before the next m-block's copies
        // (the CN blocks' bulk copies write them): proxy fence, then the cluster barrier
        fence_proxy_async();
        cluster_sync();
      } else {
        __syncthreads();  // every warp's tile read: the stages are reused by the next m-block
      }
    }
    if (XM > 0) gb += nloc;  // (XM == 0: every m-block starts at stage 0)
  }
  if (CL > 1 || ksplit == 1 || !last_of_split(counters, ksplit)) return;
  add_partials4<O>(partial, out, M, N, col0, BC, ksplit, WK * 32, counters);
}

template <class X, int MT, int NWORD, int WK, int S, int XSM>
__global__ void __launch_bounds__(WK * 32) w4a16_wk(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wk_body<X, MT, NWORD, WK, S, XSM, 1, 0>(x, qweight, scales, zeros, partial, counters, out, M, K, N, group_rows, cpb);
}

template <class X, int MT, int NWORD, int WK, int S, int XSM, int CL>
__global__ void __cluster_dims__(1, CL, 1) __launch_bounds__(WK * 32) w4a16_wkc(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wk_body<X, MT, NWORD, WK, S, XSM, CL, 0>(x, qweight, scales, zeros, partial, counters, out, M, K, N, group_rows, cpb);
}

// w4a16_wkm's activations packed by chunk: xp[mb][ch][r][72] (MR rows of 64 k per m-block mb and 64-k chunk ch, rows
// >= M zero), rows of 72 halves (the padded stage layout; halves 64..71 never written nor read): one contiguous
// MR*144-byte block per chunk, copied into shared memory as it is. One 16-byte piece per thread and step.
template <int MR>
__global__ void w4_xpack(const u16* __restrict__ x, u16* __restrict__ xp, int M, int K) {
  const long long nch = K >> 6, total = (long long)((M + MR - 1) / MR) * nch * MR * 8;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(i & 7), r = (int)((i >> 3) % MR);
    const long long blk = (i >> 3) / MR;  // mb * nch + ch
    const int ch = (int)(blk % nch), m = (int)(blk / nch) * MR + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (m < M) v = *reinterpret_cast<const uint4*>(x + (u64)m * K + ch * 64 + 8 * c);
    *reinterpret_cast<uint4*>(xp + ((u64)blk * MR + r) * 72 + 8 * c) = v;
  }
}

// w4a16_wkm: w4a16_wk (activations staged, no K split) reading the packed activations (w4_xpack) with
// __cluster_dims__(CN, 1, 1): the CN blocks of a cluster take CN neighbouring column slabs, and warp w of each takes the
// same chunks, so each activation chunk is fetched from L2 once per cluster instead of once per block: block r copies
// its share (ceil(mrows / CN) rows) of the chunk's rows < M with one bulk copy, multicast into warp w's stage in all CN
// blocks (CN = 1: one bulk copy of the rows, no cluster); per warp and stage a "full" mbarrier (expect_tx of mrows*144
// bytes) and an "empty" one (the CN blocks' warp w released the stage; their remote arrivals); weights, scales and zeros
// stay cp.async per warp. Grid (N / (32*NWORD), 1), N / (32*NWORD) % CN == 0; x: the packed buffer.
template <class X, int MT, int NWORD, int WK, int S, int CN>
__global__ void __cluster_dims__(CN, 1, 1) __launch_bounds__(WK * 32) w4a16_wkm(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wk_body<X, MT, NWORD, WK, S, 1, 1, CN>(x, qweight, scales, zeros, partial, counters, out, M, K, N, group_rows, cpb);
}
