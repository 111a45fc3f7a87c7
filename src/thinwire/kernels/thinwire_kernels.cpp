// Compiled CPU kernels of thinwire's codecs and SLIDE's sparse layer (see kernels/__init__.py).
//
// Plain C++17 with a C ABI, called through ctypes on tensors' data pointers: no torch or Python
// headers, so a fresh build takes seconds (8 s on 2 cores). Every kernel computes exactly what
// the pure-torch/numpy path computes (the same IEEE operations in the same order, built with
// -ffp-contract=off), and splits its work into fixed blocks whose results are combined in block
// order, so the result is the same bits whatever the thread count.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <pthread.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// The worker threads of `parallel`, kept between calls (starting a thread costs tens of
// microseconds, more than a codec's work on 1M floats). A job is published with a generation
// number; the caller and the workers claim its blocks from one atomic counter, so a worker the
// scheduler starts late (a loaded host) finds them taken and the caller never waits for it (with
// blocks dealt round-robin, a 2-thread call on a loaded 2-core host took 4-6x the 1-thread
// time). A worker enters a job only while it is the open one (`live`) and is counted
// (`inside`) while it may read it; a new job waits until no worker is inside the last one.
// After fork() the child starts a fresh pool (its parent's threads do not exist there).
struct Pool {
  std::mutex mu;                   // guards gen, and the wake-ups
  std::condition_variable wake;
  std::mutex busy;                 // one job at a time: a caller that finds it held runs alone
  uint64_t gen = 0;
  std::atomic<uint64_t> live{0};   // the open job's generation, 0 between jobs
  std::atomic<int> inside{0};
  std::atomic<int64_t> next{0}, done{0};
  void (*call)(void*, int64_t) = nullptr;
  void* ctx = nullptr;
  int64_t nblocks = 0;
  int want = 0;                    // workers 0 .. want-1 take part in the open job
  int started = 0;                 // under busy
};

Pool* the_pool = nullptr;  // never freed: workers are detached and outlive any caller

void work(Pool* p, int index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(p->mu);
      p->wake.wait(lk, [&] { return p->gen != seen; });
      seen = p->gen;
    }
    p->inside.fetch_add(1);
    if (p->live.load() == seen && index < p->want)
      for (int64_t b = p->next.fetch_add(1); b < p->nblocks; b = p->next.fetch_add(1)) {
        p->call(p->ctx, b);
        p->done.fetch_add(1);
      }
    p->inside.fetch_sub(1);
  }
}

void forget_pool() { the_pool = nullptr; }  // in a forked child (pthread_atfork)

Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, forget_pool); });
  static std::mutex make;
  std::lock_guard<std::mutex> lk(make);
  if (the_pool == nullptr) the_pool = new Pool();
  return *the_pool;
}

// Run fn(block) for block in [0, nblocks) on up to nt threads (the calling thread included),
// each block on whichever thread claims it first: kernels write each block's results to its
// own place and combine them in block order, so the bits do not depend on the threads.
template <class F>
void parallel(int nt, int64_t nblocks, F fn) {
  const int64_t n = std::min<int64_t>(nt, nblocks);
  std::unique_lock<std::mutex> job;
  Pool* p = nullptr;
  if (n > 1) {
    p = &pool();
    job = std::unique_lock<std::mutex>(p->busy, std::try_to_lock);
  }
  if (!job.owns_lock()) {  // one thread asked, one block, or a job already running (nested)
    for (int64_t b = 0; b < nblocks; ++b) fn(b);
    return;
  }
  for (; p->started < n - 1; ++p->started) std::thread(work, p, p->started).detach();
  while (p->inside.load() != 0) std::this_thread::yield();  // none reads the last job now
  p->call = [](void* c, int64_t b) { (*static_cast<F*>(c))(b); };
  p->ctx = &fn;
  p->nblocks = nblocks;
  p->want = static_cast<int>(n - 1);
  p->next.store(0);
  p->done.store(0);
  {
    std::lock_guard<std::mutex> lk(p->mu);
    p->live.store(++p->gen);
  }
  p->wake.notify_all();
  int64_t mine = 0;
  for (int64_t b = p->next.fetch_add(1); b < nblocks; b = p->next.fetch_add(1), ++mine) fn(b);
  while (p->done.load() + mine != nblocks) std::this_thread::yield();  // blocks in progress
  p->live.store(0);
}

constexpr int64_t BLOCK = 1 << 16;  // elements per block of the element-wise kernels

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// The element-wise loops, with restrict pointers (int8 stores may alias anything otherwise,
// and the loops would not be vectorised).
// rint(x inv): round half to even, as torch.round (the rounding mode is never changed), of the
// product by inv = 1 / safe rounded to float32, the int8 codec's step 3 (compression/int8.py,
// `scaled`); inv = 0 where safe is subnormal (its reciprocal could overflow): zeros.
inline void round_int8(const float* __restrict x, int8_t* __restrict q, int64_t n, float safe,
                       bool stream) {
  int64_t i = 0;
  const float inv = safe >= std::numeric_limits<float>::min() ? 1.0f / safe : 0.0f;
#ifdef __AVX2__
  stream = stream && !(reinterpret_cast<uintptr_t>(q) & 31);
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; i + 32 <= n; i += 32) {  // 32 at a time: four roundings, packed to 32 bytes
    __m256i v[4];
    for (int j = 0; j < 4; ++j)  // cvtps rounds half to even (the default rounding mode)
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), iv));
    const __m256i w = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), perm);
    if (stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(q + i), w);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), w);
  }
#else
  (void)stream;
#endif
  for (; i < n; ++i) q[i] = static_cast<int8_t>(static_cast<int32_t>(std::rint(x[i] * inv)));
}

// Outputs of at least STREAM elements are written with non-temporal stores: they bypass the
// caches, so a line is written without being read first (a plain store reads each line before
// writing it: three memory transfers a line instead of two), and an output larger than the
// caches would not stay there anyway. A decode of 64M floats costs about half as much so.
constexpr int64_t STREAM = 1 << 22;

#ifdef __AVX2__
template <class T>
inline __m256i widen8(const T* q) {  // eight levels as int32
  if constexpr (sizeof(T) == 1)
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  else if constexpr (sizeof(T) == 2)
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  else
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}
#endif

// out_i = float(q_i) f, streamed where asked (the caller fences after its parallel section).
template <class T>
inline void widen_scale(const T* __restrict q, float* __restrict out, int64_t n, float f,
                        bool stream = false) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 fv = _mm256_set1_ps(f);
  if (stream) {
    for (; i < n && (reinterpret_cast<uintptr_t>(out + i) & 31); ++i)
      out[i] = static_cast<float>(q[i]) * f;
    for (; i + 8 <= n; i += 8)
      _mm256_stream_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(widen8(q + i)), fv));
  } else {  // written out: the compiler's loop cost a third more on 512-element chunks
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(widen8(q + i)), fv));
      _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(widen8(q + i + 8)), fv));
    }
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(widen8(q + i)), fv));
  }
#else
  (void)stream;
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(q[i]) * f;
}

// Ask for x[a + AHEAD, e + AHEAD) (clipped to d) now, so that memory works while the caller
// computes on x[a, e) from the caches (a kernel that reads a chunk twice, the second time
// with divisions, otherwise waits on memory and on its arithmetic in turn). The one-read
// passes (QSGD's rounding and norm, sign's encode) do without: on 64M floats the hardware's
// own prefetcher served them 17-28 % faster than these hints did (the hints' issue slots cost
// more than they saved); int8, fp4 and top-k measured no better without them.
constexpr int64_t AHEAD = 4096;  // elements: 16 KB ahead
inline void prefetch_ahead(const float* x, int64_t a, int64_t e, int64_t d) {
  const int64_t end = std::min(d, e + AHEAD);
  for (int64_t i = a + AHEAD; i < end; i += 16) __builtin_prefetch(x + i, 0, 3);
}

// The fence that orders a thread's non-temporal stores before its work is seen as done.
inline void fence(bool stream) {
#ifdef __AVX2__
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

// out[0, n) = 0, with non-temporal stores where stream (then fenced, so the sparse stores that
// follow land on the zeros): a line written without being read first, the sparse decodes'
// zero fill from 4M floats on, where out is larger than the caches. Otherwise plain vector
// stores: glibc's memset took 1.2x their time on 64 KB spans and 3x on 1 MB ones on an AMD
// Zen 3 (its string-instruction path).
inline void zero_fill(float* __restrict out, int64_t n, bool stream) {
#ifdef __AVX2__
  int64_t i = 0;
  const __m256 z = _mm256_setzero_ps();
  if (stream) {
    for (; i < n && (reinterpret_cast<uintptr_t>(out + i) & 31); ++i) out[i] = 0.0f;
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(out + i, z);
    for (; i < n; ++i) out[i] = 0.0f;
    _mm_sfence();
    return;
  }
  for (; i + 32 <= n; i += 32) {
    _mm256_storeu_ps(out + i, z);
    _mm256_storeu_ps(out + i + 8, z);
    _mm256_storeu_ps(out + i + 16, z);
    _mm256_storeu_ps(out + i + 24, z);
  }
  for (; i < n; ++i) out[i] = 0.0f;
#else
  (void)stream;
  std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
#endif
}

// Bit j set where |x_j| >= t, for x[0..64): the compares' lanes narrowed by saturating packs
// (all-ones stays -1) and put back in order by one permutation, then a byte mask per 32 (a
// quarter fewer operations than a movemask per 8 and the shifts that join them).
inline uint64_t at_least64(const float* x, float t) {
#ifdef __AVX2__
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), tv = _mm256_set1_ps(t);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto ge = [&](const float* p) {
    return _mm256_castps_si256(
        _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(p), mag), tv, _CMP_GE_OQ));
  };
  auto half = [&](const float* p) {  // 32 elements' bits, in order
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(ge(p), ge(p + 8)),
                                         _mm256_packs_epi32(ge(p + 16), ge(p + 24)));
    return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_permutevar8x32_epi32(w, perm)));
  };
  return uint64_t{half(x)} | (uint64_t{half(x + 32)} << 32);
#else
  uint64_t hit = 0;
  for (int j = 0; j < 64; ++j) hit |= static_cast<uint64_t>(std::fabs(x[j]) >= t) << j;
  return hit;
#endif
}

inline int64_t nblocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

// QSGD's counter-based draws (compression/quantize.py, CounterUniform): 16 bits an element,
// two elements a 32-bit word. Element i takes word j = 8 (i >> 4) + (i & 7), its low half
// where i & 8 is clear and its high half where set (so eight lanes of words serve sixteen
// consecutive elements), and word j is lowbias32(lo32(j) k0 + k1 + hi32(j) k2) (mod 2^32
// arithmetic; lowbias32 is C. Wellons' 32-bit integer hash): any element's draw is computed
// from its index alone and blocks run in parallel with the same bits.
inline uint32_t lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

// The counter hash's input for index j, lo32(j) k0 + k1 + hi32(j) k2 (mod 2^32), and its word
// (compression/quantize.py, counter_hash): QSGD's draws and Rand-k's offsets.
inline uint32_t counter_input(int64_t j, uint32_t k0, uint32_t k1, uint32_t k2) {
  return static_cast<uint32_t>(j) * k0 + k1 +
         static_cast<uint32_t>(static_cast<uint64_t>(j) >> 32) * k2;
}
inline uint32_t counter_word(int64_t j, uint32_t k0, uint32_t k1, uint32_t k2) {
  return lowbias32(counter_input(j, k0, k1, k2));
}

// QSGD's level of one element (compression/quantize.py, QSGD): t = x c16 rounded to float32,
// T = rint(t) (to nearest, ties to even), level = floor((T + u) / 2^16) within [-s, s], u its
// 16-bit draw. In double: T and T + u are exact there (|T| <= 2^48). A NaN t (a non-finite
// norm) gives -s, as the vector path's conversion does.
inline int32_t qsgd_level(float x, float c16, uint32_t u, int32_t s) {
  const double v = std::floor((static_cast<double>(std::nearbyint(x * c16)) + u) * 0x1p-16);
  if (!(v >= -s)) return -s;
  return v > s ? s : static_cast<int32_t>(v);
}

// Levels of x[0, m) (block start a, a multiple of 16) into q. Below s = 32767 (where T + u
// fits int32), 16 at a time in integers: the product converted to int32 by the CPU's default
// rounding (to nearest even), the draw added and shifted right arithmetically (the floor);
// int8 levels narrowed by saturating packs (which clip to [-127, 127]) and a byte min/max to
// [-s, s], int16 ones likewise in 16-bit lanes. Other levels element by element.
template <class T>
inline void qsgd_hash_round(const float* __restrict x, T* __restrict q, int64_t a, int64_t m,
                            float c16, uint32_t k0, uint32_t k1, uint32_t k2, int32_t s,
                            int64_t total) {
  const int64_t j0 = a / 2;  // the first element's word (a is a multiple of 16)
  int64_t i0 = 0;
#ifdef __AVX2__
  if constexpr (sizeof(T) <= 2) {
    if (s < 32767) {
      const bool stream = total >= STREAM && !(reinterpret_cast<uintptr_t>(q) & 31);
      const __m256 cv = _mm256_set1_ps(c16);
      const __m256i m1 = _mm256_set1_epi32(0x7feb352d), m2 = _mm256_set1_epi32(0x846ca68bu);
      const __m256i low = _mm256_set1_epi32(0xffff), step = _mm256_set1_epi32(8u * k0);
      __m256i ctr = _mm256_add_epi32(
          _mm256_set1_epi32(counter_input(j0, k0, k1, k2)),
          _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(k0)));
      auto level8 = [&](const float* p, __m256i u) {
        const __m256i t = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), cv));
        return _mm256_srai_epi32(_mm256_add_epi32(t, u), 16);
      };
      auto levels16 = [&](const float* p, __m256i* v) {  // one word a lane for 16 elements
        __m256i h = ctr;
        ctr = _mm256_add_epi32(ctr, step);
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        h = _mm256_mullo_epi32(h, m1);
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
        h = _mm256_mullo_epi32(h, m2);
        const __m256i top = _mm256_srli_epi32(h, 16);  // the word's high half (the last
        // shift-xor leaves it as it is); its low half is the low bits of h ^ top
        v[0] = level8(p, _mm256_and_si256(_mm256_xor_si256(h, top), low));
        v[1] = level8(p + 8, top);
      };
      auto put = [&](T* p, __m256i w) {
        if (stream)
          _mm256_stream_si256(reinterpret_cast<__m256i*>(p), w);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
      };
      if constexpr (sizeof(T) == 1) {
        const __m256i lo = _mm256_set1_epi8(static_cast<char>(-s));
        const __m256i hi = _mm256_set1_epi8(static_cast<char>(std::min(s, 127)));
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; i0 + 32 <= m; i0 += 32) {
          __m256i v[4];
          levels16(x + i0, v);
          levels16(x + i0 + 16, v + 2);
          const __m256i w = _mm256_permutevar8x32_epi32(
              _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
              perm);
          put(q + i0, _mm256_min_epi8(_mm256_max_epi8(w, lo), hi));
        }
      } else {
        const __m256i lo = _mm256_set1_epi16(static_cast<int16_t>(-s));
        const __m256i hi = _mm256_set1_epi16(static_cast<int16_t>(s));
        for (; i0 + 16 <= m; i0 += 16) {
          __m256i v[2];
          levels16(x + i0, v);
          const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xd8);
          put(q + i0, _mm256_min_epi16(_mm256_max_epi16(w, lo), hi));
        }
      }
    }
  }
