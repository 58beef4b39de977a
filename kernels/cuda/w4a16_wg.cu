// w4a16_wg: out (M, N) = x (M, K) @ dequant(qweight, scales, zeros) on Hopper's warpgroup tensor-core instruction
// (wgmma.mma_async, sm_90a), built as its own module after w4a16_mma.cu (whose helpers it uses) with -arch=sm_90a.
// The operands are swapped as in w4a16_wk at MT = 0: out^T = W^T x^T. The dequantized weights are the A operand, from
// registers (64 columns x 16 k per instruction: 16 per warp, each warp its own columns), and the activations are B,
// read by the instruction from shared memory (NB rows x 16 k, NB = 16*MT, or 8 at MT = 0): one wgmma per A-tile and
// k16 step multiplies 64 weight columns by all NB activation rows.
// Block: one warpgroup (4 warps; w4a16_wgm: four, at the end). Warp w owns the BC = 32*NWORD columns [col0 + w*BC,
// +BC), read as in w4a16_wk: a lane's words of a packed row hold its n-tiles, A-tile p (p < 2*NWORD) of a lane is
// bytes 2p & 3 and (2p & 3) + 1 of word p / 2, i.e. columns g*NT + 2p (row g) and g*NT + 2p + 1 (row g + 8),
// dequantized with the zero and the scale per pair (bfloat16: dq_pair: PRMT, LOP3, HFMA2, HMUL2; the weights rounded
// once to the input type, as at MT >= 1; float16: dq_wsub, PRMT and HFMA2, below). The 4 warps' A-tile p together
// are the 64 rows of wgmma p; its accumulators (NB/2 float32 per lane) are the warp's own.
// A chunk is 64 k. The block takes chunks [y*cpb, +cpb) (K split: w4a16_wgc, a cluster of CL blocks along y, adds its
// sums through distributed shared memory as w4a16_wkc; w4a16_wg: CL = 1, no split). S stages in shared memory, filled
// by cp.async: per stage [x: NB rows of 128 bytes, 16-byte piece c of row r at c ^ (r & 7): the 128-byte swizzle
// wgmma reads, 1024-byte aligned][weights: 4 warps x 32 packed rows x BC bytes, swizzled as w4a16_wk][scales, zeros:
// 4 warps x 4*BC bytes].
// Chunk i + S - 2 is copied into its stage after the block barrier of chunk i: every warp has then waited for all but
// the last wgmma group of chunk i - 1, so no instruction still reads stage (i - 2) % S. Per k16 step: wait until at
// most one wgmma group is in flight (the A registers of two steps ago are free), dequantize 2*NWORD A-tiles, fence,
// 2*NWORD wgmma, commit. Copies of x: thread t the piece t % 8 of rows t / 8 + 16*i; rows >= M zero (written once per
// m-block, never copied).
// Host guarantees: N % (128*NWORD) == 0, K % 64 == 0, group_rows % 32 == 0, 16-byte aligned contiguous arrays; M > NB
// runs as several m-blocks (the weights read again); no device-side assert. Dynamic shared memory: max(S*STAGE,
// NB*(128*NWORD + 4)*4) + 1024 bytes (_wg_smem on the host); w4a16_wgm (four warpgroups, each as one such block on its
// own K slice, at the end) four times that, less 3072.
// The second cluster barrier of w4a16_wgc's epilogue (W4_WGEPI) arrives without release: it only keeps every tile alive
// until all ranks have read it, and a release there waited for this block's output stores to complete (MEMBAR.ALL.GPU).

#ifndef W4_WGEPI
#define W4_WGEPI 1
#endif
#ifndef W4_WGOFF
#define W4_WGOFF 1  // the copies' sources as 32-bit offsets from the arrays' bases (fewer 64-bit values in the loop;
                    // the host takes w4a16_wg only where they reach: _wg_offsets_fit)
#endif
#ifndef W4_WGCP
#define W4_WGCP 1  // a chunk's copies in one run of instructions, the scales' and x's predicated instead of branched to,
                   // the scales' group by a multiply-high (0: probe builds only)
