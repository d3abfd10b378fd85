// The persistent chains of bench/persistent_chain_cuda.py (16 layers of one-row QKV then O), compiled
// by NVRTC through cupy. Four kernels: resident_chain (cp.async into a double-buffered slice),
// resident_bulk (one bulk copy per run, unit-packed weights), resident_ring (a TMA ring that warp 0
// streams while 8 warps consume) and resident_flow (the ring with per-tile readiness counters in
// place of the grid barrier). Timing experiments only: nothing in the product uses them.
constexpr int K = 2048, NQ = 3072, NO = 2048, BUF = 3072, B = 64, KT = K / B, UNITS = 12;
constexpr int THREADS = 256, SLICE = UNITS * B * B;  // bf16 elements of one buffered slice
typedef unsigned short bf16;  // no header: the top half of a float
__device__ __forceinline__ float to_float(bf16 v) { return __uint_as_float((unsigned int)v << 16); }

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void grid_barrier(unsigned int* counter, unsigned int target, bool wait) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (wait && load_acquire(counter) < target) {
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void run_of(int phase, int G, int& lo, int& hi, int& N) {
  N = phase % 2 == 0 ? NQ : NO;
  const int units = (N / B) * KT;
  lo = (int)((long long)blockIdx.x * units / G);
  hi = (int)((long long)(blockIdx.x + 1) * units / G);
}

// The phase's weight units lo..hi, copied into `slice` ([unit][k][n]) asynchronously; one commit group.
__device__ __forceinline__ void issue(int phase, int phases, const bf16* wq,
                                      const bf16* wo, bf16* slice) {
  if (phase < phases) {
    int lo, hi, N;
    run_of(phase, gridDim.x, lo, hi, N);
    const bf16* w = (phase % 2 == 0 ? wq : wo) + (size_t)(phase / 2) * K * N;
    const int chunks = (hi - lo) * B * (B / 8);  // 16-byte pieces
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      const int i = c / (B * B / 8), r = (c / (B / 8)) % B, col = (c % (B / 8)) * 8;
      const int u = lo + i, nt = u / KT, kt = u % KT;
      const bf16* src = w + (size_t)(kt * B + r) * N + nt * B + col;
      const unsigned int dst = (unsigned int)__cvta_generic_to_shared(slice + (i * B + r) * B + col);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// dst += this program's run of phase p (its slice in shared memory) times the phase input x.
__device__ __forceinline__ void multiply(int p, const bf16* slice, const float* x, float* part, float* dst) {
  const int tid = threadIdx.x, n = tid % B, kq = tid / B;
  int lo, hi, N;
  run_of(p, gridDim.x, lo, hi, N);
  float acc = 0.f;
  for (int u = lo; u < hi; ++u) {
    const int nt = u / KT, kt = u % KT;
    const bf16* wt = slice + (u - lo) * B * B;
#pragma unroll
    for (int j = 0; j < B / 4; ++j) {
      const int k = kq * (B / 4) + j;
      acc += x[kt * B + k] * to_float(wt[k * B + n]);
    }
    if (u + 1 == hi || (u + 1) / KT != nt) {  // the last unit of this output tile in the run
      part[kq * B + n] = acc;
      __syncthreads();
      if (tid < B) atomicAdd(dst + nt * B + n, part[n] + part[B + n] + part[2 * B + n] + part[3 * B + n]);
      __syncthreads();
      acc = 0.f;
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
resident_chain(float* act, const bf16* wq, const bf16* wo, unsigned int* counter,
               int layers) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* slices = reinterpret_cast<bf16*>(smem);
  float* x = reinterpret_cast<float*>(slices + 2 * SLICE);
  float* part = x + K;  // [4][B]: the four k quarters' sums of one output tile
  const int G = gridDim.x, tid = threadIdx.x;
  const int phases = 2 * layers;
  issue(0, phases, wq, wo, slices);
  for (int p = 0; p < phases; ++p) {
    issue(p + 1, phases, wq, wo, slices + ((p + 1) % 2) * SLICE);
    if (p > 0) grid_barrier(counter, (unsigned int)(p * G), true);  // phase p-1's output is whole
    float* src = act + (p % 3) * BUF;
    float* dst = act + ((p + 1) % 3) * BUF;
    float* spent = act + ((p + 2) % 3) * BUF;  // phase p-1's input, phase p+1's output: zero it
    for (int i = blockIdx.x * THREADS + tid; i < BUF; i += G * THREADS) spent[i] = 0.f;
    for (int i = tid; i < K; i += THREADS) x[i] = __ldcg(src + i);
    asm volatile("cp.async.wait_group 1;" ::: "memory");  // this phase's slice has landed
    __syncthreads();
    multiply(p, slices + (p % 2) * SLICE, x, part, dst);
    __syncthreads();  // the slice is read: the next issue may overwrite it
  }
  grid_barrier(counter, (unsigned int)(phases * G), false);
}

__device__ __forceinline__ unsigned int shared_address(const void* p) {
  return (unsigned int)__cvta_generic_to_shared(p);
}

// The first unit of a phase in the packed weights: each layer's QKV units, then its O units.
__device__ __forceinline__ size_t phase_first_unit(int phase) {
  const size_t layer_units = (size_t)(NQ / B + NO / B) * KT;
  return (size_t)(phase / 2) * layer_units + (phase % 2 ? (NQ / B) * KT : 0);
}

// The phase's run as one bulk copy (the tensor memory accelerator), completing on `bar`: the weights
// are packed unit-major (each layer's QKV units then its O units, unit u = nt * KT + kt, [k][n]), so a
// program's run is one contiguous range.
__device__ __forceinline__ void issue_bulk(int phase, int phases, const bf16* packed, bf16* slice,
                                           unsigned long long* bar) {
  if (threadIdx.x != 0 || phase >= phases) return;
  int lo, hi, N;
  run_of(phase, gridDim.x, lo, hi, N);
  const size_t first = phase_first_unit(phase) + lo;
  const unsigned int bytes = (unsigned int)(hi - lo) * B * B * 2;
  const unsigned int b = shared_address(bar);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(slice)), "l"(packed + first * B * B), "r"(bytes), "r"(b) : "memory");
}

__device__ __forceinline__ void wait_full(unsigned long long* bar, unsigned int parity) {
  unsigned int done = 0;
  while (!done) {
    asm volatile("{ .reg .pred P; mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2; selp.u32 %0, 1, 0, P; }"
                 : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
resident_bulk(float* act, const bf16* packed, unsigned int* counter, int layers, int skip) {
  // skip (timing only, wrong results): 1 the barriers' waits, 2 the weight copies, 4 the multiply
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* slices = reinterpret_cast<bf16*>(smem);
  float* x = reinterpret_cast<float*>(slices + 2 * SLICE);
  float* part = x + K;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(part + 4 * B);
  const int G = gridDim.x, tid = threadIdx.x;
  const int phases = 2 * layers;
  if (tid == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bars)) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bars + 1)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int copies = skip & 2 ? 0 : phases;
  issue_bulk(0, copies, packed, slices, bars);
  for (int p = 0; p < phases; ++p) {
    issue_bulk(p + 1, copies, packed, slices + ((p + 1) % 2) * SLICE, bars + (p + 1) % 2);
    if (p > 0) grid_barrier(counter, (unsigned int)(p * G), !(skip & 1));
    float* src = act + (p % 3) * BUF;
    float* dst = act + ((p + 1) % 3) * BUF;
    float* spent = act + ((p + 2) % 3) * BUF;
    for (int i = blockIdx.x * THREADS + tid; i < BUF; i += G * THREADS) spent[i] = 0.f;
    for (int i = tid; i < K; i += THREADS) x[i] = __ldcg(src + i);
    if (!(skip & 2)) wait_full(bars + p % 2, (unsigned int)(p / 2) & 1u);
    __syncthreads();
    if (!(skip & 4)) multiply(p, slices + (p % 2) * SLICE, x, part, dst);
    __syncthreads();
  }
  grid_barrier(counter, (unsigned int)(phases * G), false);
}

// resident_ring: warp 0 streams the packed weights, a unit (8 KB) at a time, through a ring of RING
// shared-memory stages without ever waiting on the grid barrier (weights depend on no activation);
// warps 1-8 consume: the grid barrier, the phase input, then each unit as it lands.
constexpr int RING = 24, CONSUMERS = 256, STAMPS = 8;

__device__ __forceinline__ void stamp(long long* stamps, int phases, int p, int point) {
  if (stamps) stamps[((size_t)blockIdx.x * phases + p) * STAMPS + point] = clock64();
}

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

__device__ __forceinline__ void arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void fma8(float* acc, uint4 w, float x) {
  const unsigned int v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += x * __uint_as_float(v[i] << 16);
    acc[2 * i + 1] += x * __uint_as_float(v[i] & 0xffff0000u);
  }
}

// A consumer warp's partial sums of an output tile, over its 4 k rows a lane group and then into
// part[warp][64 n] (lanes 0-7 hold 8 columns each), for the CTA to add up; acc starts over.
__device__ __forceinline__ void warp_sums_to_part(float* acc, float* part, int consumer_warp, int lane) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 8);
    acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int i = 0; i < 8; ++i) part[consumer_warp * B + lane * 8 + i] = acc[i];
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
}