#else
  (void)total;  // the streamed stores above are the only use
#endif
  for (int64_t i = i0; i < m; ++i) {
    const uint32_t h = counter_word(j0 + 8 * (i >> 4) + (i & 7), k0, k1, k2);
    q[i] = static_cast<T>(qsgd_level(x[i], c16, (i & 8) ? h >> 16 : h & 0xffffu, s));
  }
}

// QSGD's norm (compression/quantize.py, sum_squares): the sum of x_i^2 in an order fixed by
// the index alone, so the numpy path adds the same terms in the same order and both get the
// same bits on any thread count. Per block of BLOCK elements, 32 lanes (lane l takes
// i = l mod 32); per group of SQ_ROWS rows of 32 a lane adds its float32 squares in
// increasing i in float32 (each multiply and add rounded on its own), then the group's float32
// sum into the lane's double; the 32 doubles folded by halves (l += l + 16, then + 8, + 4,
// + 2, + 1); the blocks' sums added in block order. Float32 within a group keeps the pass at
// the speed of reading x (a conversion to double an element cost 1.5x that), double across
// groups keeps the error of 64-term sums (torch's float32 norm was off by 1e-5 relative on
// 2^20 normal draws; this is within a unit of float32's last place there).
constexpr int64_t SQ_LANES = 32;
constexpr int64_t SQ_ROWS = 64;
constexpr int64_t SQ_GROUP = SQ_LANES * SQ_ROWS;

inline double block_sum_squares(const float* __restrict x, int64_t m) {
  double lane[SQ_LANES] = {};
  for (int64_t g0 = 0; g0 < m; g0 += SQ_GROUP) {
    const int64_t ge = std::min(m, g0 + SQ_GROUP);
    alignas(32) float f[SQ_LANES] = {};
    int64_t i = g0;
#ifdef __AVX2__
    if (ge - g0 == SQ_GROUP) {
      __m256 acc[4];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (; i < ge; i += SQ_LANES)
        for (int j = 0; j < 4; ++j) {
          const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
          acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(v, v));
        }
      for (int j = 0; j < 4; ++j) _mm256_store_ps(f + 8 * j, acc[j]);
    }
#endif
    for (; i < ge; ++i) {  // g0 is a multiple of 32: i - g0 and i share their lane
      const float sq = x[i] * x[i];
      f[i % SQ_LANES] += sq;
    }
    for (int64_t l = 0; l < SQ_LANES; ++l) lane[l] += static_cast<double>(f[l]);
  }
  for (int64_t h = SQ_LANES / 2; h >= 1; h /= 2)
    for (int64_t l = 0; l < h; ++l) lane[l] += lane[l + h];
  return lane[0];
}

template <class T>
void qsgd_levels_hash(const float* x, int64_t d, float c16, uint32_t k0, uint32_t k1,
                      uint32_t k2, T* q, int32_t s, int nt) {
  parallel(nt, nblocks_of(d, BLOCK), [&](int64_t b) {
    const int64_t a = b * BLOCK, e = std::min(d, a + BLOCK);
    qsgd_hash_round(x + a, q + a, a, e - a, c16, k0, k1, k2, s, d);
    fence(d >= STREAM);
  });
}

template <class T>
void qsgd_decode(const T* q, int64_t d, float f, float* out, int nt) {
  const bool stream = d >= STREAM;
  parallel(nt, nblocks_of(d, BLOCK), [&](int64_t b) {
    const int64_t a = b * BLOCK, e = std::min(d, a + BLOCK);
    widen_scale(q + a, out + a, e - a, f, stream);
    fence(stream);
  });
}

// The rank-th largest (1 <= rank <= n) of n magnitudes given as their bits (|v| & 0x7fffffff:
// for finite floats unsigned order is float order), by a radix selection on the bits: 11, 10
// and 10 bits, each level counting only the magnitudes that share the levels above (a third of
// nth_element's time on 1M candidates). An order statistic is one value: any selection finds it.
// `members` is scratch (kept by the caller, so a warm call allocates nothing). With levels = 2
// it returns a lower bound instead: the rank-th largest with its last 10 bits cleared (within
// 2^-13 of it, and passed by at least rank of the n), a third less work.
float kth_largest(const uint32_t* mags, int64_t n, int64_t rank, std::vector<uint32_t>& members,
                  int levels = 3) {
  uint32_t prefix = 0;
  // four histograms, filled in turn and added: magnitudes near the threshold share their top
  // bits, and one histogram would make a chain of increments of the same counter
  int32_t hist[4][2048];
  int64_t total[2048];
  const int shifts[3] = {20, 10, 0}, widths[3] = {11, 10, 10};
  int64_t m = n;  // members of the current level (all n at level 0, read from mags)
  for (int level = 0; level < levels; ++level) {
    const int sh = shifts[level];
    const uint32_t mask = (1u << widths[level]) - 1;
    for (auto& h : hist) std::fill(h, h + mask + 1, 0);
    int64_t i = 0;
    if (level == 0) {
      for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; ++j) ++hist[j][mags[i + j] >> sh];
      for (; i < n; ++i) ++hist[0][mags[i] >> sh];
    } else {
      const int up = shifts[level - 1];
      if (level == 1) members.resize(static_cast<size_t>(n));
      uint32_t* to = members.data();  // filtered in place at level 2 (to <= from)
      int64_t w = 0;
      for (int64_t r = 0; r < m; ++r) {
        const uint32_t v = level == 1 ? mags[r] : to[r];
        to[w] = v;
        w += (v >> up) == prefix;
      }
      m = w;
      for (; i + 4 <= m; i += 4)
        for (int j = 0; j < 4; ++j) ++hist[j][(to[i + j] >> sh) & mask];
      for (; i < m; ++i) ++hist[0][(to[i] >> sh) & mask];
    }
    for (uint32_t b = 0; b <= mask; ++b)
      total[b] = int64_t{hist[0][b]} + hist[1][b] + hist[2][b] + hist[3][b];
    int64_t b = mask;
    for (; b > 0 && total[b] < rank; --b) rank -= total[b];
    prefix = (prefix << widths[level]) | static_cast<uint32_t>(b);
  }
  prefix <<= shifts[levels - 1];
  return float_of(prefix);
}


// How many of n floats have magnitude bits (|v| & 0x7fffffff) of at least tb (tb <= 2^31).
inline int64_t count_at_least(const float* __restrict vals, int64_t n, uint32_t tb) {
  int64_t i = 0, c = 0;
#ifdef __AVX2__
  {  // magnitude bits are non-negative int32s: a signed compare orders them
    const __m256i mag = _mm256_set1_epi32(0x7fffffff);
    const __m256i above = _mm256_set1_epi32(static_cast<int>(tb - 1u));  // > tb - 1
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (; i + 16 <= n; i += 16) {
      const __m256i b0 = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(vals + i)), mag);
      const __m256i b1 =
          _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(vals + i + 8)), mag);
      a0 = _mm256_sub_epi32(a0, _mm256_cmpgt_epi32(b0, above));  // a true lane is -1
      a1 = _mm256_sub_epi32(a1, _mm256_cmpgt_epi32(b1, above));
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(a0, a1));
    for (int j = 0; j < 8; ++j) c += lanes[j];
  }
#endif
  for (; i < n; ++i) c += (bits_of(vals[i]) & 0x7fffffffu) >= tb;
  return c;
}

// The rank-th largest magnitude (1 <= rank <= n) of n floats, in the order of their magnitude
// bits (as kth_largest), with counts[0] = how many are above it and counts[1] how many equal it,
// given lo, magnitude bits that at least rank of them reach (0 always serves). By counting:
// [lo, one past the largest) brackets the answer, the largest bits with at least rank at or
// above them; each step counts the magnitudes at or above a guess (one vectorised pass over
// the n, from the caches) and keeps the half of the bracket that holds the answer. The guess
// is interpolated between the bracket's counts, or the bracket halved where the last guess did
// not halve it. On top-k's ~13,000 candidates at 1M floats: 13-17 passes, half the radix
// selection's time (its histograms and its two passes that collect members cost more).
float kth_by_counting(const float* vals, int64_t n, int64_t rank, uint32_t lo,
                      int64_t* counts) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, bits_of(vals[i]) & 0x7fffffffu);
  uint64_t a = lo, b = uint64_t{top} + 1;  // count(>= a) >= rank > count(>= b)
  int64_t ca = count_at_least(vals, n, lo), cb = 0;
  if (ca < rank) {  // lo was no bound: start from 0
    a = 0;
    ca = n;
  }
  bool halve = false;
  while (b - a > 1) {
    uint64_t g = a + (b - a) / 2;
    if (!halve) {
      const double f = (static_cast<double>(ca - rank) + 0.5) / static_cast<double>(ca - cb);
      g = std::min(std::max(a + static_cast<uint64_t>(f * static_cast<double>(b - a)), a + 1),
                   b - 1);
    }
    const uint64_t width = b - a;
    const int64_t c = count_at_least(vals, n, static_cast<uint32_t>(g));
    if (c >= rank) {
      a = g;
      ca = c;
    } else {
      b = g;
      cb = c;
    }
    halve = !halve && 2 * (b - a) > width;
  }
  counts[0] = cb;
  counts[1] = ca - cb;
  return float_of(static_cast<uint32_t>(a));
}

// One block's top-k candidates (topk_encode), and the calling thread's scratch: grow-only
// buffers, so a warm call allocates nothing (an allocation past malloc's mmap threshold would
// fault its pages in on every call: measured as a seventh of the encode).
struct Candidates {
  std::vector<int64_t> idx;
  std::vector<float> val;
  std::vector<uint64_t> words;  // scratch of topk_candidates' step 1
  int64_t n = 0;
};
struct TopkScratch {
  std::vector<uint32_t> sample, members;
  std::vector<Candidates> blocks;
  std::vector<int64_t> cand;
  std::vector<float> cval;
};
thread_local TopkScratch topk_scratch;

// Candidates |x_i| >= t of [a, e) (at most 2^20 elements), with their values, into c (grown
// as needed); returns how many. Per span of TOPK_SPAN elements (16 KB, still in L1 for the
// second pass), two passes, so that hardly a branch depends on the data (a branch per group
// of 16 was mispredicted once per candidate group: half the time):
//   1. one 64-bit mask per 64 elements (vectorised compares), every word stored, the bits
//      counted (half the work of a list of the groups with a hit, measured);
//   2. each word's first two set bits written without a branch (the write index advances only
//      past a set bit), a loop only for the words with more (at 1% density, one word in 50).
// Pointers are locals here (parameters), never reloaded after a store.
constexpr int64_t TOPK_SPAN = 4096;
int64_t topk_candidates(const float* __restrict x, int64_t a, int64_t e, int64_t d, float t,
                        Candidates& c) {
  if (c.words.size() < static_cast<size_t>(TOPK_SPAN / 64))
    c.words.resize(static_cast<size_t>(TOPK_SPAN / 64));
  uint64_t* __restrict mw = c.words.data();
  const bool ahead = d >= STREAM;  // x from memory: read ahead (from the caches it only costs)
  int64_t w = 0;
  for (int64_t s0 = a; s0 < e; s0 += TOPK_SPAN) {
    const int64_t s1 = std::min(e, s0 + TOPK_SPAN), nw = (s1 - s0) / 64;
    if (ahead) prefetch_ahead(x, s0, s1, d);
    int64_t bits = 0;
    for (int64_t g = 0; g < nw; ++g) {  // 1.
      const float* p = x + s0 + 64 * g;
      const uint64_t m = at_least64(p, t);
      mw[g] = m;
      bits += __builtin_popcountll(m);
    }
    for (int64_t r = s0 + 64 * nw; r < s1; ++r) bits += std::fabs(x[r]) >= t;
    if (static_cast<int64_t>(c.idx.size()) < w + bits + 2) {  // grow-only, doubling
      const size_t room =
          static_cast<size_t>(std::max<int64_t>(w + bits + 2, 2 * c.idx.size()));
      c.idx.resize(room);
      c.val.resize(room);
    }
    int64_t* __restrict ci = c.idx.data();
    float* __restrict cv = c.val.data();
    for (int64_t g = 0; g < nw; ++g) {  // 2.
      const int64_t base = s0 + 64 * g;
      uint64_t m = mw[g];
      for (int r = 0; r < 2; ++r) {  // written always (room for two more was made)
        const int64_t i = base + (__builtin_ctzll(m | (uint64_t{1} << 63)));
        ci[w] = i;
        cv[w] = x[i];
        w += m != 0;
        m &= m - 1;
      }
      while (m) {
        const int64_t i = base + __builtin_ctzll(m);
        m &= m - 1;
        ci[w] = i;
        cv[w++] = x[i];
      }
    }
    for (int64_t i = s0 + 64 * nw; i < s1; ++i)
      if (std::fabs(x[i]) >= t) {
        ci[w] = i;
        cv[w++] = x[i];
      }
  }
  return w;
}

#ifdef __AVX2__
struct Packs {  // PACKS.lanes[m]: the lanes of m's set bits in order, then the others
  alignas(32) int32_t lanes[256][8];
  Packs() {
    for (int m = 0; m < 256; ++m) {
      int w = 0;
      for (int j = 0; j < 8; ++j)
        if ((m >> j) & 1) lanes[m][w++] = j;
      for (int j = 0; j < 8; ++j)
        if (!((m >> j) & 1)) lanes[m][w++] = j;
    }
  }
};
const Packs PACKS;

// keep_largest's usual case for a list of candidates and int32 indices: the candidates with
// |v_i| >= v written in order, eight at a time (their lanes packed to the front by one
// permutation from PACKS, all eight stored, the write place advanced by how many were kept),
// while eight more fit in the k places; returns where it stopped (i, w), the rest is the
// caller's. A quarter of the scalar loop's time (a store a candidate whose place depends on
// the compare before it).
inline void keep_at_least8(const int64_t* __restrict cand, const float* __restrict vals,
                           int64_t n, int64_t k, float v, int32_t* __restrict out_idx,
                           float* __restrict out_val, int64_t& i, int64_t& w) {
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), vv = _mm256_set1_ps(v);
  const __m256i low = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);  // int64 -> int32 halves
  for (; i + 8 <= n && w + 8 <= k; i += 8) {
    const __m256 x = _mm256_loadu_ps(vals + i);
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(x, mag), vv, _CMP_GE_OQ));
    const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(PACKS.lanes[m]));
    const __m256i i0 = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cand + i)), low);
    const __m256i i1 = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cand + i + 4)), low);
    _mm256_storeu_ps(out_val + w, _mm256_permutevar8x32_ps(x, p));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_idx + w),
                        _mm256_permutevar8x32_epi32(_mm256_blend_epi32(i0, i1, 0xF0), p));
    w += __builtin_popcount(static_cast<unsigned>(m));
  }
}
#endif