#endif
#ifndef W4_WGDS
#define W4_WGDS 1  // the k16 steps' wgmma descriptors from the chunk's low word plus an offset (0: probe builds only)
#endif
#ifndef W4_WGLB
#define W4_WGLB 1  // the blocks per SM that the shared memory allows (4 at most) asked of ptxas at NWORD 1 (__launch_bounds__)
#endif
#ifndef W4_WGSUB
#define W4_WGSUB 1  // float16: the weights through subnormals, two instructions per register (dq_wsub); 0: dq_pair's four
#endif

// W4_WGSUB (float16): a packed word's low nibbles moved to bits 3..6 of each byte (lo = (v << 3) & 0x78787878) and
// its high nibbles left at bits 4..7 (hi = v & 0xF0F0F0F0); one PRMT per pair takes byte j of each into the low byte of
// a half and fills the high bytes with the sign of lo's byte j, which is 0: the halves are the float16 subnormals
// q_lo * 2^-21 and q_hi * 2^-20, exact. One HFMA2 with ss = {s * 2^17, s * 2^16} (exact: powers of two, at most
// 65504 while |s| < 0.5) and zs = -z * s / 16 (rounded once) gives (q - z) * s / 16, rounded once more: the float32
// sums are the products / 16, and the epilogue multiplies them by 16 (exact). The weight's error: half a unit in the
// last place of z * s and of (q - z) * s, and where (q - z) * s / 16 is under float16's normal range (|(q - z) * s| <
// 2^-10) at most 2^-21 (half the subnormal step, times 16). Where a column tile has a scale of 0.5 or more in magnitude
// along K, or one not finite (each warp of the first warpgroup scans its columns' scales over the whole of K before
// its first chunk: wg_big, a flag per warp in shared memory), the loop runs as it is and its sums for those columns
// are wrong; the threads that store those columns' outputs compute them again instead, over the whole of K in float32
// on CUDA cores from the global arrays (w4_fix4: slow, for scales no quantizer of int4 weights makes), and store those.
// Nothing of that is held across the loop: a register more there, a second loop in the kernel, or a call after it made
// the loop slower than with dq_pair.

// W4_WGSUB: whether a scale of this lane's share of the warp's BC columns from col, in the quant groups of chunks
// [c0, c0 + n), is 0.5 or more in magnitude, or not finite. A row of a group's BC scales is read by BC / 8 lanes,
// 16 bytes each; per half, |s| + 2^-5 (as bits: + 0x0800) reaches 2 (bit 14) or passes inf (bit 15).
template <int BC>
__device__ __forceinline__ bool wg_big(const u16* __restrict__ scales, int N, int col, int c0, int n, int cpg, int lane) {
  constexpr int LPG = BC / 8, GPP = 32 / LPG;  // lanes per group's row, rows per pass
  u32 big = 0u;
  if (n > 0) {
    const int g1 = (c0 + n - 1) / cpg;
    for (int gi = c0 / cpg + lane / LPG; gi <= g1; gi += GPP) {
      const uint4 v = *reinterpret_cast<const uint4*>(scales + (u64)gi * (u64)N + col + 8 * (lane % LPG));
      big |= ((v.x & 0x7FFF7FFFu) + 0x08000800u) | ((v.y & 0x7FFF7FFFu) + 0x08000800u) |
             ((v.z & 0x7FFF7FFFu) + 0x08000800u) | ((v.w & 0x7FFF7FFFu) + 0x08000800u);
    }
  }
  return (big & 0xC000C000u) != 0u;
}

// The blocks of MT, NWORD, S that fit an SM (228 KiB of shared memory, 1 KiB of it reserved per block), at most 4 (128
// threads of 128 registers each fill the register file): at NWORD 1 ptxas is held to that many, so that the registers
// never cost a block per SM (the loop's allocation sits at 128, and one more register would make it 3 blocks).
template <int MT, int NWORD, int S>
struct WgFit {  // SMEM: the host's _wg_smem
  static constexpr int NB = MT ? 16 * MT : 8, BC = 32 * NWORD;
  static constexpr int STAGE = (NB * 128 + 4 * 32 * BC + 4 * 4 * BC + 1023) / 1024 * 1024, TILE = NB * (4 * BC + 4) * 4;
  static constexpr int SMEM = (S * STAGE > TILE ? S * STAGE : TILE) + 1024, BY_SMEM = (228 * 1024) / (SMEM + 1024);
  static constexpr int BLOCKS = W4_WGLB && NWORD == 1 ? (BY_SMEM < 4 ? BY_SMEM : 4) : 1;
};