// Warp 0's lane 0 in the ring kernels: every phase's run, a unit at a time, into the ring's stages as
// they are released; it never waits for anything but a free stage.
__device__ __forceinline__ void stream_units(const bf16* packed, int phases, bf16* ring, unsigned long long* full,
                                             unsigned long long* empty, long long* stamps) {
  int c = 0;
  for (int p = 0; p < phases; ++p) {
    int lo, hi, N;
    run_of(p, gridDim.x, lo, hi, N);
    const bf16* first = packed + phase_first_unit(p) * B * B;
    for (int u = lo; u < hi; ++u, ++c) {
      const int st = c % RING;
      wait_full(empty + st, ((c / RING) & 1u) ^ 1u);  // the stage's last unit has been read
      const unsigned int b = shared_address(full + st), bytes = B * B * 2;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(shared_address(ring + st * B * B)), "l"(first + (size_t)u * B * B), "r"(bytes), "r"(b)
                   : "memory");
      if (u == lo) stamp(stamps, phases, p, 6);
      if (u + 1 == hi) stamp(stamps, phases, p, 7);
    }
  }
}

__device__ __forceinline__ void init_ring(unsigned long long* full, unsigned long long* empty) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < RING; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(full + s)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 8;" ::"r"(shared_address(empty + s)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
resident_ring(float* act, const bf16* packed, unsigned int* counter, int layers, int skip,
              long long* stamps) {
  // stamps (or null): clock64 per program and phase at STAMPS points (the consumers' thread 0: phase
  // start, past the barrier, input staged, [the cycles its waits for units took], last unit landed,
  // tile sums added; the producer: first and last unit issued), then [globaltimer, clock64] at
  // program 0's start and end.
  // skip (timing only, wrong results): 1 the barriers' waits, 4 the multiply, 8 each phase's start,
  // 16 the barriers' arrivals, 32 the zeroing, 64 the input's staging; 128 (a variant, results right):
  // arrive with a release reduction instead of a fence and an atomic
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ring = reinterpret_cast<bf16*>(smem);
  float* x = reinterpret_cast<float*>(ring + RING * B * B);
  float* part = x + K;  // [8 consumer warps][64 n]
  unsigned long long* full = reinterpret_cast<unsigned long long*>(part + 8 * B);
  unsigned long long* empty = full + RING;
  const int G = gridDim.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int phases = 2 * layers;
  init_ring(full, empty);
  long long* calibration = stamps ? stamps + (size_t)G * phases * STAMPS : nullptr;
  if (calibration && blockIdx.x == 0 && tid == 32) {
    calibration[0] = globaltimer();
    calibration[1] = clock64();
  }
  if (warp == 0) {
    if (lane == 0) stream_units(packed, phases, ring, full, empty, stamps);
    return;
  }
  const int t = tid - 32, cw = warp - 1, n8 = t % 8, kk = t / 8;  // 8 columns, k rows kk and kk + 32
  int c = 0;
  for (int p = 0; p < phases; ++p) {
    if (t == 0) stamp(stamps, phases, p, 0);
    if (p > 0 && !(skip & 8)) {  // the grid barrier, among the consumers
      consumer_sync();
      if (t == 0 && !(skip & 16)) {
        if (skip & 128) {
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        } else {
          __threadfence();
          atomicAdd(counter, 1u);
        }
        while (!(skip & 1) && load_acquire(counter) < (unsigned int)(p * G)) {
        }
      }
      consumer_sync();
    }
    if (t == 0) stamp(stamps, phases, p, 1);
    float* src = act + (p % 3) * BUF;
    float* dst = act + ((p + 1) % 3) * BUF;
    float* spent = act + ((p + 2) % 3) * BUF;
    if (!(skip & 8)) {
      for (int i = blockIdx.x * CONSUMERS + t; i < BUF && !(skip & 32); i += G * CONSUMERS) spent[i] = 0.f;
      for (int i = t; i < K && !(skip & 64); i += CONSUMERS) x[i] = __ldcg(src + i);
      consumer_sync();
    }
    if (t == 0) stamp(stamps, phases, p, 2);
    int lo, hi, N;
    run_of(p, G, lo, hi, N);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    long long waited = 0;
    for (int u = lo; u < hi; ++u, ++c) {
      const int st = c % RING, nt = u / KT, kt = u % KT;
      const long long before = clock64();
      wait_full(full + st, (c / RING) & 1u);
      waited += clock64() - before;
      if (t == 0 && u + 1 == hi) stamp(stamps, phases, p, 4);
      const bf16* unit = ring + st * B * B;
      if (skip & 4) {
        __syncwarp();
        if (lane == 0) arrive(empty + st);
        continue;
      }
      const uint4 a = *reinterpret_cast<const uint4*>(unit + kk * B + n8 * 8);
      const uint4 b = *reinterpret_cast<const uint4*>(unit + (kk + 32) * B + n8 * 8);
      fma8(acc, a, x[kt * B + kk]);
      fma8(acc, b, x[kt * B + kk + 32]);
      __syncwarp();
      if (lane == 0) arrive(empty + st);
      if (u + 1 == hi || (u + 1) / KT != nt) {  // this output tile's last unit in the run: add it up
        warp_sums_to_part(acc, part, cw, lane);
        consumer_sync();
        if (t < B) {
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < 8; ++w) v += part[w * B + t];
          atomicAdd(dst + nt * B + t, v);
        }
        consumer_sync();
      }
    }
    if (t == 0) stamp(stamps, phases, p, 5);
    if (t == 0 && stamps) stamps[((size_t)blockIdx.x * phases + p) * STAMPS + 3] = waited;
  }
  consumer_sync();
  if (t == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
  if (calibration && blockIdx.x == 0 && t == 0) {
    calibration[2] = globaltimer();
    calibration[3] = clock64();
  }
}