// Top-k's exact selection (compression/sparse.py, _keep_numpy): of n candidates (ascending
// indices, their values), keep the k largest magnitudes, ties at the k-th going to the lowest
// indices. Writes k (index, value) pairs in index order. list holds the candidates' indices,
// or is null where every element is one (candidate i is index i); lo: magnitude bits that at
// least k of the n reach (kth_by_counting's start; 0 always serves).
template <class I>
void keep_largest(const int64_t* list, const float* vals, int64_t n, int64_t k, uint32_t lo,
                  I* out_idx, float* out_val) {
  const auto cand = [list](int64_t i) { return list != nullptr ? list[i] : i; };
  if (n == k) {
    for (int64_t i = 0; i < n; ++i) {
      out_idx[i] = static_cast<I>(cand(i));
      out_val[i] = vals[i];
    }
    return;
  }
  int64_t counts[2];  // above v, equal to v
  const float v = kth_by_counting(vals, n, k, lo, counts);  // the k-th largest magnitude
  const int64_t above = counts[0], equal = counts[1];
  int64_t equal_left = k - above, w = 0;
  if (equal_left == equal) {  // every tie is kept (the usual case): keep |v_i| >= v
    int64_t i = 0;
#ifdef __AVX2__
    if constexpr (std::is_same<I, int32_t>::value)
      if (list != nullptr) keep_at_least8(list, vals, n, k, v, out_idx, out_val, i, w);
#endif
    for (; i < n && w < k; ++i) {
      out_idx[w] = static_cast<I>(cand(i));  // written always, kept when w advances
      out_val[w] = vals[i];
      w += std::fabs(vals[i]) >= v;
    }
    return;
  }
  for (int64_t i = 0; i < n && w < k; ++i) {  // without branches: a candidate is kept at
    const float a = std::fabs(vals[i]);        // random, a branch would be mispredicted
    const int64_t eq = a == v;
    const int64_t take = (a > v) | (eq & (equal_left > 0));
    equal_left -= eq & take;
    out_idx[w] = static_cast<I>(cand(i));  // written always, kept when take (w < k here)
    out_val[w] = vals[i];
    w += take;
  }
}

// Approximate top-k's count fixed to k (topk_encode's want_hi > 0, sparse.py's _fix_count).
template <class I>
void fix_count(const float* x, const int64_t* cand, const float* vals, int64_t n, int64_t k,
               float t_hi, I* out_idx, float* out_val) {
  int64_t w = 0;
  if (n >= k) {
    int64_t strong = 0;
    for (int64_t i = 0; i < n; ++i) strong += std::fabs(vals[i]) >= t_hi;
    const int64_t weak = n - strong;
    // drop r of the `pool` candidates of one kind, evenly: the j-th (from 0) goes when
    // floor((j + 1) r / pool) > floor(j r / pool); every candidate of the other kind is kept
    // (strong ones) or dropped (weak ones, when there are more than k strong)
    const bool from_weak = strong <= k;
    const int64_t pool = from_weak ? weak : strong, r = from_weak ? n - k : strong - k;
    int64_t j = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool is_strong = std::fabs(vals[i]) >= t_hi;
      bool keep;
      if (is_strong != from_weak) {
        keep = r == 0 || ((j + 1) * r) / pool == (j * r) / pool;
        ++j;
      } else {
        keep = is_strong;
      }
      if (keep) {
        out_idx[w] = static_cast<I>(cand[i]);
        out_val[w++] = vals[i];
      }
    }
    return;
  }
  int64_t need = k - n, c = 0;  // the lowest non-candidate indices, merged in index order
  for (int64_t i = 0; w < k; ++i) {
    if (c < n && cand[c] == i) {
      out_idx[w] = static_cast<I>(i);
      out_val[w++] = vals[c++];
    } else if (need > 0) {
      out_idx[w] = static_cast<I>(i);
      out_val[w++] = x[i];
      --need;
    } else {
      for (; c < n; ++c) {
        out_idx[w] = static_cast<I>(cand[c]);
        out_val[w++] = vals[c];
      }
    }
  }
}

// fp4's exponent code of m = |x| / s (compression/fp4.py, step 2, from the bits as its torch
// path reads it): m = f 2^e, f in [1, 2), reaches the boundary 1.5 2^e exactly when f's first
// fraction bit is set, so the count of boundaries reached is ((bits >> 22) + 1) >> 1 less 120,
// clamped to 1..7, and 0 below 2^-7 (bits < 120 << 23; a NaN's bits give 7, as there).
inline uint8_t fp4_code(float m) {
  int32_t b;
  std::memcpy(&b, &m, sizeof b);
  if (b < (120 << 23)) return 0;
  return static_cast<uint8_t>(std::min(std::max((((b >> 22) + 1) >> 1) - 120, 1), 7));
}

// The nibble of x against the scale s: (sign bit << 3) | fp4_code(|x| / s).
inline uint8_t fp4_nibble(float x, float s) {
  return static_cast<uint8_t>(fp4_code(std::fabs(x) / s) | ((bits_of(x) >> 31) << 3));
}

int64_t fp4_chunks_per_block(int64_t chunk) {
  int64_t per = std::max<int64_t>(1, BLOCK / chunk);
  return per + (per & 1);
}

// fn(c, a, e) for every chunk c of [0, d) (elements [a, e)), whole chunks per parallel block,
// each block fenced once at its end where its stores stream (not once a chunk: testing for a
// block's last chunk took an integer division a chunk).
template <class F>
void for_chunks(int nt, int64_t d, int64_t chunk, bool stream, F fn) {
  const int64_t chunks = (d + chunk - 1) / chunk;
  const int64_t per = std::max<int64_t>(1, BLOCK / chunk);
  parallel(nt, nblocks_of(chunks, per), [&](int64_t b) {
    const int64_t c1 = std::min(chunks, (b + 1) * per);
    for (int64_t c = b * per; c < c1; ++c) fn(c, c * chunk, std::min(d, c * chunk + chunk));
    fence(stream);
  });
}


// --- scaled sign (compression/sign.py): the block bodies of sign_encode / sign_decode --------
// Bits b_i = [x_i >= 0], packed most significant first, and ||x||_1 as the sign module's lane
// sums: per block of SIGN_BLOCK elements, lane j = the float32 sum of |x| at column j over the
// block's whole rows of 1024, in row order, widened to double (a partial last row then adds to
// its first lanes in double); lanes summed over blocks in block order, then the lanes added in
// order (np.cumsum's last value); scale = float(total / d), the sign module's. The rows are
// summed in float32 because widening every |x| to double took half the encode's operations
// (a block's 128 rows keep a lane's sum within 128 units in float32's last place).
constexpr int64_t SIGN_BLOCK = 1 << 17;
constexpr int64_t LANES = 1024;
constexpr int64_t SIGN_ROWS = 8;  // rows added to a lane's register before it is stored

// Elements [a, e) (a a multiple of 1024): acc[j] += the column sums above, and the bits, in
// one read of x. A byte of bits is one compare of its eight elements in reverse order
// (movemask's lowest bit is then the eighth: the first element lands most significant); two
// bytes a store (little-endian: the first byte at the lower address). Pointers arrive as
// parameters (as in every kernel body here): a vector or byte store may alias any object, a
// lambda's captured pointers included, which the compiler would then reload after every
// store (twice the time of a decode, measured).
inline void sign_encode_block(const float* __restrict x, int64_t a, int64_t e,
                              uint8_t* __restrict packed, double* __restrict acc) {
  alignas(32) float sum[LANES] = {};  // the float32 column sums of the block's whole rows
  const int64_t whole = a + (e - a) / LANES * LANES;
  int64_t r = a;
#ifdef __AVX2__
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 zero = _mm256_setzero_ps();
  const __m256i rev = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const auto bits8 = [rev, zero](__m256 v) {  // 8 elements' bits, the first most significant
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_permutevar8x32_ps(v, rev), zero, _CMP_GE_OQ));
  };
  for (; r + SIGN_ROWS * LANES <= whole; r += SIGN_ROWS * LANES) {  // whole groups of rows
    for (int64_t j = 0; j < LANES; j += 16) {  // 16 lanes in two registers, SIGN_ROWS rows
      __m256 lo = _mm256_load_ps(sum + j), hi = _mm256_load_ps(sum + j + 8);
      for (int64_t k = 0; k < SIGN_ROWS; ++k) {
        const int64_t i = r + k * LANES + j;
        const __m256 v = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        const uint16_t m = static_cast<uint16_t>(bits8(v) | (bits8(w) << 8));
        std::memcpy(packed + (i >> 3), &m, 2);
        lo = _mm256_add_ps(lo, _mm256_and_ps(v, mag));
        hi = _mm256_add_ps(hi, _mm256_and_ps(w, mag));
      }
      _mm256_store_ps(sum + j, lo);
      _mm256_store_ps(sum + j + 8, hi);
    }
  }
#endif
  const int64_t rest = r;  // the remaining whole rows, then a partial last row in double
  for (; r < whole; r += LANES)
    for (int64_t j = 0; j < LANES; ++j) sum[j] += std::fabs(x[r + j]);
  for (int64_t j = 0; j < LANES; ++j) acc[j] += static_cast<double>(sum[j]);
  for (int64_t j = 0; j < e - whole; ++j) acc[j] += static_cast<double>(std::fabs(x[whole + j]));
  for (int64_t i = rest; i < e; i += 8) {  // rest is a multiple of 8
    uint8_t byte = 0;
    const int64_t w = std::min<int64_t>(8, e - i);
    for (int64_t j = 0; j < w; ++j) byte |= static_cast<uint8_t>((x[i + j] >= 0.0f) << (7 - j));
    packed[i / 8] = byte;
  }
}

// out[a, e) (a a multiple of 8) from the bits: one 8-float row of the table a byte.
inline void sign_decode_block(const uint8_t* __restrict packed, const float* __restrict tab,
                              int64_t a, int64_t e, float* __restrict out, int add,
                              bool stream) {
  int64_t i = a;
#ifdef __AVX2__
  if (stream) {
    for (; i + 8 <= e; i += 8)
      _mm256_stream_ps(out + i, _mm256_loadu_ps(tab + packed[i >> 3] * 8));
    fence(stream);
  } else if (add) {
    for (; i + 8 <= e; i += 8)
      _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i),
                                              _mm256_loadu_ps(tab + packed[i >> 3] * 8)));
  } else {
    for (; i + 8 <= e; i += 8)
      _mm256_storeu_ps(out + i, _mm256_loadu_ps(tab + packed[i >> 3] * 8));
  }
#else
  (void)stream;
#endif
  for (; i + 8 <= e; i += 8) {
    const float* row = tab + packed[i >> 3] * 8;
    float* o = out + i;
    if (add)
      for (int j = 0; j < 8; ++j) o[j] += row[j];
    else
      for (int j = 0; j < 8; ++j) o[j] = row[j];
  }
  for (; i < e; ++i) {
    const float v = tab[packed[i >> 3] * 8 + (i & 7)];
    if (add)
      out[i] += v;
    else
      out[i] = v;
  }
}


// --- Rand-k's strata (the block bodies of randk_gather / randk_scatter) -----------------------
constexpr int64_t RANDK_BLOCK = 1 << 11;  // strata per parallel block
constexpr int64_t RANDK_CHUNK = 64;       // strata zeroed and written together (in L1)

// The strata [j0, j1) of randk_gather's comment, in order: fn(j, index). s_j is kept
// incrementally: s_j = j q + floor(j r / k) (q = d / k, r = d mod k), and floor((j + 1) r / k)
// gains one exactly where the remainder (j r mod k) + r reaches k.
struct Strata {
  int64_t q, r, k, s, rem;
  uint32_t k0, k1, k2;
  Strata(int64_t d, int64_t k_, uint32_t a, uint32_t b, uint32_t c, int64_t j0)
      : q(d / k_), r(d % k_), k(k_), k0(a), k1(b), k2(c) {
    const unsigned __int128 jr = static_cast<unsigned __int128>(j0) * static_cast<uint64_t>(r);
    s = j0 * q + static_cast<int64_t>(jr / static_cast<uint64_t>(k));
    rem = static_cast<int64_t>(jr % static_cast<uint64_t>(k));
  }
  // stratum j's length and index; s moves to s_{j+1}
  inline int64_t next(int64_t j, int64_t& len) {
    rem += r;
    len = q;
    if (rem >= k) {
      rem -= k;
      ++len;
    }
    const uint32_t h = counter_word(j, k0, k1, k2);
    const int64_t i = s + static_cast<int64_t>((static_cast<uint64_t>(h) *
                                                static_cast<uint64_t>(len)) >> 32);
    s += len;
    return i;
  }
};

inline void randk_gather_block(const float* __restrict x, int64_t d, int64_t k, uint32_t k0,
                               uint32_t k1, uint32_t k2, int64_t j0, int64_t j1,
                               float* __restrict out) {
  Strata st(d, k, k0, k1, k2, j0);
  int64_t len;
  for (int64_t j = j0; j < j1; ++j) out[j] = x[st.next(j, len)];
}

inline void randk_scatter_block(const float* __restrict v, int64_t d, int64_t k, uint32_t k0,
                                uint32_t k1, uint32_t k2, int64_t j0, int64_t j1, bool scaled,
                                float* __restrict out, bool add) {
  Strata st(d, k, k0, k1, k2, j0);
  int64_t at[RANDK_CHUNK];
  float w[RANDK_CHUNK];
  for (int64_t c = j0; c < j1; c += RANDK_CHUNK) {
    const int64_t n = std::min(RANDK_CHUNK, j1 - c), from = st.s;
    for (int64_t t = 0; t < n; ++t) {
      int64_t len;
      at[t] = st.next(c + t, len);
      w[t] = scaled ? v[c + t] * static_cast<float>(len) : v[c + t];
    }
    if (add) {
      for (int64_t t = 0; t < n; ++t) out[at[t]] += w[t];
    } else {
      zero_fill(out + from, st.s - from, d >= STREAM);
      for (int64_t t = 0; t < n; ++t) out[at[t]] = w[t];
    }
  }
}


// The absmax of x[a, e) on the bits of |x| (for finite floats unsigned order is float order).
inline float absmax(const float* __restrict x, int64_t a, int64_t e) {
  uint32_t m4[4] = {0, 0, 0, 0};
  int64_t i = a;
#ifdef __AVX2__
  {  // eight lanes, two running maxima (the compiler made four lanes of the loop below)
    const __m256i mag = _mm256_set1_epi32(0x7fffffff);
    __m256i u = _mm256_setzero_si256(), v = _mm256_setzero_si256();
    for (; i + 16 <= e; i += 16) {
      const __m256i p = _mm256_castps_si256(_mm256_loadu_ps(x + i));
      const __m256i r = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8));
      u = _mm256_max_epu32(u, _mm256_and_si256(p, mag));
      v = _mm256_max_epu32(v, _mm256_and_si256(r, mag));
    }
    u = _mm256_max_epu32(u, v);
    const __m128i h = _mm_max_epu32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m4), h);
  }
#endif
  for (; i + 4 <= e; i += 4)
    for (int j = 0; j < 4; ++j) m4[j] = std::max(m4[j], bits_of(x[i + j]) & 0x7fffffffu);
  for (; i < e; ++i) m4[0] = std::max(m4[0], bits_of(x[i]) & 0x7fffffffu);
  return float_of(std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3])));
}

// int8_encode's chunks [c0, c1): per chunk the absmax, the scale, the roundings.
inline void int8_block(const float* __restrict x, int64_t d, int64_t chunk, int64_t c0,
                       int64_t c1, int8_t* __restrict q, float* __restrict scale, bool stream) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t a = c * chunk, e = std::min(d, a + chunk);
    if (stream) prefetch_ahead(x, a, e, d);
    const float sc = absmax(x, a, e) / 127.0f;
    scale[c] = sc;
    round_int8(x + a, q + a, e - a, sc > 0.0f ? sc : 1.0f, stream);
  }
  fence(stream);
}


