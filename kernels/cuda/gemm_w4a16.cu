// out (M, N) = x (M, K) @ dequant(qweight, scales, zeros), with int4 weights dequantized in
// registers (fp16 weights never exist in global memory) and fp32 accumulation.
//
// Packing (owned by quantize_int4): qweight (K/2, N) uint8 row-major,
//   qweight[r, n] = q[2r, n] | (q[2r+1, n] << 4)        low nibble = even k
// scales, zeros: (K/gs, N) float16, w[k, n] ~= (q[k, n] - zeros[k/gs, n]) * scales[k/gs, n].
// A packed row is contiguous along N, so consecutive threads read consecutive 16-byte chunks
// (16 columns x 2 k each): every warp-wide load is fully coalesced.
//
// Block: 256 threads = 8 column-threads (tx, 16 columns each: 128 columns) x 32 row-threads (ty).
// grid = (ceil(N/128), ksplit): blockIdx.y takes rows [y*rows_per_split, ...). Row-threads take
// runs of RUN=8 packed rows (16 k) round robin; a run never crosses a group (group rows % 8 == 0).
//
// Dequant trick: a nibble q moved to bits 16..19 of 0x3F800000 is the float 1 + q/128, one
// shift + one LOP3. Over a run, acc = sum x_k (1 + q_k/128), sx = sum x_k, so
//   sum x_k (q_k - z) s = s * (128 (acc - sx) - z sx).
// Partial sums: shuffles inside a warp, shared memory across the 8 warps; with ksplit > 1 each
// block writes fp32 partials and the last block of a column tile (atomic counter, threadfence)
// adds them in fixed order (deterministic) and resets the counter to 0 for the next launch.
// Host guarantees: N % 16 == 0, K % 16 == 0, gs % 16 == 0, 16-byte aligned contiguous arrays,
// counters[gridDim.x] zero on entry. No device-side asserts.

#define W4_RUN 8

__device__ __forceinline__ float nib(u32 v) { return __uint_as_float((v & 0x000F0000u) | 0x3F800000u); }

template <class X, int MB>
__global__ void __launch_bounds__(256) w4a16_gemm(
    const typename X::T* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, float* __restrict__ partial,
    unsigned int* __restrict__ counters, typename X::T* __restrict__ out,
    int M, int K, int N, int group_rows, int rows_per_split) {
  __shared__ float red[8][MB][128];
  __shared__ unsigned int is_last;
  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col0 = blockIdx.x * 128 + tx * 16;
  const bool col_ok = col0 < N;
  const int total_rows = K >> 1;
  const int row_begin = blockIdx.y * rows_per_split;
  const int row_end = min(row_begin + rows_per_split, total_rows);
  const int nruns = (row_end - row_begin) / W4_RUN;
  const int ksplit = gridDim.y;

  for (int m0 = 0; m0 < M; m0 += MB) {
    float res[MB][16];
#pragma unroll
    for (int mm = 0; mm < MB; ++mm)
#pragma unroll
      for (int c = 0; c < 16; ++c) res[mm][c] = 0.f;

    for (int run = ty; col_ok && run < nruns; run += 32) {
      const int row = row_begin + run * W4_RUN;
      uint4 w[W4_RUN];
#pragma unroll
      for (int i = 0; i < W4_RUN; ++i) w[i] = ld_nc_v4(qweight + (u64)(row + i) * N + col0);
      float acc[MB][16], sx[MB];
#pragma unroll
      for (int mm = 0; mm < MB; ++mm) {
        sx[mm] = 0.f;
#pragma unroll
        for (int c = 0; c < 16; ++c) acc[mm][c] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < W4_RUN; ++i) {
        float xe[MB], xo[MB];
#pragma unroll
        for (int mm = 0; mm < MB; ++mm) {
          const int m = m0 + mm;
          if (m < M) {
            const u32 xv = *reinterpret_cast<const u32*>(x + (u64)m * K + 2 * (row + i));
            xe[mm] = X::load((u16)(xv & 0xffffu));
            xo[mm] = X::load((u16)(xv >> 16));
          } else {
            xe[mm] = 0.f;
            xo[mm] = 0.f;
          }
          sx[mm] += xe[mm] + xo[mm];
        }
        const u32 words[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 v = words[j];  // byte b = column 4j+b: low nibble k even, high nibble k odd
          const float lo[4] = {nib(v << 16), nib(v << 8), nib(v), nib(v >> 8)};
          const float hi[4] = {nib(v << 12), nib(v << 4), nib(v >> 4), nib(v >> 12)};
#pragma unroll
          for (int mm = 0; mm < MB; ++mm)
#pragma unroll
            for (int b = 0; b < 4; ++b)
              acc[mm][4 * j + b] = fmaf(xo[mm], hi[b], fmaf(xe[mm], lo[b], acc[mm][4 * j + b]));
        }
      }
      const int g = row / group_rows;
      const uint4 s01 = ld_nc_v4(scales + (u64)g * N + col0), s23 = ld_nc_v4(scales + (u64)g * N + col0 + 8);
      const uint4 z01 = ld_nc_v4(zeros + (u64)g * N + col0), z23 = ld_nc_v4(zeros + (u64)g * N + col0 + 8);
      const u32 sw[8] = {s01.x, s01.y, s01.z, s01.w, s23.x, s23.y, s23.z, s23.w};
      const u32 zw[8] = {z01.x, z01.y, z01.z, z01.w, z23.x, z23.y, z23.z, z23.w};
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const float s = h2f((u16)(c & 1 ? sw[c >> 1] >> 16 : sw[c >> 1] & 0xffffu));
        const float z = h2f((u16)(c & 1 ? zw[c >> 1] >> 16 : zw[c >> 1] & 0xffffu));
#pragma unroll
        for (int mm = 0; mm < MB; ++mm) res[mm][c] += s * (128.f * (acc[mm][c] - sx[mm]) - z * sx[mm]);
      }
    }
    // the 4 row-threads of a warp share tx: lanes differ in bits 3 and 4
#pragma unroll
    for (int mm = 0; mm < MB; ++mm)
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        float v = res[mm][c];
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        res[mm][c] = v;
      }
    if (lane < 8) {
#pragma unroll
      for (int mm = 0; mm < MB; ++mm)
#pragma unroll
        for (int c = 0; c < 16; ++c) red[warp][mm][tx * 16 + c] = res[mm][c];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < MB * 128; idx += 256) {
      const int mm = idx >> 7, c = idx & 127, m = m0 + mm, col = blockIdx.x * 128 + c;
      float v = 0.f;
#pragma unroll
      for (int wi = 0; wi < 8; ++wi) v += red[wi][mm][c];
      if (m < M && col < N) {
        if (ksplit == 1) out[(u64)m * N + col] = X::store(v);
        else partial[((u64)blockIdx.y * M + m) * N + col] = v;
      }
    }
    __syncthreads();  // red is reused by the next m0
  }
  if (ksplit == 1) return;

  // NOTE: order is important here: partials written -> fence -> count; last block fences -> reads.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = (atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(ksplit - 1));
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < M * 128; idx += 256) {
    const int m = idx >> 7, col = blockIdx.x * 128 + (idx & 127);
    if (col < N) {
      float v = 0.f;
      for (int sp = 0; sp < ksplit; ++sp) v += ld_cg_f32(partial + ((u64)sp * M + m) * N + col);
      out[(u64)m * N + col] = X::store(v);
    }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}