// cp.async of 16 bytes when p holds (a predicated instruction: no branch around it)
__device__ __forceinline__ void cp_async16_if(u32 dst, const void* src, bool p) {
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q cp.async.cg.shared.global [%0], [%1], 16;\n\t}"
               :: "r"(dst), "l"(src), "r"((int)p));
}

template <class X, int NB> __device__ __forceinline__ void wg_mma(float* d, const u32* a, u64 desc);
// One wgmma.mma_async m64nNBk16 (float32 accumulators d[NB/2], A = the four registers a, B = the descriptor), per input
// type: W4_WG_ASM(NB, type) is the instruction's text, W4_WG_D(NB) its accumulator operands.
#define W4_WG_ASM8(T) "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %9, 0;\n\twgmma.mma_async.sync.aligned.m64n8k16.f32." T "." T \
  " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n\t}"
#define W4_WG_D8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define W4_WG_ASM16(T) "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %13, 0;\n\twgmma.mma_async.sync.aligned.m64n16k16.f32." T "." T \
  " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n\t}"
#define W4_WG_D16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define W4_WG_ASM32(T) "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %21, 0;\n\twgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n\t}"
#define W4_WG_D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define W4_WG_ASM64(T) "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\twgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n\t}"
#define W4_WG_D64 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define W4_WG_MMA(NB)                                                                                            \
  template <> __device__ __forceinline__ void wg_mma<F16, NB>(float* d, const u32* a, u64 desc) {                      \
    asm volatile(W4_WG_ASM##NB("f16") : W4_WG_D##NB : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)); \
  }                                                                                                                     \
  template <> __device__ __forceinline__ void wg_mma<BF16, NB>(float* d, const u32* a, u64 desc) {                     \
    asm volatile(W4_WG_ASM##NB("bf16") : W4_WG_D##NB : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)); \
  }
W4_WG_MMA(8)
W4_WG_MMA(16)
W4_WG_MMA(32)
W4_WG_MMA(64)


__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
template <int NA>
__device__ __forceinline__ void wg_keep(float* d) {  // the accumulators not moved across the asynchronous instructions
#pragma unroll
  for (int i = 0; i < NA; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// The shared-memory matrix descriptor of B: K-major rows of 128 bytes with the 128-byte swizzle, 8-row groups 1024
// bytes apart; `addr` 1024-byte aligned plus the k16 step's 32-byte offset inside the row.
__device__ __forceinline__ u64 wg_desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
// The same descriptor from its low word (W4_WGDS): a stage's k16 step stp is the stage's low word plus 2*stp (its
// 32-byte offset in 16-byte units; shared addresses stay under 2^18, so the field never carries into bit 16).
__device__ __forceinline__ u32 wg_desc_lo(u32 addr) { return ((addr & 0x3FFFF) >> 4) | (1u << 16); }
__device__ __forceinline__ u64 wg_desc_of(u32 lo) { return ((u64)((1024 >> 4) | (1u << 30)) << 32) | lo; }

template <class X, int MT, int NWORD, int S, int CL, int W = 1, bool SP = false>
__device__ __forceinline__ void wg_body(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  typedef MmaOps<X> O;
  constexpr int NB = MT ? 16 * MT : 8, NA = NB / 2, NT = 4 * NWORD, BC = 32 * NWORD, NP = 2 * NWORD;
  constexpr int XB = NB * 128, WB = 32 * BC, SZB = 4 * BC;
  constexpr int STAGE = (XB + 4 * WB + 4 * SZB + 1023) / 1024 * 1024;
  constexpr int BCB = 4 * BC, OW = BCB + 4;  // the block's columns; the float32 tile's row stride
  static_assert(S >= 3, "chunk i + S - 2 is refilled while chunk i is read");
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ u32 wg_flag[4];  // W4_WGSUB: per warp of a column tile, whether wg_big found a scale dq_wsub cannot take
  constexpr int WGB = S * STAGE;  // a warpgroup's stages (w4a16_wgm: warpgroup w's at w * WGB)
  static_assert(W == 1 || WGB >= NB * OW * 4, "a warpgroup's float32 tile fits in its stages");
  // W warpgroups per block (w4a16_wgm): warpgroup wg takes the block's K slice wg, with its own S stages; its index
  // through a shuffle from lane 0, so that ptxas keeps what derives from it (the stages' addresses, the wgmma
  // descriptors) in uniform registers
  const int tid = W > 1 ? (int)threadIdx.x & 127 : (int)threadIdx.x;
  const int wg = W > 1 ? __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0) : 0;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const u32 base0 = (smem_addr(dsm) + 1023u) & ~1023u;  // the stages, 1024-byte aligned (the host adds 1024 bytes)
  const u32 base = base0 + (u32)(wg * WGB);
  unsigned char* const bsm = dsm + (base - smem_addr(dsm));
  const int col0 = blockIdx.x * BCB, wcol = col0 + warp * BC;
  const int n_chunks = K >> 6;
  const int c_begin = min(((int)blockIdx.y * W + wg) * cpb, n_chunks), n = min(c_begin + cpb, n_chunks) - c_begin;
  // this lane's weight copies (as w4a16_wk): piece lc16 of rows lrow + i*RPI of the warp's slab
  constexpr int NPC = BC / 16, RPI = 32 / NPC;
  const int lrow = lane / NPC, lc16 = lane % NPC;
  const u32 w_dst = (u32)(XB + warp * WB + lrow * BC + 16 * (lc16 ^ wk_swz<NWORD>(lrow)));
#if !W4_WGOFF
  const unsigned char* w_src = qweight + (u64)lrow * N + wcol + 16 * lc16;
  const u64 w_chunk = 32ull * (u64)N, w_piece = (u64)RPI * (u64)N;
#endif
  // this thread's x copies: piece xc of rows xr + 16*i (i < XP), all at the same swizzled piece (16*i keeps r & 7)
  constexpr int XP = NB >= 16 ? NB / 16 : 1;
  const int xr = tid >> 3, xc = tid & 7;
  const u32 x_dst = (u32)(xr * 128 + 16 * (xc ^ (xr & 7)));
#if !W4_WGOFF
  const u64 x_pass = 16ull * (u64)K;
#endif
  const bool sz_lane = lane < BC / 4;
  const int sz_which = lane / (BC / 8), sz_off = lane % (BC / 8);
  const u16* sz_src = (sz_which ? zeros : scales) + wcol + 8 * sz_off;
  const u32 sz_dst = (u32)(XB + 4 * WB + warp * SZB + sz_which * 2 * BC + 16 * sz_off);
  const int cpg = group_rows >> 5, cpg_shift = (cpg & (cpg - 1)) == 0 ? __ffs(cpg) - 1 : -1;
  const int bpiece = (g * NT) >> 4, boff = (g * NT) & 15;
  pdl_begin();

  for (int m0 = 0; m0 < M; m0 += NB) {
    const int mrows = min(NB, M - m0);
    for (int s = 0; s < S; ++s)  // rows >= mrows of x zero in every stage (the copies only write rows < mrows)
      for (int i = tid; i < (NB - mrows) * 32; i += 128) reinterpret_cast<u32*>(bsm + s * STAGE + mrows * 128)[i] = 0u;
    fence_proxy_async();  // those stores visible to the wgmma's reads (after the first chunk's barrier)
#if W4_WGOFF
    // 32-bit offsets of this thread's copies of chunk 0 (elements of x, bytes of qweight, elements of the scales),
    // added to the arrays' bases per copy (the host keeps each array's offsets under 2^32: _wg_offsets_fit)
    const u32 x_o = (u32)(m0 + xr) * (u32)K + 8u * (u32)xc, w_o = (u32)lrow * (u32)N + (u32)(wcol + 16 * lc16);
    const u32 uN = (u32)N, uK = (u32)K;
#if W4_WGCP
    // the chunk's group of the scales: floor(ch / cpg) = the high word of 2*ch times ceil(2^31 / cpg) (exact while
    // ch < 2^31 / cpg); the x rows this thread copies that lie in the m-block: i < xn
    const u32 g_mul = (0x80000000u + (u32)cpg - 1u) / (u32)cpg;
    const int xn = min(XP, max(0, (mrows - xr + 15) >> 4));
#endif
    auto issue = [&](int j) {  // chunk j of the block into stage j % S
      const u32 ch = (u32)(c_begin + j);
      const u32 st = base + (u32)((j % S) * STAGE);
      const u32 wo = w_o + ch * 32u * uN;
#if W4_WGCP
      // every copy of the chunk in one run of instructions, those of some lanes predicated (no branch)
      const u32 xo = x_o + ch * 64u;
#pragma unroll
      for (int i = 0; i < NPC; ++i) cp_async16_s(st + w_dst + (u32)(i * RPI * BC), qweight + (wo + (u32)(i * RPI) * uN));
      cp_async16_if(st + sz_dst, sz_src + __umulhi(2u * ch, g_mul) * uN, sz_lane);
#pragma unroll
      for (int i = 0; i < XP; ++i) cp_async16_if(st + x_dst + (u32)(i * 2048), x + (xo + (u32)(16 * i) * uK), i < xn);
#else
#pragma unroll
      for (int i = 0; i < NPC; ++i) cp_async16_s(st + w_dst + (u32)(i * RPI * BC), qweight + (wo + (u32)(i * RPI) * uN));
      if (sz_lane)
        cp_async16_s(st + sz_dst, sz_src + (cpg_shift >= 0 ? ch >> cpg_shift : ch / (u32)cpg) * uN);
      const u32 xo = x_o + ch * 64u;
#pragma unroll
      for (int i = 0; i < XP; ++i)
        if (xr + 16 * i < mrows) cp_async16_s(st + x_dst + (u32)(i * 2048), x + (xo + (u32)(16 * i) * uK));
#endif
    };
#else
    const u16* x_src = x + (u64)(m0 + xr) * K + 8 * xc;
    auto issue = [&](int j) {  // chunk j of the block into stage j % S
      const int ch = c_begin + j;
      const u32 st = base + (u32)((j % S) * STAGE);
      const unsigned char* wsrc = w_src + (u64)ch * w_chunk;
#pragma unroll
      for (int i = 0; i < NPC; ++i) cp_async16_s(st + w_dst + (u32)(i * RPI * BC), wsrc + (u64)i * w_piece);
      if (sz_lane) cp_async16_s(st + sz_dst, sz_src + (u64)(cpg_shift >= 0 ? ch >> cpg_shift : ch / cpg) * N);
      const u16* xs = x_src + ch * 64;
#pragma unroll
      for (int i = 0; i < XP; ++i)
        if (xr + 16 * i < mrows) cp_async16_s(st + x_dst + (u32)(i * 2048), xs + (u64)i * x_pass);
    };
#endif
    float acc[NP][NA];
#pragma unroll
    for (int p = 0; p < NP; ++p)
#pragma unroll
      for (int i = 0; i < NA; ++i) acc[p][i] = 0.f;
#pragma unroll
    for (int s = 0; s < S - 2; ++s) {
      if (s < n) issue(s);
      cp_async_commit();
    }
    // dq_wsub (SP): whether this warp's columns have a scale along K it cannot take (wg_big over all of K, by the
    // first warpgroup; read where the outputs are stored)
    if (SP && m0 == 0 && wg == 0) {
      const bool big = __any_sync(0xffffffffu, wg_big<BC>(scales, N, wcol, 0, n_chunks, cpg, lane));
      if (lane == 0) wg_flag[warp] = big ? 1u : 0u;
    }
    u32 af[2][NP][4];
    for (int i = 0; i < n; ++i) {
      cp_async_wait<S - 3>();  // chunk i's copies landed (cp.async writes need no proxy fence for the wgmma's reads)
      if (W > 1) asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");  // the warpgroup's own barrier
      else __syncthreads();
      if (i + S - 2 < n) issue(i + S - 2);
      cp_async_commit();
      const unsigned char* st = bsm + (i % S) * STAGE;
      const u32* szw = reinterpret_cast<const u32*>(st + XB + 4 * WB + warp * SZB + g * NT * 2);
      u32 s2[NT], nz[NT];
#pragma unroll
      for (int c = 0; c < NT; c += 2) {
        if (SP) sz_wsub(szw[c >> 1], szw[(BC / 2) + (c >> 1)], s2 + c, nz + c);  // {s * 2^17, s * 2^16}, -z * s / 16
        else O::sz(szw[c >> 1], szw[(BC / 2) + (c >> 1)], s2 + c, nz + c);
      }
      const unsigned char* wst = st + XB + warp * WB;
#if W4_WGDS
      const u32 dlo = wg_desc_lo(base + (u32)((i % S) * STAGE));
#endif
#pragma unroll
      for (int stp = 0; stp < 4; ++stp) {
        const int r0 = 8 * stp + t, r1 = r0 + 4;
        u32 w0[NWORD], w1[NWORD];
        const unsigned char* p0 = wst + r0 * BC + 16 * (bpiece ^ wk_swz<NWORD>(r0)) + boff;
        const unsigned char* p1 = wst + r1 * BC + 16 * (bpiece ^ wk_swz<NWORD>(r1)) + boff;
#pragma unroll
        for (int w = 0; w < NWORD; ++w) { w0[w] = reinterpret_cast<const u32*>(p0)[w]; w1[w] = reinterpret_cast<const u32*>(p1)[w]; }
        wg_wait<1>();  // the group of two steps ago is done: its A registers may be written
        u32 (&a)[NP][4] = af[stp & 1];
#pragma unroll
        for (int w = 0; w < NWORD; ++w) {
          u32 d0[4], d1[4];
          if (SP) {
            const u32 lo0 = (w0[w] << 3) & 0x78787878u, hi0 = w0[w] & 0xF0F0F0F0u;
            const u32 lo1 = (w1[w] << 3) & 0x78787878u, hi1 = w1[w] & 0xF0F0F0F0u;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              d0[j] = dq_wsub(lo0, hi0, j, s2[4 * w + j], nz[4 * w + j]);
              d1[j] = dq_wsub(lo1, hi1, j, s2[4 * w + j], nz[4 * w + j]);
            }
          } else {
            const u32 v0 = w0[w], v0s = v0 >> 4, v1 = w1[w], v1s = v1 >> 4;
#pragma unroll
            for (int j = 0; j < 4; ++j) dq_pair<X>(v0, v0s, v1, v1s, j, nz[4 * w + j], s2[4 * w + j], &d0[j], &d1[j]);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // A-tile 2w + h: rows g / g + 8 = columns g*NT + 2p / + 1, k low / high
            a[2 * w + h][0] = d0[2 * h]; a[2 * w + h][1] = d0[2 * h + 1];
            a[2 * w + h][2] = d1[2 * h]; a[2 * w + h][3] = d1[2 * h + 1];
          }
        }
        wg_fence();
#if W4_WGDS
        const u64 desc = wg_desc_of(dlo + 2u * (u32)stp);
#else
        const u64 desc = wg_desc(base + (u32)((i % S) * STAGE + 32 * stp));
#endif
#pragma unroll
        for (int p = 0; p < NP; ++p) wg_mma<X, NB>(acc[p], a[p], desc);
        wg_commit();
      }
    }
    wg_wait<0>();
#pragma unroll
    for (int p = 0; p < NP; ++p) wg_keep<NA>(acc[p]);
    cp_async_wait<0>();
    __syncthreads();  // every warp done with the stages: they hold the block's float32 tile [NB rows][OW] now
    float* tile = reinterpret_cast<float*>(bsm);
    // acc[p][4j + e]: weight column warp*BC + g*NT + 2p + (e >> 1), activation row 8j + 2t + (e & 1)
#pragma unroll
    for (int p = 0; p < NP; ++p)
#pragma unroll
      for (int i = 0; i < NA; ++i)
        tile[(8 * (i >> 2) + 2 * t + (i & 1)) * OW + warp * BC + g * NT + 2 * p + ((i >> 1) & 1)] =
            SP ? 16.f * acc[p][i] : acc[p][i];  // dq_wsub: the sums were the products / 16
    constexpr int T = 128 * W;  // the block's threads
    const int btid = threadIdx.x;
    float* const tile0 = reinterpret_cast<float*>(dsm + (base0 - smem_addr(dsm)));
    if (W > 1) {  // the warpgroups' tiles added into the first, in warpgroup order
      __syncthreads();
      for (int idx = btid; idx < mrows * (BCB / 4); idx += T) {
        const int r = idx / (BCB / 4), c = 4 * (idx % (BCB / 4));
        float4 v = *reinterpret_cast<const float4*>(tile0 + r * OW + c);
#pragma unroll
        for (int w = 1; w < W; ++w)
          add4(v, *reinterpret_cast<const float4*>(tile0 + w * (WGB / 4) + r * OW + c));
        *reinterpret_cast<float4*>(tile0 + r * OW + c) = v;
      }
    }
    if (CL > 1) {
      // NOTE: order is important here: tiles written -> cluster barrier -> reads of every block's tile -> cluster
      // barrier (no block reuses or leaves its tile while another still reads it)
      cluster_sync();
      const u32 rank = cluster_rank(), tb = smem_addr(tile0);
      for (int idx = (int)rank * T + btid; idx < mrows * (BCB / 4); idx += CL * T) {
        const int r = idx / (BCB / 4), c = 4 * (idx % (BCB / 4));
        const u32 a = tb + 4u * (u32)(r * OW + c);
        float4 v = ld_cluster_f4(a, 0);
#pragma unroll
        for (int rk = 1; rk < CL; ++rk) add4(v, ld_cluster_f4(a, rk));
        if (SP && wg_flag[c / BC]) v = w4_fix4<X>(x, qweight, scales, zeros, m0 + r, col0 + c, 0, K, K, N, group_rows);
        st_out4<X>(out + (u64)(m0 + r) * N + col0 + c, v);
      }
#if W4_WGEPI
      cluster_arrive_relaxed();  // every read of the peers' tiles is done (its value stored); nothing to publish
      cluster_wait();
#else
      cluster_sync();
#endif
    } else {
      __syncthreads();
      for (int idx = btid; idx < mrows * (BCB / 4); idx += T) {
        const int r = idx / (BCB / 4), c = 4 * (idx % (BCB / 4));
        float4 v = *reinterpret_cast<const float4*>(tile0 + r * OW + c);
        if (SP && wg_flag[c / BC]) v = w4_fix4<X>(x, qweight, scales, zeros, m0 + r, col0 + c, 0, K, K, N, group_rows);
        st_out4<X>(out + (u64)(m0 + r) * N + col0 + c, v);
      }
      __syncthreads();
    }
  }
}

// a kernel's body: float16 through dq_wsub (W4_WGSUB), else dq_pair
template <class X, int MT, int NWORD, int S, int CL, int W>
__device__ __forceinline__ void wg_run(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wg_body<X, MT, NWORD, S, CL, W, W4_WGSUB && MmaOps<X>::SUB>(x, qweight, scales, zeros, out, M, K, N, group_rows, cpb);
}

template <class X, int MT, int NWORD, int S>
__global__ void __launch_bounds__(128, (WgFit<MT, NWORD, S>::BLOCKS)) w4a16_wg(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wg_run<X, MT, NWORD, S, 1, 1>(x, qweight, scales, zeros, out, M, K, N, group_rows, cpb);
}

template <class X, int MT, int NWORD, int S, int CL>
__global__ void __cluster_dims__(1, CL, 1) __launch_bounds__(128, (WgFit<MT, NWORD, S>::BLOCKS)) w4a16_wgc(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wg_run<X, MT, NWORD, S, CL, 1>(x, qweight, scales, zeros, out, M, K, N, group_rows, cpb);
}

// w4a16_wgm: four warpgroups per block (one block per SM: 4 x S stages of shared memory, 512 threads of 128 registers),
// NWORD 1. Warpgroup w of block y takes K slice 4y + w of cpb chunks with its own stages and barrier; the four float32
// tiles are added in shared memory, in warpgroup order, then the CL blocks' through distributed shared memory as in
// w4a16_wgc. So a column tile's K is split 4*CL ways with only CL - 1 tiles per block crossing between SMs.
template <class X, int MT, int S, int CL>
__global__ void __cluster_dims__(1, CL, 1) __launch_bounds__(512, 1) w4a16_wgm(
    const u16* __restrict__ x, const unsigned char* __restrict__ qweight,
    const u16* __restrict__ scales, const u16* __restrict__ zeros, u16* __restrict__ out,
    int M, int K, int N, int group_rows, int cpb) {
  wg_run<X, MT, 1, S, CL, 4>(x, qweight, scales, zeros, out, M, K, N, group_rows, cpb);
}