// --- fp4 (compression/fp4.py): the block bodies of fp4_encode / fp4_decode ---------------
#ifdef __AVX2__
// fp4_code of eight m = |x| / s at once, with the sign bit as 8 (fp4_code, eight lanes).
inline __m256i fp4_codes8(__m256 m, __m256 xv) {
  const __m256i bits = _mm256_castps_si256(m);
  const __m256i e = _mm256_srai_epi32(
      _mm256_add_epi32(_mm256_srai_epi32(bits, 22), _mm256_set1_epi32(1)), 1);
  const __m256i code = _mm256_min_epi32(
      _mm256_max_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(120)), _mm256_set1_epi32(1)),
      _mm256_set1_epi32(7));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(120 << 23), bits);
  return _mm256_or_si256(_mm256_andnot_si256(below, code),
                         _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(xv), 31), 3));
}
#endif

// fp4_encode's block b (whole chunks, starting on a byte); pointers as parameters, never
// reloaded after a store (see sign_encode_block). Per chunk: the absmax, then 32 codes at a
// time (fp4_codes8 of the quotients), packed two to a byte in registers where every chunk
// starts on a byte (an even chunk), otherwise through a buffer of nibbles.
inline void fp4_encode_block(const float* __restrict x, int64_t d, int64_t chunk, int64_t chunks,
                             int64_t per, int64_t b, uint8_t* __restrict packed,
                             float* __restrict scale) {
  const int64_t c0 = b * per, c1 = std::min(chunks, c0 + per);
  const int64_t a0 = c0 * chunk, e0 = std::min(d, c1 * chunk);
  const bool direct = chunk % 2 == 0;
  uint8_t nib[2 * BLOCK + 2];
  uint8_t* nb = nib;
  std::vector<uint8_t> big;
  if (!direct && e0 - a0 + 1 > static_cast<int64_t>(sizeof nib)) {  // chunks beyond a block
    big.resize(static_cast<size_t>(e0 - a0 + 1));
    nb = big.data();
  }
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t a = c * chunk, e = std::min(d, a + chunk);
    prefetch_ahead(x, a, e, d);
    const float sc = absmax(x, a, e);
    scale[c] = sc;
    const float safe = sc > 0.0f ? sc : 1.0f;
    int64_t i = a;
#ifdef __AVX2__
    const __m256 sv = _mm256_set1_ps(safe);
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i pair = _mm256_set1_epi16(0x0110);  // 16 x the first nibble + the second
    for (; i + 32 <= e; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 xv = _mm256_loadu_ps(x + i + 8 * j);
        v[j] = fp4_codes8(_mm256_div_ps(_mm256_and_ps(xv, mag), sv), xv);
      }
      const __m256i w = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
          perm);  // 32 nibbles as bytes, in order
      if (direct) {  // i is even: 16 bytes at packed + i / 2
        const __m256i h = _mm256_maddubs_epi16(w, pair);
        const __m256i n8 = _mm256_permute4x64_epi64(_mm256_packus_epi16(h, h), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + (i >> 1)),
                         _mm256_castsi256_si128(n8));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(nb + (i - a0)), w);
      }
    }
#endif
    if (direct) {  // the rest two at a time (an odd end only at d: its low nibble 0)
      for (; i < e; i += 2) {
        const uint8_t lo = i + 1 < e ? fp4_nibble(x[i + 1], safe) : 0;
        packed[i >> 1] = static_cast<uint8_t>((fp4_nibble(x[i], safe) << 4) | lo);
      }
    } else {
      for (; i < e; ++i) nb[i - a0] = fp4_nibble(x[i], safe);
    }
  }
  if (direct) return;
  const int64_t n = e0 - a0;
  if (n & 1) nb[n] = 0;
  uint8_t* out = packed + a0 / 2;
  for (int64_t p = 0; p < (n + 1) / 2; ++p)
    out[p] = static_cast<uint8_t>((nb[2 * p] << 4) | nb[2 * p + 1]);
}

// fp4_decode's block b; pointers as parameters (see sign_encode_block).
inline void fp4_decode_block(const uint8_t* __restrict packed, const float* __restrict scale,
                             int64_t d, int64_t chunk, int64_t chunks, int64_t per, int64_t b,
                             const float* __restrict table, bool stream,
                             float* __restrict out) {
  const int64_t c0 = b * per, c1 = std::min(chunks, c0 + per);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t a = c * chunk, e = std::min(d, a + chunk);
    const float sc = scale[c];
    int64_t i = a;
#ifdef __AVX2__
    if (!(a & 1)) {  // 8 at a time from 4 whole bytes: each byte's two nibbles, high first
      const __m256 mags = _mm256_loadu_ps(table), sv = _mm256_set1_ps(sc);
      const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
      const __m256i shifts = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0);
      const __m256i low3 = _mm256_set1_epi32(7), bit3 = _mm256_set1_epi32(8);
      for (; i + 8 <= e; i += 8) {
        int32_t four;
        std::memcpy(&four, packed + (i >> 1), 4);
        const __m256i nib = _mm256_srlv_epi32(
            _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), dup)), shifts);
        const __m256 m = _mm256_permutevar8x32_ps(mags, _mm256_and_si256(nib, low3));
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, bit3), 28);
        const __m256 v = _mm256_mul_ps(_mm256_xor_ps(m, _mm256_castsi256_ps(sign)), sv);
        if (stream && !(reinterpret_cast<uintptr_t>(out + i) & 31))
          _mm256_stream_ps(out + i, v);
        else
          _mm256_storeu_ps(out + i, v);
      }
    }
#endif
    for (; i < e; ++i) {
      const uint8_t byte = packed[i >> 1];
      out[i] = table[(i & 1) ? (byte & 15) : (byte >> 4)] * sc;
    }
  }
  fence(stream);
}

// Whether idx[0, k) ascends strictly: no early exit, so the compiler vectorises it (the branchy
// loop cost a tenth of a decode at 1M).
template <class I>
bool ascending(const I* __restrict idx, int64_t k) {
  int bad = 0;
  for (int64_t j = 1; j < k; ++j) bad |= idx[j - 1] >= idx[j];
  return bad == 0;
}

// Top-k's sparse decode with ascending indices: each 64 KB span of out zeroed, then its values
// written while it is in L2 (one pass over out); one read of the indices, typed.
template <class I>
void scatter_ascending(const float* __restrict v, const I* __restrict idx, int64_t k,
                       float* __restrict out, int64_t d, int nt) {
  const int64_t span = BLOCK / 4;
  parallel(nt, nblocks_of(d, 4 * BLOCK), [&](int64_t b) {
    const int64_t a = b * 4 * BLOCK, e = std::min(d, a + 4 * BLOCK);
    const int64_t j0 = std::lower_bound(idx, idx + k, static_cast<I>(a)) - idx;
    const int64_t j1 = std::lower_bound(idx + j0, idx + k, static_cast<I>(e)) - idx;
    int64_t j = j0;
    for (int64_t s = a; s < e; s += span) {
      const int64_t t = std::min(e, s + span);
      zero_fill(out + s, t - s, d >= STREAM);
      int64_t m = j;  // the span's values: found first, then stored (a loop with no exit test)
      while (m < j1 && idx[m] < t) ++m;
      for (; j < m; ++j) out[idx[j]] = v[j];
    }
  });
}


// --- fp8 with one absmax scale per chunk (compression/fp8.py) -------------------------------
// The code of y = x inv is torch's own float -> float8 conversion (c10's fp8e4m3fn /
// fp8e5m2_from_fp32_value), restated here on the bits so that eight lanes run at once: with
// a = |y|'s bits, the normal range rounds the mantissa to nearest even by adding
// (bias - 127) << 23, 2^(shift - 1) - 1 and the kept mantissa's last bit, then shifting;
// below the least normal number the float sum |y| + 2^magic rounds |y| to the subnormal grid
// (whose codes are then the sum's low bits); past the largest finite value e4m3fn saturates
// (NaN 0x7f, the rest 0x7e, and a normal rounding that reaches 0x7f is 0x7e) and e5m2 gives
// infinity (0x7c; NaN 0x7f). The sign is the code's top bit.
template <bool E5M2>
struct Fp8Format {
  static constexpr uint32_t max_bits = E5M2 ? 143u << 23 : 1087u << 20;  // 65536, 480
  static constexpr uint32_t least_normal = E5M2 ? 113u << 23 : 121u << 23;  // 2^-14, 2^-6
  static constexpr uint32_t magic = E5M2 ? 134u << 23 : 141u << 23;  // 2^7, 2^14
  static constexpr int shift = E5M2 ? 21 : 20;
  static constexpr uint32_t bias = (E5M2 ? 15u - 127u : 7u - 127u) << 23;  // mod 2^32
  static constexpr uint32_t half = E5M2 ? 0xFFFFFu : 0x7FFFFu;
  static constexpr uint32_t over = E5M2 ? 0x7Cu : 0x7Eu;  // finite overflow and infinity
  static constexpr float unbias = E5M2 ? 0x1p112f : 0x1p120f;  // 2^(127 - bias)
};

template <bool E5M2>
inline uint8_t fp8_code(float y) {
  using F = Fp8Format<E5M2>;
  uint32_t a = bits_of(y);
  const uint32_t sign = a & 0x80000000u;
  a ^= sign;
  uint32_t r;
  if (a >= F::max_bits) {
    r = a > 0x7F800000u ? 0x7Fu : F::over;
  } else if (a < F::least_normal) {
    r = (bits_of(float_of(a) + float_of(F::magic)) - F::magic) & 0xFFu;
  } else {
    r = (a + F::bias + F::half + ((a >> F::shift) & 1u)) >> F::shift;
    if (!E5M2 && r == 0x7Fu) r = 0x7Eu;
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

// The float value of a code (exact): its exponent and mantissa bits placed at float32's and
// multiplied by 2^(127 - bias) (float32's subnormals then give fp8's), the sign or'ed in; the
// codes past the finite range are NaN (e4m3fn 0x7f, e5m2 0x7d-0x7f) or infinity (e5m2 0x7c).
template <bool E5M2>
inline float fp8_value(uint8_t c) {
  using F = Fp8Format<E5M2>;
  const uint32_t m = c & 0x7Fu;
  float v;
  if (E5M2 ? m >= 0x7Cu : m == 0x7Fu)
    v = (E5M2 && m == 0x7Cu) ? std::numeric_limits<float>::infinity()
                             : std::numeric_limits<float>::quiet_NaN();
  else
    v = float_of(m << F::shift) * F::unbias;
  return (c & 0x80u) ? -v : v;
}

#ifdef __AVX2__
// fp8_code of eight y at once (int32 lanes), every case (a chunk holding an infinity or NaN).
template <bool E5M2>
inline __m256i fp8_codes8_any(__m256 y) {
  using F = Fp8Format<E5M2>;
  const __m256i b = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(b, sign);
  const __m256i den = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a),
                                        _mm256_set1_ps(float_of(F::magic)))),
      _mm256_set1_epi32(static_cast<int>(F::magic)));
  __m256i nor = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(F::bias + F::half))),
                       _mm256_and_si256(_mm256_srli_epi32(a, F::shift), _mm256_set1_epi32(1))),
      F::shift);
  if (!E5M2) nor = _mm256_min_epi32(nor, _mm256_set1_epi32(0x7E));
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(F::least_normal)), a);
  const __m256i big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(static_cast<int>(F::max_bits - 1)));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  __m256i r = _mm256_blendv_epi8(nor, den, small);
  const __m256i special = _mm256_blendv_epi8(_mm256_set1_epi32(static_cast<int>(F::over)),
                                             _mm256_set1_epi32(0x7F), nan);
  r = _mm256_blendv_epi8(r, special, big);
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// The same for |y| within the finite range (a chunk of finite x, see round_fp8), by one float
// addition: with e' = max(e, emin) (e = y's exponent, emin the least normal one, M the mantissa
// bits), C = 2^(e' + 23 - M) (1.5 + K 2^-23), K = (e' - emin) << M, has a last place of
// 2^(e' - M), so |y| + C rounds |y| to that grid (to nearest, ties to even, as torch's
// conversion) and adds its count m of grid steps to C's mantissa: the sum's low byte is
// K + m, the code (m counts 2^M to 2^(M+1) steps in a binade, the last carrying into the next
// exponent's code, and 0 to 2^M below 2^emin: the subnormal codes).
template <bool E5M2>
inline __m256i fp8_codes8(__m256 y) {
  using F = Fp8Format<E5M2>;
  constexpr int M = E5M2 ? 2 : 3;
  constexpr uint32_t base = ((23u - M) << 23) + (1u << 22) - (F::least_normal >> (23 - M));
  const __m256i b = _mm256_castps_si256(y);
  const __m256i p = _mm256_max_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F800000)),
                                     _mm256_set1_epi32(static_cast<int>(F::least_normal)));
  const __m256i c = _mm256_add_epi32(_mm256_add_epi32(p, _mm256_srli_epi32(p, 23 - M)),
                                     _mm256_set1_epi32(static_cast<int>(base)));
  const __m256 mag = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)));
  const __m256i sum = _mm256_castps_si256(_mm256_add_ps(mag, _mm256_castsi256_ps(c)));
  return _mm256_and_si256(sum, _mm256_set1_epi32(0xFF));  // the sign: fp8_codes32
}

// 32 codes: eight at a time, narrowed by packs; on the finite path the magnitudes' codes, and the
// signs of the 32 products packed to bytes beside them (0 or -1 each) give the top bits.
template <bool E5M2, bool FINITE>
inline void fp8_codes32(const float* __restrict x, uint8_t* __restrict q, __m256 iv, bool stream) {
  __m256i v[4], neg[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), iv);
    if (FINITE) {
      v[j] = fp8_codes8<E5M2>(y);
      neg[j] = _mm256_srai_epi32(_mm256_castps_si256(y), 31);
    } else {
      v[j] = fp8_codes8_any<E5M2>(y);
    }
  }
  __m256i w = _mm256_packus_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  if (FINITE)
    w = _mm256_or_si256(
        w, _mm256_and_si256(_mm256_packs_epi16(_mm256_packs_epi32(neg[0], neg[1]),
                                               _mm256_packs_epi32(neg[2], neg[3])),
                            _mm256_set1_epi8(static_cast<char>(0x80))));
  w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (stream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(q), w);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), w);
}
#endif

// Codes of x[0, n) against the chunk's (positive) safe scale: y = x inv, inv = 1 / safe rounded
// to float32 (0 where safe is subnormal), as int8's round_int8. A chunk whose absmax is finite
// has |y| <= FMAX (1 + 2^-22), short of the rounding range of the next value past the largest
// finite one, so its codes skip the overflow tests.
template <bool E5M2>
inline void round_fp8(const float* __restrict x, uint8_t* __restrict q, int64_t n, float safe,
                      bool finite, bool stream) {
  int64_t i = 0;
  const float inv = safe >= std::numeric_limits<float>::min() ? 1.0f / safe : 0.0f;
#ifdef __AVX2__
  stream = stream && !(reinterpret_cast<uintptr_t>(q) & 31);
  const __m256 iv = _mm256_set1_ps(inv);
  if (finite)
    for (; i + 32 <= n; i += 32) fp8_codes32<E5M2, true>(x + i, q + i, iv, stream);
  else
    for (; i + 32 <= n; i += 32) fp8_codes32<E5M2, false>(x + i, q + i, iv, stream);
#else
  (void)finite;
  (void)stream;
#endif
  for (; i < n; ++i) q[i] = fp8_code<E5M2>(x[i] * inv);
}

