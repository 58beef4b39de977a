// Row-wise softmax over the last axis, float32 math, one block per row.
//
//   softmax_rows<X, V, NCH>: the row lives in registers (thread t holds NCH chunks of V contiguous
//     elements, chunk c at [(c*blockDim.x + t)*V, +V), as in layernorm_gelu.cu): one read and one
//     write of every element. Max, then sum of exp(x - max), then the scaled write.
//   softmax_online<X>: rows too long for registers. Pass 1 keeps a running (max, sum) per thread
//     (sum rescaled by exp(old_max - new_max) when the max grows), merged across the block; pass 2
//     reads the row again and writes exp(x - max) / sum. Two reads, one write.
// exp: __expf (ex2.approx; rel. error ~2^-21 near 0, growing ~|x - max| * 2^-24) for 16-bit outputs,
// expf for float32 outputs. All shape checks are on the host; no device-side assert.

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Max over the block (as block_sum); `sh` is __shared__ float[33].
__device__ __forceinline__ float block_max(float v, float* sh) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? sh[lane] : -__int_as_float(0x7f800000);
    t = warp_max(t);
    if (lane == 0) sh[32] = t;
  }
  __syncthreads();
  return sh[32];
}

template <class X>
__device__ __forceinline__ float sm_exp(float v) {
  return sizeof(typename X::T) == 2 ? __expf(v) : expf(v);
}

template <class X, int V, int NCH>
__global__ void __launch_bounds__(1024) softmax_rows(const typename X::T* __restrict__ x,
                                                     typename X::T* __restrict__ y, int D) {
  __shared__ float sh[33];
  const u64 row = blockIdx.x;
  const typename X::T* xr = x + row * (u64)D;
  typename X::T* yr = y + row * (u64)D;
  float v[NCH][V];
  float mx = -__int_as_float(0x7f800000);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * blockDim.x + threadIdx.x) * V;
    if (e < D) {
      if (V == 1) {
        v[c][0] = X::load(xr[e]);
      } else {
        const uint4 r = *reinterpret_cast<const uint4*>(xr + e);
        const typename X::T* t = reinterpret_cast<const typename X::T*>(&r);
#pragma unroll
        for (int i = 0; i < V; ++i) v[c][i] = X::load(t[i]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) mx = fmaxf(mx, v[c][i]);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) v[c][i] = -__int_as_float(0x7f800000);
    }
  }
  mx = block_max(mx, sh);
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < NCH; ++c)
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float ev = (c * blockDim.x + threadIdx.x) * V < D ? sm_exp<X>(v[c][i] - mx) : 0.f;
      v[c][i] = ev;
      s += ev;
    }
  const float inv = 1.f / block_sum(s, sh);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * blockDim.x + threadIdx.x) * V;
    if (e < D) {
      if (V == 1) {
        yr[e] = X::store(v[c][0] * inv);
      } else {
        uint4 r;
        typename X::T* t = reinterpret_cast<typename X::T*>(&r);
#pragma unroll
        for (int i = 0; i < V; ++i) t[i] = X::store(v[c][i] * inv);
        *reinterpret_cast<uint4*>(yr + e) = r;
      }
    }
  }
}

template <class X>
__global__ void __launch_bounds__(1024) softmax_online(const typename X::T* __restrict__ x,
                                                       typename X::T* __restrict__ y, int D) {
  __shared__ float shm[32], shs[32];
  __shared__ float tot[2];
  const u64 row = blockIdx.x;
  const typename X::T* xr = x + row * (u64)D;
  typename X::T* yr = y + row * (u64)D;
  float m = -__int_as_float(0x7f800000), s = 0.f;
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    const float v = X::load(xr[e]);
    if (v > m) { s = s * sm_exp<X>(m - v) + 1.f; m = v; }   // exp(-inf) = 0 on the first element
    else s += v == -__int_as_float(0x7f800000) ? 0.f : sm_exp<X>(v - m);  // NaN propagates
  }
  // merge (m, s) pairs: warp, then block
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    const float mm = fmaxf(m, m2);
    s = (m == -__int_as_float(0x7f800000) ? 0.f : s * sm_exp<X>(m - mm)) + (m2 == -__int_as_float(0x7f800000) ? 0.f : s2 * sm_exp<X>(m2 - mm));
    m = mm;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) { shm[warp] = m; shs[warp] = s; }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = -__int_as_float(0x7f800000);
    for (int w = 0; w < nwarps; ++w) bm = fmaxf(bm, shm[w]);
    float bs = 0.f;
    for (int w = 0; w < nwarps; ++w) bs += shm[w] == -__int_as_float(0x7f800000) ? 0.f : shs[w] * sm_exp<X>(shm[w] - bm);
    tot[0] = bm; tot[1] = 1.f / bs;
  }
  __syncthreads();
  const float bm = tot[0], inv = tot[1];
  (void)lane;
  for (int e = threadIdx.x; e < D; e += blockDim.x) yr[e] = X::store(sm_exp<X>(X::load(xr[e]) - bm) * inv);
}
