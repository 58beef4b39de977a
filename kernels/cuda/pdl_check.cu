// A kernel for checking programmatic dependent launches (tests/kernels/test_w4a16_pdl.py, bench/gpu/pdl_probe.py):
// it lets the next kernel of the stream launch at its start, as w4a16_wk does, then thread 0 of each block spins about
// `cycles` and every thread writes x[i] = v. A dependent kernel after it that did not wait (griddepcontrol.wait) would
// read x before it is written.
extern "C" __global__ void write_late(unsigned short* x, long long n, unsigned short v, long long cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (threadIdx.x == 0) { long long t0 = clock64(); while (clock64() - t0 < cycles) { } }
  __syncthreads();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) x[i] = v;
}