template <bool E5M2>
inline void fp8_block(const float* __restrict x, int64_t d, int64_t chunk, int64_t c0, int64_t c1,
                      uint8_t* __restrict q, float* __restrict scale, bool stream) {
  constexpr float fmax = E5M2 ? 57344.0f : 448.0f;
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t a = c * chunk, e = std::min(d, a + chunk);
    if (stream) prefetch_ahead(x, a, e, d);
    const float m = absmax(x, a, e);
    const float sc = m / fmax;
    scale[c] = sc;
    const bool finite = m <= std::numeric_limits<float>::max();
    round_fp8<E5M2>(x + a, q + a, e - a, sc > 0.0f ? sc : 1.0f, finite, stream);
  }
  fence(stream);
}

// out_i = value(q_i) f for the codes of one chunk: the code's bits placed at float32's (the
// byte sign-extended and shifted, sign and exponent-mantissa bits kept) times F = 2^(127 - bias)
// f, one product rounded once as value(q_i) f is (value(q_i) is the placed bits times that
// power of two, exactly), where F is finite or f is not; otherwise (f >= 2^8 or so) the placed
// bits times 2^(127 - bias), then times f. 32 codes holding a NaN or infinity code take
// value(q_i) f one by one.
template <bool E5M2>
inline void fp8_widen_scale(const uint8_t* __restrict q, float* __restrict out, int64_t n, float f,
                            bool stream) {
  int64_t i = 0;
#ifdef __AVX2__
  using F = Fp8Format<E5M2>;
  const float big = f * F::unbias;
  const bool once = std::isfinite(big) || !std::isfinite(f);
  const __m256 fv = _mm256_set1_ps(f), bv = _mm256_set1_ps(big), ub = _mm256_set1_ps(F::unbias);
  const __m256i keep = _mm256_set1_epi32(static_cast<int>(0x80000000u | (0x7Fu << F::shift)));
  const __m256i spec = _mm256_set1_epi8(static_cast<char>(E5M2 ? 0x7C : 0x7F));
  stream = stream && !(reinterpret_cast<uintptr_t>(out) & 31);
  auto run = [&](auto one_product) {  // the loop compiled once per product form
    for (; i + 32 <= n; i += 32) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
      if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(c, spec), spec))) {
        for (int64_t j = i; j < i + 32; ++j) out[j] = fp8_value<E5M2>(q[j]) * f;
        continue;
      }
      for (int j = 0; j < 4; ++j) {
        const __m256i w = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i + 8 * j)));
        const __m256 placed =
            _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(w, F::shift), keep));
        const __m256 v = decltype(one_product)::value
                             ? _mm256_mul_ps(placed, bv)
                             : _mm256_mul_ps(_mm256_mul_ps(placed, ub), fv);
        if (stream)
          _mm256_stream_ps(out + i + 8 * j, v);
        else
          _mm256_storeu_ps(out + i + 8 * j, v);
      }
    }
  };
  if (once)
    run(std::true_type{});
  else
    run(std::false_type{});
#else
  (void)stream;
#endif
  for (; i < n; ++i) out[i] = fp8_value<E5M2>(q[i]) * f;
}

}  // namespace

extern "C" {

int thinwire_kernels_version() { return 2; }

// --- int8 with one absmax scale per chunk (compression/int8.py) -----------------------------
void int8_encode(const float* x, int64_t d, int64_t chunk, int8_t* q, float* scale, int nt) {
  const bool stream = d >= STREAM && chunk % 32 == 0;  // chunks start on 32 bytes of q
  const int64_t chunks = (d + chunk - 1) / chunk, per = std::max<int64_t>(1, BLOCK / chunk);
  parallel(nt, nblocks_of(chunks, per), [&](int64_t b) {
    int8_block(x, d, chunk, b * per, std::min(chunks, (b + 1) * per), q, scale, stream);
  });
}

void int8_decode(const int8_t* q, const float* scale, int64_t d, int64_t chunk, float* out,
                 int nt) {
  const bool stream = d >= STREAM;
  for_chunks(nt, d, chunk, stream, [&](int64_t c, int64_t a, int64_t e) {
    widen_scale(q + a, out + a, e - a, scale[c], stream);
  });
}

// --- fp8 (e4m3fn or e5m2) with one absmax scale per chunk (compression/fp8.py) --------------
void fp8_encode(const float* x, int64_t d, int64_t chunk, int e5m2, uint8_t* q, float* scale,
                int nt) {
  const bool stream = d >= STREAM && chunk % 32 == 0;  // chunks start on 32 bytes of q
  const int64_t chunks = (d + chunk - 1) / chunk, per = std::max<int64_t>(1, BLOCK / chunk);
  parallel(nt, nblocks_of(chunks, per), [&](int64_t b) {
    const int64_t c0 = b * per, c1 = std::min(chunks, (b + 1) * per);
    if (e5m2)
      fp8_block<true>(x, d, chunk, c0, c1, q, scale, stream);
    else
      fp8_block<false>(x, d, chunk, c0, c1, q, scale, stream);
  });
}

void fp8_decode(const uint8_t* q, const float* scale, int64_t d, int64_t chunk, int e5m2,
                float* out, int nt) {
  const bool stream = d >= STREAM;
  for_chunks(nt, d, chunk, stream, [&](int64_t c, int64_t a, int64_t e) {
    if (e5m2)
      fp8_widen_scale<true>(q + a, out + a, e - a, scale[c], stream);
    else
      fp8_widen_scale<false>(q + a, out + a, e - a, scale[c], stream);
  });
}

// --- fp4 E3M0 with one absmax scale per chunk (compression/fp4.py) --------------------------
// m = |x| / s; code 0 below 2^-7, else 1 + #{c = 2..7 : m >= 0.75 2^(c - 7)} (the midpoints of
// the representable magnitudes 2^(c - 7)); nibble (signbit << 3) | code, two to a byte, the
// first element high. Blocks hold an even number of whole chunks, so they start on a byte.
void fp4_encode(const float* x, int64_t d, int64_t chunk, uint8_t* packed, float* scale, int nt) {
  const int64_t chunks = (d + chunk - 1) / chunk, per = fp4_chunks_per_block(chunk);
  parallel(nt, nblocks_of(chunks, per), [&](int64_t b) {
    fp4_encode_block(x, d, chunk, chunks, per, b, packed, scale);
  });
}

void fp4_decode(const uint8_t* packed, const float* scale, int64_t d, int64_t chunk, float* out,
                int nt) {
  // the sixteen nibbles' values before scaling: +-2^(c - 7), +-0 for c = 0
  float table[16];
  for (int n = 0; n < 16; ++n) {
    const int c = n & 7;
    const float mag = c ? std::ldexp(1.0f, c - 7) : 0.0f;
    table[n] = (n & 8) ? -mag : mag;
  }
  const int64_t chunks = (d + chunk - 1) / chunk, per = fp4_chunks_per_block(chunk);
  const bool stream = d >= STREAM;
  parallel(nt, nblocks_of(chunks, per), [&](int64_t b) {
    fp4_decode_block(packed, scale, d, chunk, chunks, per, b, table, stream, out);
  });
}

// --- scaled sign (compression/sign.py; the block bodies above) -----------------------------
void sign_encode(const float* x, int64_t d, uint8_t* packed, float* scale, int nt) {
  const int64_t nb = nblocks_of(d, SIGN_BLOCK);
  std::vector<double> part(static_cast<size_t>(nb * LANES), 0.0);
  double* const parts = part.data();
  parallel(nt, nb, [&](int64_t b) {
    const int64_t a = b * SIGN_BLOCK;
    sign_encode_block(x, a, std::min(d, a + SIGN_BLOCK), packed, parts + b * LANES);
  });
  double lanes[LANES] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < LANES; ++j) lanes[j] += part[b * LANES + j];
  double total = 0.0;
  for (int64_t j = 0; j < LANES; ++j) total += lanes[j];
  *scale = static_cast<float>(total / static_cast<double>(std::max<int64_t>(d, 1)));
}

void sign_decode(const uint8_t* packed, int64_t d, float scale, float* out, int add, int nt) {
  // a table of the eight decoded values of each byte (as the numpy path's)
  std::vector<float> table(256 * 8);
  for (int b = 0; b < 256; ++b)
    for (int j = 0; j < 8; ++j) table[b * 8 + j] = (b >> (7 - j)) & 1 ? scale : -scale;
  const float* const tab = table.data();
  const bool stream = !add && d >= STREAM && !(reinterpret_cast<uintptr_t>(out) & 31);
  parallel(nt, nblocks_of(d, BLOCK), [&](int64_t b) {
    const int64_t a = b * BLOCK;
    sign_decode_block(packed, tab, a, std::min(d, a + BLOCK), out, add, stream);
  });
}

// --- QSGD (compression/quantize.py) -----------------------------------------------------------
// The levels from the counter-based draws (k0 odd, k1, k2 odd: CounterUniform's keys) and
// c16 = 2^16 s / ||x|| rounded to float32, in parallel.
void qsgd_encode_counter(const float* x, int64_t d, float c16, uint32_t k0, uint32_t k1,
                         uint32_t k2, void* q, int elem, int32_t s, int nt) {
  if (elem == 1)
    qsgd_levels_hash(x, d, c16, k0, k1, k2, static_cast<int8_t*>(q), s, nt);
  else if (elem == 2)
    qsgd_levels_hash(x, d, c16, k0, k1, k2, static_cast<int16_t*>(q), s, nt);
  else
    qsgd_levels_hash(x, d, c16, k0, k1, k2, static_cast<int32_t*>(q), s, nt);
}

double sum_squares(const float* x, int64_t d, int nt) {
  const int64_t nb = nblocks_of(d, BLOCK);
  std::vector<double> part(static_cast<size_t>(std::max<int64_t>(nb, 1)), 0.0);
  parallel(nt, nb, [&](int64_t b) {
    const int64_t a = b * BLOCK;
    part[b] = block_sum_squares(x + a, std::min(d, a + BLOCK) - a);
  });
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) total += part[b];
  return total;
}

void qsgd_decode(const void* q, int elem, int64_t d, float f, float* out, int nt) {
  if (elem == 1)
    qsgd_decode(static_cast<const int8_t*>(q), d, f, out, nt);
  else if (elem == 2)
    qsgd_decode(static_cast<const int16_t*>(q), d, f, out, nt);
  else
    qsgd_decode(static_cast<const int32_t*>(q), d, f, out, nt);
}

// --- Top-k (compression/sparse.py) ------------------------------------------------------------
// Steps 1a-1d in one read of x: the threshold t = the (n - want)-th smallest of the strided
// sample's magnitudes (stride 0: no sample, every element a candidate); per block the
// candidates |x_i| >= t with their values; the exact k largest of them. Writes k indices
// (int32 when idx64 is 0) and values; returns 0, or -1 where fewer than k passed (the caller
// then calls again with stride 0).
// want_hi > 0 asks for the approximate selection (sparse.py, _fix_count) instead of step 1d:
// t_hi = the (n - want_hi)-th smallest sample magnitude; the candidates at or above t_hi are
// strong, the rest weak; the count is fixed to k by dropping weak candidates evenly (then
// strong ones, if there are more than k strong), or by topping up with the lowest
// non-candidate indices; never -1.
int topk_encode(const float* x, int64_t d, int64_t k, int64_t stride, int64_t want,
                int64_t want_hi, void* idx, int idx64, float* vals, int nt) {
  TopkScratch& s = topk_scratch;  // this thread's: worker threads write into its buffers
  float t = -1.0f, t_hi = 0.0f;  // every |x_i| >= -1
  const int64_t n_s = stride > 0 ? (d + stride - 1) / stride : 1;
  if (stride > 0) {
    s.sample.resize(static_cast<size_t>(n_s));
    for (int64_t i = 0; i < n_s; ++i) s.sample[i] = bits_of(x[i * stride]) & 0x7fffffffu;
    // the (n - want)-th smallest; for the exact selection any t that want of the sample pass
    // serves (step 1d makes the result exact), so its lower bound (two levels)
    t = kth_largest(s.sample.data(), n_s, want, s.members, want_hi > 0 ? 3 : 2);
    if (want_hi > 0) t_hi = kth_largest(s.sample.data(), n_s, want_hi, s.members);
  }
  if (stride == 0 && want_hi == 0) {  // every element a candidate: select from x itself
    if (idx64)
      keep_largest(nullptr, x, d, k, 0, static_cast<int64_t*>(idx), vals);
    else
      keep_largest(nullptr, x, d, k, 0, static_cast<int32_t*>(idx), vals);
    return 0;
  }
  const int64_t block = 4 * BLOCK;
  const int64_t nb = nblocks_of(d, block);
  if (static_cast<int64_t>(s.blocks.size()) < nb) s.blocks.resize(static_cast<size_t>(nb));
  std::vector<Candidates>& blocks = s.blocks;
  parallel(nt, nb, [&](int64_t b) {
    const int64_t a = b * block, e = std::min(d, a + block);
    blocks[b].n = topk_candidates(x, a, e, d, t, blocks[b]);
  });
  int64_t n = 0;
  for (int64_t b = 0; b < nb; ++b) n += blocks[b].n;
  const bool approx = want_hi > 0 && stride > 0;
  if (n < k && !approx) return -1;
  s.cand.resize(static_cast<size_t>(n));
  s.cval.resize(static_cast<size_t>(n));
  int64_t* const cand = s.cand.data();
  float* const cval = s.cval.data();
  int64_t o = 0;
  for (int64_t b = 0; b < nb; ++b) {
    std::memcpy(cand + o, blocks[b].idx.data(), static_cast<size_t>(blocks[b].n) * 8);
    std::memcpy(cval + o, blocks[b].val.data(), static_cast<size_t>(blocks[b].n) * 4);
    o += blocks[b].n;
  }
  const uint32_t at_least_t = bits_of(t) & 0x7fffffffu;  // every candidate's magnitude reaches t
  if (approx && idx64)
    fix_count(x, cand, cval, n, k, t_hi, static_cast<int64_t*>(idx), vals);
  else if (approx)
    fix_count(x, cand, cval, n, k, t_hi, static_cast<int32_t*>(idx), vals);
  else if (idx64)
    keep_largest(cand, cval, n, k, at_least_t, static_cast<int64_t*>(idx), vals);
  else
    keep_largest(cand, cval, n, k, at_least_t, static_cast<int32_t*>(idx), vals);
  return 0;
}

// Top-k's sparse decode: out = 0 (unless add), then out[idx_j] (+)= v_j. Where the indices
// ascend (top-k sends them so), scatter_ascending; otherwise zeros, then the values in turn.
// (Rand-k computes its indices inside randk_scatter.)
void scatter_decode(const float* v, const void* idx, int idx64, int64_t k, float* out,
                    int64_t d, int add, int nt) {
  const int64_t* i64 = static_cast<const int64_t*>(idx);
  const int32_t* i32 = static_cast<const int32_t*>(idx);
  auto at = [&](int64_t j) -> int64_t { return idx64 ? i64[j] : i32[j]; };
  if (!add && (idx64 ? ascending(i64, k) : ascending(i32, k))) {
    if (idx64)
      scatter_ascending(v, i64, k, out, d, nt);
    else
      scatter_ascending(v, i32, k, out, d, nt);
    return;
  }
  if (!add)
    parallel(nt, nblocks_of(d, 4 * BLOCK), [&](int64_t b) {
      const int64_t a = b * 4 * BLOCK, e = std::min(d, a + 4 * BLOCK);
      zero_fill(out + a, e - a, d >= STREAM);
    });
  for (int64_t j = 0; j < k; ++j) {
    if (add)
      out[at(j)] += v[j];
    else
      out[at(j)] = v[j];
  }
}

