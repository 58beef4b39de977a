// Row-wise LayerNorm, optionally fused with tanh-GELU: one block per row, one read and one
// write of every element of x (the row lives in registers between the passes).
//
//   y = gelu((x - mean) * rsqrt(var + eps) * gamma + beta)      statistics in fp32
//
// Thread t holds NCH chunks of V contiguous elements: chunk c covers elements
// [(c*blockDim.x + t)*V, +V). V*sizeof(T) == 16 (one 16-byte load) when D % V == 0, else V == 1.
// The host picks NCH >= ceil(D / (blockDim.x*V)); all shape checks are on the host, there is
// no device-side assert. Variance is two-pass (sum of squared deviations from the mean).
// Blocks have at most 512 threads (the host's rule); the launch bound says so, which leaves the compiler
// room for the NCH x V registers of the row (at 1024 the 4 x 8 floats of a 256-thread block spilled).

template <class X, int V>
__device__ __forceinline__ void load_vec(const typename X::T* p, float* f) {
  if (V == 1) {
    f[0] = X::load(p[0]);
  } else {
    uint4 r = *reinterpret_cast<const uint4*>(p);
    const typename X::T* t = reinterpret_cast<const typename X::T*>(&r);
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = X::load(t[i]);
  }
}

template <class X, int V>
__device__ __forceinline__ void store_vec(typename X::T* p, const float* f) {
  if (V == 1) {
    p[0] = X::store(f[0]);
  } else {
    uint4 r;
    typename X::T* t = reinterpret_cast<typename X::T*>(&r);
#pragma unroll
    for (int i = 0; i < V; ++i) t[i] = X::store(f[i]);
    *reinterpret_cast<uint4*>(p) = r;
  }
}

template <class X, int V, int NCH, bool GELU>
__global__ void __launch_bounds__(512) ln_rows(const typename X::T* __restrict__ x,
                                                const typename X::T* __restrict__ gamma,
                                                const typename X::T* __restrict__ beta,
                                                typename X::T* __restrict__ y, int D, float eps) {
  __shared__ float sh[33];
  const u64 row = blockIdx.x;
  const typename X::T* xr = x + row * (u64)D;
  typename X::T* yr = y + row * (u64)D;
  float v[NCH][V];
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * blockDim.x + threadIdx.x) * V;
    if (e < D) {
      load_vec<X, V>(xr + e, v[c]);
#pragma unroll
      for (int i = 0; i < V; ++i) s += v[c][i];
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) v[c][i] = 0.f;
    }
  }
  const float mean = block_sum(s, sh) / (float)D;
  float q = 0.f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * blockDim.x + threadIdx.x) * V;
    if (e < D) {
#pragma unroll
      for (int i = 0; i < V; ++i) { const float d = v[c][i] - mean; q += d * d; }
    }
  }
  const float rstd = rsqrtf(block_sum(q, sh) / (float)D + eps);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * blockDim.x + threadIdx.x) * V;
    if (e < D) {
      float g[V], b[V], o[V];
      load_vec<X, V>(gamma + e, g);
      load_vec<X, V>(beta + e, b);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float t = (v[c][i] - mean) * rstd * g[i] + b[i];
        o[i] = GELU ? gelu_tanh(t) : t;
      }
      store_vec<X, V>(yr + e, o);
    }
  }
}
