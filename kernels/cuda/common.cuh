// Shared helpers for shmrpc kernels. Header-free on purpose (NVRTC, no include path):
// float16 and bfloat16 are handled as raw 16-bit words, converted with PTX / bit shifts.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                            // round to nearest even
  return (u16)(u >> 16);
}

// Element types: storage type T, load (T -> float), store (float -> T).
struct F16 { typedef u16 T; static __device__ __forceinline__ float load(u16 v) { return h2f(v); }
             static __device__ __forceinline__ u16 store(float f) { return f2h(f); } };
struct BF16 { typedef u16 T; static __device__ __forceinline__ float load(u16 v) { return b2f(v); }
              static __device__ __forceinline__ u16 store(float f) { return f2b(f); } };
struct F32 { typedef float T; static __device__ __forceinline__ float load(float v) { return v; }
             static __device__ __forceinline__ float store(float f) { return f; } };

// 16-byte read-only loads (weights) / loads that bypass L1 (data
// written by other blocks in this kernel).
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p)); return v;
}

// K split through float32 partials in global memory: each block of a column tile has written its partials; returns
// whether this block is the last of the tile to do so (counters[blockIdx.x]), the one that adds them up.
// NOTE: order is important here: partials written -> fence -> count; the last block fences again -> reads.
// Every thread of the block calls it (barriers inside).
__device__ __forceinline__ bool last_of_split(unsigned int* counters, int ksplit) {
  // thread 0's answer reaches the block through __syncthreads_or, not a __shared__ variable: static shared memory would
  // move the dynamic shared memory of the kernels that stage in it (w4a16_wk, w4a16_wkm) off 128-byte alignment, and
  // their copies would then take twice the L2 sectors and three times the shared-memory wavefronts (docs/kernels.md)
  __threadfence();
  __syncthreads();
  int last = 0;
  if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(ksplit - 1);
  if (!__syncthreads_or(last)) return false;
  __threadfence();
  return true;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); `sh` is __shared__ float[33].
__device__ __forceinline__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();  // sh may still be read by an earlier block_sum
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? sh[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) sh[32] = t;
  }
  __syncthreads();
  return sh[32];
}

// tanh-GELU as y * sigmoid(2u), u = sqrt(2/pi) (y + 0.044715 y^3): the same function as
// 0.5 y (1 + tanh(u)), without the cancellation of 1 + tanh(u) for negative y, and cheap:
// __expf is one MUFU ex2 plus a multiply (rel. error ~1e-6), so fp32 stays within its tolerance.
__device__ __forceinline__ float gelu_tanh(float y) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
  const float u = k0 * (y + k1 * y * y * y);
  return __fdividef(y, 1.f + __expf(-2.f * u));
}