// --- Rand-k (compression/sparse.py) ---------------------------------------------------------
// Stratum j of [0, d): [s_j, s_{j+1}) with s_j = floor(j d / k), b_j = s_{j+1} - s_j, and its
// index s_j + floor(h_j b_j / 2^32), h_j the shared counter word of j (quantize.py,
// counter_hash: lowbias32(lo32(j) k0 + k1 + hi32(j) k2)). Blocks of RANDK_BLOCK strata, each
// computing its own s_j, so any thread count gives the same indices.
void randk_gather(const float* x, int64_t d, int64_t k, uint32_t k0, uint32_t k1, uint32_t k2,
                  float* out, int nt) {
  parallel(nt, nblocks_of(k, RANDK_BLOCK), [&](int64_t b) {
    const int64_t j0 = b * RANDK_BLOCK;
    randk_gather_block(x, d, k, k0, k1, k2, j0, std::min(k, j0 + RANDK_BLOCK), out);
  });
}

// out = 0 (unless add), then out[i_j] (+)= v_j, times float(b_j) where scaled (Rand-k's
// unbiased form): each stratum block's range of out zeroed and written while in cache.
void randk_scatter(const float* v, int64_t d, int64_t k, uint32_t k0, uint32_t k1, uint32_t k2,
                   int scaled, float* out, int add, int nt) {
  parallel(nt, nblocks_of(k, RANDK_BLOCK), [&](int64_t b) {
    const int64_t j0 = b * RANDK_BLOCK;
    randk_scatter_block(v, d, k, k0, k1, k2, j0, std::min(k, j0 + RANDK_BLOCK), scaled != 0,
                        out, add != 0);
  });
}

// --- PowerSGD's decode (compression/powersgd.py) ---------------------------------------------
// out = (P Q^T) of n x m, row-major, its first numel elements: out[i m + j] = sum_k p[i r + k]
// qt[k m + j] (qt = Q^T, r x m) as a chain of fused multiply-adds in k order: acc = p_0 q_0,
// acc = fma(p_k, q_k, acc), the bits of MKL's product of inner dimension r on a CPU with FMA
// (tests/kernels/test_kernels.py checks them against the chain computed in float64, and against
// torch.mm within one rounding a term). One write of the output, streamed from STREAM elements
// on; blocks of whole rows.
void lowrank_decode(const float* p, const float* qt, int64_t n, int64_t m, int64_t r,
                    int64_t numel, float* out, int nt) {
  const bool stream = numel >= STREAM;
  const int64_t rows = std::max<int64_t>(1, BLOCK / std::max<int64_t>(1, m));
  auto one = [&](const float* pi, int64_t j) {  // element j of the row with coefficients pi
    float acc = pi[0] * qt[j];
    for (int64_t k = 1; k < r; ++k) acc = std::fma(pi[k], qt[k * m + j], acc);
    return acc;
  };
  parallel(nt, nblocks_of(n, rows), [&](int64_t blk) {
    for (int64_t i = blk * rows, ie = std::min(n, i + rows); i < ie; ++i) {
      const int64_t e = std::min(m, numel - i * m);
      if (e <= 0) break;
      const float* pi = p + i * r;
      float* o = out + i * m;
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const bool st = stream && !(reinterpret_cast<uintptr_t>(o) & 3);
      for (; st && j < e && (reinterpret_cast<uintptr_t>(o + j) & 31); ++j) o[j] = one(pi, j);
      for (; j + 8 <= e; j += 8) {  // one pass: the r terms summed in registers, then stored
        __m256 acc = _mm256_mul_ps(_mm256_set1_ps(pi[0]), _mm256_loadu_ps(qt + j));
        for (int64_t k = 1; k < r; ++k)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(pi[k]), _mm256_loadu_ps(qt + k * m + j), acc);
        if (st)
          _mm256_stream_ps(o + j, acc);
        else
          _mm256_storeu_ps(o + j, acc);
      }
#endif
      for (; j < e; ++j) o[j] = one(pi, j);
    }
    fence(stream);
  });
}

// --- SLIDE's sparse layer (strategies/slide/layer.py) -----------------------------------------
}  // extern "C"

namespace {

constexpr int64_t LANES32 = 32;  // the dot product's partial sums: four vectors of eight
constexpr int64_t ROWS_AHEAD = 6;  // rows prefetched ahead of the one being read
constexpr int64_t ROW_BLOCK = 1024;  // touched rows per parallel block of the forward
constexpr int64_t MAX_CHUNKS = 16;  // the backward's chunks of touched rows (hidden gradient)
// A weight gradient of at least this many floats (32 MiB) is written by streaming stores: past
// the caches, where fetching its lines before writing them would double the traffic; smaller
// ones stay in the caches for the optimizer, which reads them next (streaming a gradient that
// fits the caches was slower, one several times their size faster: benchmarks/slide_layer.py).
constexpr int64_t STREAM_FLOATS = int64_t{1} << 23;

// w . x over H floats: 32 partial sums (element i in lane i mod 32 of its chunk), so the adds
// form four independent chains (a single chain waits on the add's latency every 8 floats),
// combined in a fixed tree: the same bits on any machine and thread count.
inline float dot(const float* __restrict w, const float* __restrict x, int64_t H) {
#ifdef __AVX2__
  // the same sums in four vectors of eight lanes, the tree's steps as vector adds (the
  // generic loop below zeroed and reduced its array through memory: most of the forward's time)
  if (H % LANES32 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < H; i += LANES32) {
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i)));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(w + i + 8),
                                           _mm256_loadu_ps(x + i + 8)));
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(w + i + 16),
                                           _mm256_loadu_ps(x + i + 16)));
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(w + i + 24),
                                           _mm256_loadu_ps(x + i + 24)));
    }
    const __m256 s8 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));  // 16, 8
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
#endif
  float acc[LANES32] = {};
  int64_t i = 0;
  for (; i + LANES32 <= H; i += LANES32)
    for (int64_t j = 0; j < LANES32; ++j) acc[j] += w[i + j] * x[i + j];
  for (int64_t j = 0; i + j < H; ++j) acc[j] += w[i + j] * x[i + j];
  for (int64_t width = LANES32 / 2; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

// o += a x over H floats (o and x apart: the loop is vectorised).
inline void axpy(float* __restrict o, float a, const float* __restrict x, int64_t H) {
  for (int64_t i = 0; i < H; ++i) o[i] += a * x[i];
}

// Ask for a weight row's cache lines before it is read: the active rows sit at random places
// of a weight that outgrows the caches, and the hardware prefetcher cannot guess them.
inline void prefetch_row(const float* w, int64_t H) {
  for (int64_t i = 0; i < H; i += 16) __builtin_prefetch(w + i);
}

// b = p / a for 0 <= p < 2^52 (a slot's sample), from a double product corrected by one each
// way where it rounded across an integer: an integer division a slot cost a twentieth of the
// forward.
struct DivBy {
  int64_t a;
  double inv;
  explicit DivBy(int64_t a_) : a(a_), inv(1.0 / static_cast<double>(a_ > 0 ? a_ : 1)) {}
  int64_t operator()(int64_t p) const {
    int64_t b = static_cast<int64_t>(static_cast<double>(p) * inv);
    b -= b * a > p;
    b += (b + 1) * a <= p;
    return b;
  }
};

// f(width) with the layer's hidden width H as a compile-time constant where it is 64, 128 or
// 256 (0 otherwise: H read at run time): the dot products', the row sums' and the prefetches'
// loops are then unrolled (the forward at H = 128 given at run time took a tenth longer).
template <class F>
void with_width(int64_t H, F f) {
  switch (H) {
    case 64: f(std::integral_constant<int64_t, 64>{}); break;
    case 128: f(std::integral_constant<int64_t, 128>{}); break;
    case 256: f(std::integral_constant<int64_t, 256>{}); break;
    default: f(std::integral_constant<int64_t, 0>{});
  }
}

#ifdef __AVX2__
// dst[0, 8V) = sum over the slots order[q0 .. q1) of g[p] x_p[0, 8V) (0 g for a slot that mask
// drops), x_p = h[b(p)] + i0, in V vectors held in registers from the first slot to the last and
// written once; streamed where asked.
template <int V>
inline void row_piece(const float* __restrict g, const float* __restrict h,
                      const uint8_t* __restrict mask, const int64_t* __restrict order, int64_t q0,
                      int64_t q1, DivBy sample, int64_t H, int64_t i0, float* __restrict dst,
                      bool stream) {
  __m256 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t p = order[q];
    const __m256 gv = _mm256_set1_ps(!mask || mask[p] ? g[p] : 0.0f);
    const float* __restrict x = h + sample(p) * H + i0;
    for (int j = 0; j < V; ++j)
      acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(gv, _mm256_loadu_ps(x + 8 * j)));
  }
  for (int j = 0; j < V; ++j) {
    if (stream)
      _mm256_stream_ps(dst + 8 * j, acc[j]);
    else
      _mm256_storeu_ps(dst + 8 * j, acc[j]);
  }
}
#endif

// A touched row's weight gradient, dst[i] = sum over its slots order[q0 .. q1), ascending, of
// g[p] h[b(p)][i] (0 g for a slot that mask drops; the first term added to 0): summed in
// registers, 64 floats at a time (then 8, then one), each float written once. (Summing into the
// row in memory, or into a row buffer streamed out after, made every slot's adds wait on the
// last slot's stores, and a streamed row's stores on the buffer's reads: the backward at 0.2 % of
// 1,000,000 rows took 3-6x the time of writing its gradient.)
inline void row_gradient(const float* __restrict g, const float* __restrict h,
                         const uint8_t* __restrict mask, const int64_t* __restrict order,
                         int64_t q0, int64_t q1, DivBy sample, int64_t H, float* __restrict dst,
                         bool stream) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 64 <= H; i += 64)
    row_piece<8>(g, h, mask, order, q0, q1, sample, H, i, dst + i, stream);
  for (; i + 8 <= H; i += 8)
    row_piece<1>(g, h, mask, order, q0, q1, sample, H, i, dst + i, stream);
#else
  (void)stream;
#endif
  if (i == H) return;
  for (int64_t k = i; k < H; ++k) dst[k] = 0.0f;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t p = order[q];
    const float gp = !mask || mask[p] ? g[p] : 0.0f;
    const float* __restrict x = h + sample(p) * H;
    for (int64_t k = i; k < H; ++k) dst[k] += gp * x[k];
  }
}

// slide_forward_rows' rows [u0, u1), H = HC where HC > 0 (with_width).
template <int64_t HC>
void forward_rows(const float* W, const float* bias, const float* h, const int64_t* rows,
                  const int64_t* start, const int64_t* order, const uint8_t* mask, int64_t u0,
                  int64_t u1, DivBy sample, int64_t Hr, float* out) {
  const int64_t H = HC > 0 ? HC : Hr;
  const float ninf = -INFINITY;
  for (int64_t u = u0; u < std::min(u1, u0 + ROWS_AHEAD); ++u) prefetch_row(W + rows[u] * H, H);
  for (int64_t u = u0; u < u1; ++u) {
    if (u + ROWS_AHEAD < u1) {
      prefetch_row(W + rows[u + ROWS_AHEAD] * H, H);
      __builtin_prefetch(bias + rows[u + ROWS_AHEAD]);
    }
    const float* w = W + rows[u] * H;
    const float bu = bias[rows[u]];
    for (int64_t q = start[u]; q < start[u + 1]; ++q) {
      const int64_t p = order[q];
      out[p] = (mask && !mask[p]) ? ninf : dot(w, h + sample(p) * H, H) + bu;
    }
  }
}

// slide_backward_rows' rows [u0, u1) (its steps 1 and 2), H = HC where HC > 0 (with_width).
template <int64_t HC>
void backward_rows(const float* g, const float* W, const float* h, const uint8_t* mask,
                   const int64_t* rows, const int64_t* start, const int64_t* order, int64_t u0,
                   int64_t u1, DivBy sample, int64_t Hr, float* part, float* gw, float* gb,
                   bool stream) {
  const int64_t H = HC > 0 ? HC : Hr;
  if (part)
    for (int64_t u = u0; u < std::min(u1, u0 + ROWS_AHEAD); ++u)
      prefetch_row(W + rows[u] * H, H);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t q0 = start[u], q1 = start[u + 1];
    if (part) {  // 1.
      if (u + ROWS_AHEAD < u1) prefetch_row(W + rows[u + ROWS_AHEAD] * H, H);
      const float* __restrict w = W + rows[u] * H;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = order[q];
        if (!mask || mask[p]) axpy(part + sample(p) * H, g[p], w, H);
      }
    }
    if (gw) row_gradient(g, h, mask, order, q0, q1, sample, H, gw + u * H, stream);  // 2.
    if (gb) {
      float sb = 0.0f;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = order[q];
        sb += !mask || mask[p] ? g[p] : 0.0f;
      }
      gb[u] = sb;
    }
  }
}

}  // namespace

extern "C" {
// Ask the kernel to back [p, p + bytes) with 2 MiB pages where it can (Linux's transparent huge
// pages in "madvise" mode; elsewhere nothing): for a fresh buffer, 512 times fewer page faults
// when it is first written; for the weight, reads of rows at random places that miss the TLB
// 512 times less often (Daghaghi et al., "Accelerating SLIDE Deep Learning on Modern CPUs",
// MLSys 2021, section 5: huge pages). Only whole 2 MiB pages inside the range are advised.
// Returns 0, or -1 where nothing was advised.
int advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t page = uintptr_t{1} << 21;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) &
                      ~(page - 1);
  if (e <= a) return -1;
  return madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE) == 0 ? 0 : -1;
#else
  (void)p;
  (void)bytes;
  return -1;
#endif
}

// The touched rows (every slot's id, masked ones included, as the gathered layer's sparse
// gradient lists them) in ascending order, and each row's slots in slot order: rows_out[U],
// start[U + 1], order[n]; returns U. C: the layer's rows. The forward calls it, and the
// backward reuses its arrays.
int64_t slide_touched_rows(const int64_t* ids, int64_t n, int64_t C, int64_t* rows_out,
                           int64_t* start, int64_t* order) {
  // the n slots sorted by (row, slot): a stable LSD radix sort on the row's bits of the keys
  // row << nb | slot (nb bits for a slot), so each pass reads its keys in sequence (sorting the
  // slots' numbers and looking each slot's row up at random took longer), in passes of at
  // most 11 bits (2^11 counts; two passes up to 4 million rows), so the cost follows the n
  // slots, not the C rows (one counting pass over a million rows, where the slots outnumbered
  // half the rows, scattered the keys over a million places: 3x the two passes' time for
  // uniformly drawn ids at 0.5-2 % of 1,000,000 rows, about the same for the layer's own);
  // every pass's counts in one read of the keys (bits + nb <= 64). Then start[u] ..
  // start[u + 1] in order[] are row u's slots.
  int bits = 1, nb = 1;
  while ((int64_t{1} << bits) < C) ++bits;
  while ((int64_t{1} << nb) < n) ++nb;
  const int passes = (bits + 10) / 11;
  const int digit = (bits + passes - 1) / passes;
  const int64_t radix = int64_t{1} << digit;
  std::vector<int64_t> count(static_cast<size_t>(passes * (radix + 1)), 0);
  // the keys and a second array for the passes, kept by the calling thread between calls (a
  // fresh array's pages are faulted in on every call: 2.8 us a 4 KiB page on this host)
  thread_local std::vector<uint64_t> held;
  if (held.size() < 2 * static_cast<size_t>(n)) held.resize(2 * static_cast<size_t>(n));
  uint64_t* keys = held.data();
  for (int64_t q = 0; q < n; ++q) {
    const uint64_t id = static_cast<uint64_t>(ids[q]);
    keys[q] = (id << nb) | static_cast<uint64_t>(q);
    for (int pass = 0; pass < passes; ++pass)
      ++count[pass * (radix + 1) + ((id >> (pass * digit)) & (radix - 1)) + 1];
  }
  uint64_t* src = keys;
  uint64_t* dst = keys + n;
  for (int pass = 0; pass < passes; ++pass) {
    int64_t* cnt = count.data() + pass * (radix + 1);
    for (int64_t d = 0; d < radix; ++d) cnt[d + 1] += cnt[d];
    const int shift = nb + pass * digit;
    for (int64_t q = 0; q < n; ++q) dst[cnt[(src[q] >> shift) & (radix - 1)]++] = src[q];
    std::swap(src, dst);
  }
  // the rows and their first slots without a branch (a new row is as likely as a repeat at a
  // few tenths of a percent active: the branch's mispredictions cost a third of the sort):
  // every key writes its row and slot at U, which moves on only at a new row (a repeat past
  // the last place rewrites that place's own row)
  const uint64_t slot = (uint64_t{1} << nb) - 1;
  const int64_t last = std::min(n, C) - 1;
  int64_t U = 0, prev = -1;
  for (int64_t q = 0; q < n; ++q) {
    const int64_t row = static_cast<int64_t>(src[q] >> nb);
    order[q] = static_cast<int64_t>(src[q] & slot);
    rows_out[std::min(U, last)] = row;
    start[U] = q;
    U += row != prev;
    prev = row;
  }
  start[U] = n;
  return U;
}