// resident_flow: the ring without a grid barrier. Every phase adds into a buffer of its own (zeroed
// before the launch); when a program has added an output tile's sums it counts itself in that tile's
// readiness word. A consumer warp starts a phase once the tiles its units read are complete (every
// program that adds into them has counted itself), with no CTA barrier: each warp holds its two
// input values per unit in registers. The consumers meet only to add up a tile's sums.
constexpr int TILES = NQ / B;  // readiness words per phase

__device__ __forceinline__ int run_start(int g, int units, int G) { return (int)((long long)g * units / G); }

__device__ __forceinline__ int owner(int u, int units, int G) {  // the program whose run holds unit u
  int g = (int)(((long long)u * G) / units);
  while (g + 1 < G && run_start(g + 1, units, G) <= u) ++g;
  while (g > 0 && run_start(g, units, G) > u) --g;
  return g;
}

__device__ __forceinline__ unsigned int load_relaxed(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
resident_flow(float* act, const bf16* packed, unsigned int* counter, int layers) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ring = reinterpret_cast<bf16*>(smem);
  float* part = reinterpret_cast<float*>(ring + RING * B * B);  // [8 consumer warps][64 n]
  unsigned long long* full = reinterpret_cast<unsigned long long*>(part + 8 * B);
  unsigned long long* empty = full + RING;
  unsigned int* ready = counter + 1;  // [phases][TILES]
  const int G = gridDim.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int phases = 2 * layers;
  init_ring(full, empty);
  if (warp == 0) {
    if (lane == 0) stream_units(packed, phases, ring, full, empty, nullptr);
    return;
  }
  const int n8 = lane % 8, kk = (warp - 1) * 4 + lane / 8;  // 8 columns, k rows kk and kk + 32
  int c = 0;
  for (int p = 0; p < phases; ++p) {
    int lo, hi, N;
    run_of(p, G, lo, hi, N);
    const int n_units = hi - lo;
    const float* src = act + (size_t)p * BUF;
    float* dst = act + (size_t)(p + 1) * BUF;
    if (p > 0) {  // wait until every tile this run reads is complete, then acquire
      const int prev_units = ((p - 1) % 2 == 0 ? NQ / B : NO / B) * KT;
      // lane j watches the tile of the run's unit j: one request a poll for the warp, then a pause
      const int kt = (lo + lane) % KT;
      const unsigned int need =
          lane < n_units ? (unsigned int)(owner((kt + 1) * KT - 1, prev_units, G) - owner(kt * KT, prev_units, G) + 1) : 0u;
      const unsigned int* word = ready + (p - 1) * TILES + kt;
      while (!__all_sync(0xffffffffu, lane >= n_units || load_relaxed(word) >= need)) __nanosleep(32);
      // the acquire: each lane's fence orders its own observation, the warp barrier hands it on
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      __syncwarp();
    }
    float xa[UNITS], xb[UNITS];
#pragma unroll
    for (int j = 0; j < UNITS; ++j) {
      const int kt = (lo + j) % KT;
      xa[j] = j < n_units ? __ldcg(src + kt * B + kk) : 0.f;
      xb[j] = j < n_units ? __ldcg(src + kt * B + kk + 32) : 0.f;
    }
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < UNITS; ++j) {
      if (j < n_units) {
        const int u = lo + j, st = c % RING, nt = u / KT;
        wait_full(full + st, (c / RING) & 1u);
        const bf16* unit = ring + st * B * B;
        fma8(acc, *reinterpret_cast<const uint4*>(unit + kk * B + n8 * 8), xa[j]);
        fma8(acc, *reinterpret_cast<const uint4*>(unit + (kk + 32) * B + n8 * 8), xb[j]);
        __syncwarp();
        if (lane == 0) arrive(empty + st);
        ++c;
        if (u + 1 == hi || (u + 1) / KT != nt) {  // this output tile's last unit in the run
          warp_sums_to_part(acc, part, warp - 1, lane);
          consumer_sync();
          if (warp == 1) {  // the tile's 64 sums, two columns a lane, then its readiness word
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float v = 0.f;
#pragma unroll
              for (int w = 0; w < 8; ++w) v += part[w * B + h * 32 + lane];
              atomicAdd(dst + nt * B + h * 32 + lane, v);
            }
            __syncwarp();
            if (lane == 0) {
              asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ready + p * TILES + nt) : "memory");
            }
          }
          consumer_sync();  // part is free again
        }
      }
    }
  }
  if (lane == 0) atomicAdd(counter, 1u);
}
