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
// and accumulates in float32.
// Work split: a chunk is 64 k (32 packed rows, 4 k16 steps, always inside one group: group size
// % 64 == 0); warp w of block (x, y) takes chunks [(y*WARPS + w)*cpw, +cpw) of column tile x.
// The next chunk's weights, scales and zeros are loaded (ld.global.nc) before the current one is
// computed. Warps of a block add their tiles in shared memory in a fixed order (stored in fragment
// order, so the adds are free of bank conflicts); with ksplit =
// gridDim.y > 1 the blocks' sums go to `partial` and the last block of a column tile (counter,
// fences, as in gemm_w4a16.cu) adds them in a fixed order and resets its counter.
// Host guarantees: N % BC == 0, K % 64 == 0, group_rows % 32 == 0, 16-byte aligned contiguous
// arrays, M <= 16*MT*ceil(M/(16*MT)) handled by looping m-blocks; no device-side assert.

template <class X> struct MmaOps;
template <> struct MmaOps<F16> {
  static constexpr u32 MAGIC = 0x64006400u, ONE = 0x3C003C00u;
  static __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
  }
  static __device__ __forceinline__ u16 from_f(float f) { return f2h(f); }
  static __device__ __forceinline__ float magic_f() { return 1024.f; }
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct MmaOps<BF16> {
  static constexpr u32 MAGIC = 0x43004300u, ONE = 0x3F803F80u;
  static __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
  }
  static __device__ __forceinline__ u16 from_f(float f) { return f2b(f); }
  static __device__ __forceinline__ float magic_f() { return 128.f; }
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

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

template <class X, int MT, int NWORD, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) w4a16_mma(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpw) {
  typedef MmaOps<X> O;
  constexpr int NT = 4 * NWORD, BC = 32 * NWORD, MR = 16 * MT;
  __shared__ float red[MR][BC];
  __shared__ unsigned int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.x * BC, colt = col0 + g * NT;
  const int n_chunks = K >> 6;
  const int c_begin = min((blockIdx.y * WARPS + warp) * cpw, n_chunks), c_end = min(c_begin + cpw, n_chunks);
  const int ksplit = gridDim.y;
  const u32* x32 = reinterpret_cast<const u32*>(x);
  const int k32 = K >> 1;  // x row length in 32-bit words

  for (int m0 = 0; m0 < M; m0 += MR) {
    for (int i = threadIdx.x; i < MR * BC; i += WARPS * 32) (&red[0][0])[i] = 0.f;
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

    u32 wc[4][2][NWORD], sc[NT / 2], zc[NT / 2];
    auto load_chunk = [&](int ch, u32 (&w)[4][2][NWORD], u32* s, u32* z) {
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
    if (c_begin < c_end) load_chunk(c_begin, wc, sc, zc);
    for (int ch = c_begin; ch < c_end; ++ch) {
      u32 wn[4][2][NWORD], sn[NT / 2], zn[NT / 2];
      if (ch + 1 < c_end) load_chunk(ch + 1, wn, sn, zn);
      u32 a[MT][4][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int ma = m0 + mt * 16 + g, mb = ma + 8;
#pragma unroll
        for (int st = 0; st < 4; ++st) {
          const int kw = ch * 32 + st * 8 + t;
          a[mt][st][0] = ma < M ? x32[(u64)ma * k32 + kw] : 0u;
          a[mt][st][1] = mb < M ? x32[(u64)mb * k32 + kw] : 0u;
          a[mt][st][2] = ma < M ? x32[(u64)ma * k32 + kw + 4] : 0u;
          a[mt][st][3] = mb < M ? x32[(u64)mb * k32 + kw + 4] : 0u;
        }
      }
      // per column: s2 = {s, s}, nz = {-(magic + z), -(magic + z)} in X
      u32 s2[NT], nz[NT];
#pragma unroll
      for (int c = 0; c < NT; ++c) {
        const u16 sh = (u16)(c & 1 ? sc[c >> 1] >> 16 : sc[c >> 1] & 0xffffu);
        const u16 zh = (u16)(c & 1 ? zc[c >> 1] >> 16 : zc[c >> 1] & 0xffffu);
        const u16 sx = O::from_f(h2f(sh)), zx = O::from_f(-(O::magic_f() + h2f(zh)));
        s2[c] = (u32)sx | ((u32)sx << 16);
        nz[c] = (u32)zx | ((u32)zx << 16);
      }
#pragma unroll
      for (int st = 0; st < 4; ++st) {
#pragma unroll
        for (int w = 0; w < NWORD; ++w) {
          const u32 v0 = wc[st][0][w], v0s = v0 >> 4, v1 = wc[st][1][w], v1s = v1 >> 4;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int nt = 4 * w + j;
            const u32 sel = (u32)(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12));
            const u32 t0 = (__byte_perm(v0, v0s, sel) & 0x000F000Fu) | O::MAGIC;
            const u32 t1 = (__byte_perm(v1, v1s, sel) & 0x000F000Fu) | O::MAGIC;
            const u32 b0 = O::fma2(O::fma2(t0, O::ONE, nz[nt]), s2[nt], 0x80008000u);
            const u32 b1 = O::fma2(O::fma2(t1, O::ONE, nz[nt]), s2[nt], 0x80008000u);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) O::mma(acc[mt][nt], a[mt][st], b0, b1);
          }
        }
      }
      if (ch + 1 < c_end) {
#pragma unroll
        for (int st = 0; st < 4; ++st)
#pragma unroll
          for (int w = 0; w < NWORD; ++w) { wc[st][0][w] = wn[st][0][w]; wc[st][1][w] = wn[st][1][w]; }
#pragma unroll
        for (int c = 0; c < NT / 2; ++c) { sc[c] = sn[c]; zc[c] = zn[c]; }
      }
    }
    __syncthreads();  // red zeroed
    // red in fragment order, [((mt*NT + nt)*4 + e)*32 + lane]: each warp's adds are conflict-free
    float* rf = &red[0][0];
    for (int wi = 0; wi < WARPS; ++wi) {
      if (warp == wi && c_begin < c_end) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) rf[((mt * NT + nt) * 4 + e) * 32 + lane] += acc[mt][nt][e];
      }
      __syncthreads();
    }
    for (int idx = threadIdx.x; idx < MR * BC; idx += WARPS * 32) {
      const int ln = idx & 31, e = (idx >> 5) & 3, nt = (idx >> 7) % NT, mt = (idx >> 7) / NT;
      const int m = m0 + mt * 16 + (ln >> 2) + (e >> 1) * 8, c = (2 * (ln & 3) + (e & 1)) * NT + nt;
      if (m < M) {
        if (ksplit == 1) out[(u64)m * N + col0 + c] = O::from_f(rf[idx]);
        else partial[((u64)blockIdx.y * M + m) * N + col0 + c] = rf[idx];
      }
    }
    __syncthreads();
  }
  if (ksplit == 1) return;
  // partials written -> fence -> count; the last block of the column tile fences -> reads.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = (atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(ksplit - 1));
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < M * BC; idx += WARPS * 32) {
    const int m = idx / BC, col = col0 + idx % BC;
    float v = 0.f;
    for (int sp = 0; sp < ksplit; ++sp) v += ld_cg_f32(partial + ((u64)sp * M + m) * N + col);
    out[(u64)m * N + col] = O::from_f(v);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}