// The layer's three passes all run over the touched rows in ascending order (the slots sorted
// by row by slide_touched_rows, in the forward), not over the samples: a row that several
// samples share is read once a pass instead of once a slot, and the rows are read in address
// order, so the reads of a wide layer's weight are nearly sequential where the active fraction
// is a few tenths of a percent or more (benchmarks/slide_layer.py: the per-sample passes read
// every slot's row at a random place, twice, and ran at 1.2-2.6x their floor at 1,000,000
// outputs). Each slot's logit and each row's gradient is the same sum of the same terms in the
// same order as per sample; only the hidden gradient's sum over a sample's slots runs in
// another order (rows ascending, in fixed chunks combined in chunk order).

// Forward: out[p] = W[ids[p]] . h[b(p)] + bias[ids[p]] (-inf where mask is 0), b(p) = p / A,
// for the slots p of each touched row u (rows[u], slots order[start[u] .. start[u + 1]]), each
// row read once, in place, rows in blocks over the threads (each slot written by its row's
// owner: the same bits on any thread count).
void slide_forward_rows(const float* W, const float* bias, const float* h, const int64_t* rows,
                        const int64_t* start, const int64_t* order, const uint8_t* mask,
                        int64_t U, int64_t A, int64_t H, float* out, int nt) {
  const DivBy sample(A);
  parallel(nt, nblocks_of(U, ROW_BLOCK), [=](int64_t blk) {
    const int64_t u0 = blk * ROW_BLOCK, u1 = std::min(U, u0 + ROW_BLOCK);
    with_width(H, [&](auto hc) {
      forward_rows<decltype(hc)::value>(W, bias, h, rows, start, order, mask, u0, u1, sample, H,
                                        out);
    });
  });
}

// Backward, one pass over the touched rows (ascending, in place), for the rows of each chunk:
//   1. the hidden gradient, where gh is given: part_c[b(p)] += g[p] W[rows[u]] for the slots p
//      of row u that mask keeps (rows ascending, then slots ascending); gh[b] = sum_c part_c[b]
//      in chunk order. The chunks split [0, U) into a count fixed by U and B alone (at most
//      MAX_CHUNKS, their partial sums at most U H floats), so the bits do not depend on nt;
//   2. the weight rows, where gw is given: gw[u] = sum_{slots p of u, ascending} g[p] h[b(p)]
//      (0 for masked slots) and gb[u] = sum g[p], written by the row's one owner: no atomics,
//      no locks. Each row is summed in registers and written once (row_gradient); a large
//      gradient (STREAM_FLOATS) with 32-byte aligned rows by streaming stores.
void slide_backward_rows(const float* g, const float* W, const float* h, const uint8_t* mask,
                         const int64_t* rows, const int64_t* start, const int64_t* order,
                         int64_t U, int64_t B, int64_t A, int64_t H, float* gh, float* gw,
                         float* gb, int nt) {
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(MAX_CHUNKS, U / std::max<int64_t>(B, 1)));
  std::vector<float> parts(gh ? static_cast<size_t>(chunks * B * H) : 0);
  const bool stream = gw && H % 8 == 0 && reinterpret_cast<uintptr_t>(gw) % 32 == 0 &&
                      U * H >= STREAM_FLOATS;
  const DivBy sample(A);
  parallel(nt, chunks, [&](int64_t c) {
    float* part = gh ? parts.data() + c * B * H : nullptr;
    const int64_t u0 = U * c / chunks, u1 = U * (c + 1) / chunks;
    with_width(H, [&](auto hc) {
      backward_rows<decltype(hc)::value>(g, W, h, mask, rows, start, order, u0, u1, sample, H,
                                         part, gw, gb, stream);
    });
#ifdef __AVX2__
    if (stream) _mm_sfence();  // the streamed rows are visible before the block counts as done
#endif
  });
  if (gh)
    parallel(nt, nblocks_of(B, 16), [&](int64_t blk) {
      for (int64_t b = blk * 16; b < std::min(B, blk * 16 + 16); ++b) {
        float* __restrict o = gh + b * H;
        for (int64_t i = 0; i < H; ++i) o[i] = parts[static_cast<size_t>(b * H + i)];
        for (int64_t c = 1; c < chunks; ++c) {
          const float* __restrict s = parts.data() + (c * B + b) * H;
          for (int64_t i = 0; i < H; ++i) o[i] += s[i];
        }
      }
    });
}

}  // extern "C"

// --- SLIDE's hash tables (strategies/slide/lsh.py) --------------------------------------------
// The tables are the pure path's own arrays (int64 tensors read and written in place): per
// table l, sorted[l, :] the C neuron ids grouped by bucket, offsets[l, code] .. offsets[l, code
// + 1] the bucket's slice. Every random number (the build's keys, the per-step table orders, tie
// breaks and fills) is drawn by the caller from its torch generator and passed in, so the
// kernels return exactly the pure path's hash codes, buckets and active sets; rows (or tables)
// are independent, so any thread count gives the same result.
namespace {

// A set of neuron ids in [0, C): one bit each, cleared after a row by its own members.
struct IdSet {
  std::vector<uint64_t> bits;
  explicit IdSet(int64_t C) : bits(static_cast<size_t>((C + 63) / 64), 0) {}
  int64_t added(int64_t v) {  // insert without a branch: 1 when v was not in the set
    uint64_t& w = bits[static_cast<size_t>(v >> 6)];
    const uint64_t m = uint64_t{1} << (v & 63);
    const int64_t fresh = (w & m) == 0;
    w |= m;
    return fresh;
  }
  bool insert(int64_t v) { return added(v) != 0; }  // true when v was not in the set
  void erase(int64_t v) { bits[static_cast<size_t>(v >> 6)] &= ~(uint64_t{1} << (v & 63)); }
};

// Rows [0, n) dealt in blocks of `per` to up to nt threads; fn(thread_state, row).
template <class S, class Make, class F>
void per_row(int nt, int64_t n, int64_t per, Make make, F fn) {
  const int64_t nb = nblocks_of(n, per);
  const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt, nb)));
  std::vector<std::thread> pool;
  auto work = [&](int t) {
    S state = make();
    for (int64_t b = t; b < nb; b += used)
      for (int64_t r = b * per, e = std::min(n, b * per + per); r < e; ++r) fn(state, r);
  };
  for (int t = 1; t < used; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
}

// torch.argsort(x, stable=True) of n < 2^32 floats in [0, 1) (uniform draws): for such floats
// the bits order as the values, so (bits, index) packed in 64 bits sort as (value, index).
inline void stable_order(const float* x, int64_t n, int64_t* out, uint64_t* scratch) {
  for (int64_t i = 0; i < n; ++i)
    scratch[i] = (static_cast<uint64_t>(bits_of(x[i])) << 32) | static_cast<uint64_t>(i);
  std::sort(scratch, scratch + n);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(scratch[i] & 0xffffffffu);
}

// torch.argmax over n floats: the first largest, a NaN counting as the largest.
inline int64_t first_argmax(const float* x, int64_t n) {
  int64_t best = 0;
  float v = x[0];
  if (std::isnan(v)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > v) {
      v = x[j];
      best = j;
    }
  }
  return best;
}

}  // namespace

extern "C" {

// SimHash (lsh.SimHash.codes): codes[n, l] = sum_k [p[n, l K + k] > 0] 2^k, p the projections
// [N, K L] (torch's product v @ proj, so the signs are the pure path's own).
void lsh_simhash_codes(const float* p, int64_t N, int64_t K, int64_t L, int64_t* codes, int nt) {
  parallel(nt, nblocks_of(N, 64), [&](int64_t blk) {
    for (int64_t n = blk * 64, e = std::min(N, blk * 64 + 64); n < e; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const float* q = p + n * K * L + l * K;
        int64_t c = 0;
        for (int64_t k = 0; k < K; ++k) c |= static_cast<int64_t>(q[k] > 0.0f) << k;
        codes[n * L + l] = c;
      }
  });
}

// DWTA (lsh.DWTA.codes), per row of v [N, dim]: 1. each of the K L functions the argmax of its
// bin_size coordinates (coords [K L, bin]), empty when they are all zero; 2. densification: for
// r < probes, an empty function takes the value of probe[r, j] (all from the previous round's
// values) and stays empty only if that one was; still empty: bin_size; 3. table l's code:
// sum_k h[l K + k] mult[k] (int64, wrapping) modulo buckets (a power of two).
void lsh_dwta_codes(const float* v, int64_t N, int64_t dim, const int64_t* coords, int64_t K,
                    int64_t L, int64_t bin, const int64_t* probe, int64_t probes,
                    const int64_t* mult, int64_t buckets, int64_t* codes, int nt) {
  const int64_t nh = K * L;
  struct Scratch {
    std::vector<int64_t> h, h2;
    std::vector<uint8_t> empty, empty2;
    std::vector<float> vals;
  };
  per_row<Scratch>(nt, N, 16, [&] {
    return Scratch{std::vector<int64_t>(nh), std::vector<int64_t>(nh), std::vector<uint8_t>(nh),
                   std::vector<uint8_t>(nh), std::vector<float>(bin)};
  }, [&](Scratch& s, int64_t n) {
    const float* x = v + n * dim;
    bool any = false;
    for (int64_t j = 0; j < nh; ++j) {
      bool all_zero = true;
      for (int64_t i = 0; i < bin; ++i) {
        s.vals[i] = x[coords[j * bin + i]];
        all_zero &= s.vals[i] == 0.0f;
      }
      s.h[j] = first_argmax(s.vals.data(), bin);
      s.empty[j] = all_zero;
      any |= all_zero;
    }
    for (int64_t r = 0; r < probes && any; ++r) {
      const int64_t* src = probe + r * nh;
      any = false;
      for (int64_t j = 0; j < nh; ++j) {
        s.h2[j] = s.empty[j] ? s.h[src[j]] : s.h[j];
        s.empty2[j] = s.empty[j] && s.empty[src[j]];
        any |= s.empty2[j] != 0;
      }
      std::swap(s.h, s.h2);
      std::swap(s.empty, s.empty2);
    }
    for (int64_t j = 0; j < nh; ++j)
      if (s.empty[j]) s.h[j] = bin;
    for (int64_t l = 0; l < L; ++l) {
      uint64_t c = 0;
      for (int64_t k = 0; k < K; ++k)
        c += static_cast<uint64_t>(s.h[l * K + k]) * static_cast<uint64_t>(mult[k]);
      codes[n * L + l] = static_cast<int64_t>(c & static_cast<uint64_t>(buckets - 1));
    }
  });
}

// Tables.build, per table l (in parallel): the neurons sorted by (code, key[l, c], c), codes
// [C, L] and keys [L, C] in [0, 1): a counting sort by code (stable), then each bucket sorted by
// key (stable), as torch.argsort(code + key / 2, stable=True); offsets[l] the buckets' starts
// and C.
void lsh_build(const int64_t* codes, const float* key, int64_t C, int64_t L, int64_t nb,
               int64_t* sorted, int64_t* offsets, int nt) {
  parallel(nt, L, [&](int64_t l) {
    int64_t* off = offsets + l * (nb + 1);
    int64_t* out = sorted + l * C;
    const float* kl = key + l * C;
    for (int64_t b = 0; b <= nb; ++b) off[b] = 0;
    for (int64_t c = 0; c < C; ++c) ++off[codes[c * L + l] + 1];
    for (int64_t b = 0; b < nb; ++b) off[b + 1] += off[b];
    std::vector<int64_t> next(off, off + nb);
    for (int64_t c = 0; c < C; ++c) out[next[codes[c * L + l]]++] = c;
    for (int64_t b = 0; b < nb; ++b)
      if (off[b + 1] - off[b] > 1)
        std::stable_sort(out + off[b], out + off[b + 1],
                         [kl](int64_t a, int64_t c) { return kl[a] < kl[c]; });
  });
}

// Each table's bucket lies at a random place of its sorted ids (L C int64: far past the caches);
// a row's buckets are known from its codes, so lsh_vanilla asks for each this many tables ahead.
constexpr int64_t BUCKETS_AHEAD = 4;

// Vanilla sampling, steps 1-2 (Tables.query_vanilla, then first_distinct before its fill): per
// row b, its tables in the order of torch.argsort(rnd[b], stable=True), each hit bucket's first
// min(count, bucket) neurons; T = min(L, 2 + the most tables any row needs whose buckets hold
// fewer than `size` neurons in all); ids[b] the forced ids (negative: none) then the distinct
// neurons of its first T tables in that order, cut at size (C >= size), mask 1 on the filled
// slots, 0 (id 0) on the rest. Returns 1 when some row is short (the caller then draws the
// fill's starts and calls lsh_fill).
int lsh_vanilla(const int64_t* codes, const int64_t* sorted, const int64_t* offsets, int64_t B,
                int64_t L, int64_t C, int64_t nb, int64_t bucket, const float* rnd,
                const int64_t* forced, int64_t F, int64_t size, int64_t* ids, uint8_t* mask,
                int nt) {
  std::vector<int64_t> perm(static_cast<size_t>(B * L)), need(static_cast<size_t>(B));
  auto bucket_of = [&](int64_t b, int64_t l, int64_t* count) {
    const int64_t* off = offsets + l * (nb + 1);
    const int64_t code = codes[b * L + l];
    *count = std::min(off[code + 1] - off[code], bucket);
    return off[code];
  };
  parallel(nt, nblocks_of(B, 16), [&](int64_t blk) {
    std::vector<uint64_t> scratch(static_cast<size_t>(L));
    for (int64_t b = blk * 16, e = std::min(B, blk * 16 + 16); b < e; ++b) {
      int64_t* pb = perm.data() + b * L;
      stable_order(rnd + b * L, L, pb, scratch.data());
      int64_t cum = 0, n = 0;
      for (int64_t t = 0; t < L; ++t) {
        int64_t count;
        bucket_of(b, pb[t], &count);
        cum += count;
        n += cum < size;
      }
      need[b] = n;
    }
  });
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) most = std::max(most, need[b]);
  const int64_t T = std::min(L, most + 2);
  std::vector<uint8_t> short_row(static_cast<size_t>(B), 0);
  per_row<IdSet>(nt, B, 8, [&] { return IdSet(C); }, [&](IdSet& seen, int64_t b) {
    int64_t* out = ids + b * size;
    int64_t n = 0;
    for (int64_t f = 0; f < F && n < size; ++f) {
      const int64_t v = forced[b * F + f];
      if (v >= 0 && v < C && seen.insert(v)) out[n++] = v;
    }
    for (int64_t t = 0; t < T && n < size; ++t) {
      if (t + BUCKETS_AHEAD < T) {  // the bucket read BUCKETS_AHEAD tables on, asked for now
        const int64_t la = perm[b * L + t + BUCKETS_AHEAD];
        int64_t ca;
        const int64_t* at = sorted + la * C + bucket_of(b, la, &ca);
        for (int64_t j = 0; j < ca; j += 8) __builtin_prefetch(at + j);
      }
      const int64_t l = perm[b * L + t];
      int64_t count;
      const int64_t st = bucket_of(b, l, &count);
      const int64_t* row = sorted + l * C + st;
      // written always, kept where new (n < size: the place is the row's): a bucket's
      // neurons repeat those of the row's earlier buckets at random, and a branch on it was
      // mispredicted as often as not
      for (int64_t j = 0; j < count && n < size; ++j) {
        out[n] = row[j];
        n += seen.added(row[j]);
      }
    }
    for (int64_t j = 0; j < n; ++j) seen.erase(out[j]);
    for (int64_t j = 0; j < size; ++j) mask[b * size + j] = j < n;
    for (int64_t j = n; j < size; ++j) out[j] = 0;
    short_row[b] = n < size;
  });
  for (int64_t b = 0; b < B; ++b)
    if (short_row[b]) return 1;
  return 0;
}

// first_distinct's fill: a short row b keeps its ids and takes (start[b] + j) mod C, j = 0, 1,
// ..., those not in it yet, until it holds size (C >= size); full rows are left as they are.
// Only the first `size` candidates can be needed (at most n of them are the row's own), so the
// row's ids are looked up in a bitmap of that window (size bits), not of all C neurons.
void lsh_fill(int64_t* ids, uint8_t* mask, int64_t B, int64_t size, int64_t C,
              const int64_t* start, int nt) {
  per_row<std::vector<uint64_t>>(
      nt, B, 8, [&] { return std::vector<uint64_t>(static_cast<size_t>((size + 63) / 64)); },
      [&](std::vector<uint64_t>& window, int64_t b) {
        int64_t* out = ids + b * size;
        uint8_t* m = mask + b * size;
        int64_t n = 0;
        while (n < size && m[n]) ++n;
        if (n == size) return;
        std::fill(window.begin(), window.end(), 0);
        const int64_t s0 = (start[b] % C + C) % C;
        for (int64_t j = 0; j < n; ++j) {  // the row's ids at distance d < size past s0
          int64_t d = out[j] - s0;
          d += d < 0 ? C : 0;
          if (d < size) window[static_cast<size_t>(d >> 6)] |= uint64_t{1} << (d & 63);
        }
        // candidate d is s0 + d mod C, written always and kept where not the row's
        int64_t v = s0;
        for (int64_t d = 0; n < size && d < size; ++d) {
          out[n] = v;
          n += ((window[static_cast<size_t>(d >> 6)] >> (d & 63)) & 1) == 0;
          v = v + 1 == C ? 0 : v + 1;
        }
        for (int64_t j = 0; j < size; ++j) m[j] = 1;
      });
}

// Top-k sampling (Tables.query, then select): per row b the entries are its L tables' first
// `bucket` neurons of each hit bucket (weight 1 each, the valid ones), its forced ids (weight L
// bucket + 1, negative: none) and fill[b] (size random ids, weight 0); the distinct ids in
// ascending order are the runs r = 0, 1, ..., each scored sum of its weights (float32) +
// tie[b, r]; ids[b] the `size` best runs by (score descending, r ascending), mask 1, then
// (fewer runs than size) id 0 with mask 0. tie has M = L bucket + F + size columns.
void lsh_topk(const int64_t* codes, const int64_t* sorted, const int64_t* offsets, int64_t B,
              int64_t L, int64_t C, int64_t nb, int64_t bucket, const int64_t* forced, int64_t F,
              const int64_t* fill, const float* tie, int64_t size, int64_t* ids, uint8_t* mask,
              int nt) {
  const int64_t M = L * bucket + F + size;
  const float wf = static_cast<float>(L * bucket + 1);
  struct Scratch {
    std::vector<std::pair<int64_t, float>> e;
    std::vector<std::pair<float, int64_t>> runs;
    std::vector<int64_t> run_id;
  };
  per_row<Scratch>(nt, B, 8, [] { return Scratch{}; }, [&](Scratch& s, int64_t b) {
    s.e.clear();
    for (int64_t l = 0; l < L; ++l) {
      const int64_t* off = offsets + l * (nb + 1);
      const int64_t code = codes[b * L + l];
      const int64_t st = off[code], count = std::min(off[code + 1] - st, bucket);
      for (int64_t j = 0; j < count; ++j) s.e.emplace_back(sorted[l * C + st + j], 1.0f);
    }
    for (int64_t f = 0; f < F; ++f)
      if (forced[b * F + f] >= 0) s.e.emplace_back(forced[b * F + f], wf);
    for (int64_t j = 0; j < size; ++j) s.e.emplace_back(fill[b * size + j], 0.0f);
    // stable by id: a run's weights add in the pure path's order (candidates, forced, fill)
    std::stable_sort(s.e.begin(), s.e.end(),
                     [](const auto& a, const auto& c) { return a.first < c.first; });
    s.runs.clear();
    s.run_id.clear();
    const float* tb = tie + b * M;
    for (size_t i = 0; i < s.e.size();) {
      const int64_t id = s.e[i].first;
      float score = 0.0f;
      for (; i < s.e.size() && s.e[i].first == id; ++i) score += s.e[i].second;
      const int64_t r = static_cast<int64_t>(s.run_id.size());
      s.run_id.push_back(id);
      s.runs.emplace_back(score + tb[r], r);
    }
    const int64_t take = std::min<int64_t>(size, static_cast<int64_t>(s.runs.size()));
    std::partial_sort(s.runs.begin(), s.runs.begin() + take, s.runs.end(),
                      [](const auto& a, const auto& c) {
                        return a.first > c.first || (a.first == c.first && a.second < c.second);
                      });
    for (int64_t j = 0; j < size; ++j) {
      const bool on = j < take;
      ids[b * size + j] = on ? s.run_id[s.runs[j].second] : 0;
      mask[b * size + j] = on;
    }
  });
}

}  // extern "C"

// --- SLIDE's loss over the active set (strategies/slide/layer.py, active_softmax_loss) --------
namespace {
#if defined(__AVX2__) && defined(__FMA__)
// e^x on eight lanes for x <= 0 (the loss's max-shifted logits), within 0.9 units of float32's
// last place of the exact value where the result is normal (measured on every 64th float of
// [-87, 0] and every float of [-1e-3, 0]): x = n ln 2 + r, |r| <= ln 2 / 2 (n
// rounded, ln 2 in two parts so n ln 2 is exact enough), e^r by its Taylor polynomial to r^7
// (truncation below 2^-26 of the result), scaled by 2^n through the exponent's bits; below
// -87.3 (where e^x leaves float32's normal range) 0, where std::exp gives a subnormal under
// 1.2e-38 (negligible in a softmax whose sum is at least 1); a NaN stays NaN.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);  // NaN: x (the second operand) kept
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.0f / 5040.0f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 720.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}
#endif
}  // namespace

extern "C" {

// Forward, per row b (in parallel): the targets t[b, a] = slot a is on (mask) and its global id
// ids + offset is one of the row's labels (labels [B, Y], negative: padding); cnt_b = the row's
// labels, at least 1; z's max m_b over the slots that are on, e[b, a] = exp(z - m_b) (0 off;
// eight at a time by exp_nonpositive where the CPU has AVX2 and FMA),
// s_b = sum_a e (double), lse_b = m_b + log s_b; row_b = -sum_{t} (z - lse_b) / cnt_b (double);
// loss = sum_b row_b / B. Keeps p[b, a] = e / s_b (the softmax), scale[b] = T_b (targets on)
// and cnt_b for the backward. A row with no slot on contributes 0 (and its p is 0).
void slide_softmax_loss(const float* z, const int64_t* ids, const uint8_t* mask,
                        const int64_t* labels, int64_t B, int64_t A, int64_t Y, int64_t offset,
                        float* p, uint8_t* t, double* rows, double* targets, double* cnt,
                        double* loss, int nt) {
  parallel(nt, nblocks_of(B, 4), [&](int64_t blk) {
    for (int64_t b = blk * 4, e = std::min(B, blk * 4 + 4); b < e; ++b) {
      const float* zb = z + b * A;
      const uint8_t* mb = mask ? mask + b * A : nullptr;
      const int64_t* lb = labels + b * Y;
      int64_t nl = 0;
      for (int64_t y = 0; y < Y; ++y) nl += lb[y] >= 0;
      float m = -INFINITY;
      bool any = false;
      int64_t a1 = 0;
#ifdef __AVX2__
      {  // the max eight lanes at a time (exact in any order), a NaN on kept as torch's max does
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        __m256 m8 = ninf, nan8 = _mm256_setzero_ps();
        __m256i seen = _mm256_setzero_si256();
        for (; a1 + 8 <= A; a1 += 8) {
          __m256 v = _mm256_loadu_ps(zb + a1);
          if (mb) {
            const __m256i on = _mm256_cmpgt_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mb + a1))),
                _mm256_setzero_si256());
            v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(on));
            seen = _mm256_or_si256(seen, on);
          }
          nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          m8 = _mm256_max_ps(m8, v);
        }
        any = mb ? !_mm256_testz_si256(seen, seen) : a1 > 0;
        alignas(32) float l[8];
        _mm256_store_ps(l, m8);
        for (int j = 0; j < 8; ++j) m = std::max(m, l[j]);
        if (_mm256_movemask_ps(nan8)) m = NAN;
      }
#endif
      for (int64_t a = a1; a < A; ++a)
        if (!mb || mb[a]) {
          m = !any || std::isnan(zb[a]) ? zb[a] : std::max(m, zb[a]);
          any = true;
        }
      double s = 0.0;
      float* pb = p + b * A;
      int64_t a0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
      {  // eight at a time: e^(z - m) where the slot is on, 0 where it is off; the sum in
         // four double lanes, added in a fixed order (the same bits on any thread count)
        const __m256 mv = _mm256_set1_ps(m);
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        for (; a0 + 8 <= A; a0 += 8) {
          __m256 v = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(zb + a0), mv));
          if (mb) {
            const __m128i on8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mb + a0));
            const __m256i on = _mm256_cvtepu8_epi32(on8);
            v = _mm256_and_ps(v, _mm256_castsi256_ps(
                                     _mm256_cmpgt_epi32(on, _mm256_setzero_si256())));
          }
          _mm256_storeu_ps(pb + a0, v);
          s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
          s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
        }
        alignas(32) double l[4];
        _mm256_store_pd(l, _mm256_add_pd(s0, s1));
        s = (l[0] + l[1]) + (l[2] + l[3]);
      }
#endif
      for (int64_t a = a0; a < A; ++a) {
        const float v = (!mb || mb[a]) ? std::exp(zb[a] - m) : 0.0f;
        pb[a] = v;
        s += v;
      }
      const double lse = static_cast<double>(m) + std::log(s);
      const float inv = any ? static_cast<float>(1.0 / s) : 0.0f;  // no slot on: p = 0
      double sum_t = 0.0, T = 0.0;
      int64_t a2 = 0;
#if defined(__AVX2__) && defined(__BMI2__)
      {  // eight at a time: p scaled, the targets compared as 64-bit ids, the hits (a few a row)
         // added in slot order
        const __m256 iv = _mm256_set1_ps(inv);
        const __m256i off = _mm256_set1_epi64x(offset);
        const int64_t* ib = ids + b * A;
        for (; a2 + 8 <= A; a2 += 8) {
          _mm256_storeu_ps(pb + a2, _mm256_mul_ps(_mm256_loadu_ps(pb + a2), iv));
          const __m256i lo = _mm256_add_epi64(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ib + a2)), off);
          const __m256i hi = _mm256_add_epi64(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ib + a2 + 4)), off);
          __m256i hl = _mm256_setzero_si256(), hh = hl;
          for (int64_t y = 0; y < Y; ++y)
            if (lb[y] >= 0) {
              const __m256i lv = _mm256_set1_epi64x(lb[y]);
              hl = _mm256_or_si256(hl, _mm256_cmpeq_epi64(lo, lv));
              hh = _mm256_or_si256(hh, _mm256_cmpeq_epi64(hi, lv));
            }
          uint32_t hit = static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(hl))) |
                         (static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(hh))) << 4);
          if (mb)  // the slots that are on: their mask bytes nonzero
            hit &= ~static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(
                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mb + a2)),
                       _mm_setzero_si128()))) & 0xffu;
          const uint64_t bytes = _pdep_u64(hit, 0x0101010101010101ull);
          std::memcpy(t + b * A + a2, &bytes, 8);
          for (uint32_t rest = hit; rest; rest &= rest - 1) {
            sum_t += static_cast<double>(zb[a2 + __builtin_ctz(rest)]) - lse;
            T += 1.0;
          }
        }
      }
#endif
      for (int64_t a = a2; a < A; ++a) {
        pb[a] *= inv;
        bool hit = false;
        if (!mb || mb[a])
          for (int64_t y = 0; y < Y; ++y) hit |= lb[y] >= 0 && ids[b * A + a] + offset == lb[y];
        t[b * A + a] = hit;
        if (hit) {
          sum_t += static_cast<double>(zb[a]) - lse;
          T += 1.0;
        }
      }
      cnt[b] = static_cast<double>(std::max<int64_t>(nl, 1));
      targets[b] = T;
      rows[b] = any ? -sum_t / cnt[b] : 0.0;
    }
  });
  double total = 0.0;
  for (int64_t b = 0; b < B; ++b) total += rows[b];
  *loss = B ? total / static_cast<double>(B) : 0.0;
}

// Backward: gz[b, a] = go / (B cnt_b) (T_b p[b, a] - t[b, a]) (0 where the slot is off: p and t
// are 0 there).
void slide_softmax_loss_backward(const float* p, const uint8_t* t, const double* targets,
                                 const double* cnt, int64_t B, int64_t A, double go, float* gz,
                                 int nt) {
  parallel(nt, nblocks_of(B, 4), [&](int64_t blk) {
    for (int64_t b = blk * 4, e = std::min(B, blk * 4 + 4); b < e; ++b) {
      const float f = static_cast<float>(go / (static_cast<double>(B) * cnt[b]));
      const float T = static_cast<float>(targets[b]);
      const float* pb = p + b * A;
      const uint8_t* tb = t + b * A;
      float* gb = gz + b * A;
      for (int64_t a = 0; a < A; ++a) gb[a] = f * (T * pb[a] - static_cast<float>(tb[a]));
    }
  });
}

}  // extern "C"
