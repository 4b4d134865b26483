/* Kiln's thread pool: linked into every model.so beside the generated entry function.
 *
 * A kernel phase that divides into parts (ir/loop.py, "Threads") is handed out as at most
 * `threads` contiguous ranges: the caller runs the first, workers 1..n-1 the others, and
 * the caller waits for them before the next phase. Each worker has its own slot (one cache
 * line apart): the caller posts a job by bumping the slot's `posted` count, the worker
 * reports it done by copying that count to `finished`. Workers spin briefly for the next
 * job (the phases of one run follow each other within microseconds), then sleep on a
 * condition variable, and exit after a second without work; they are started again on
 * demand, and after fork() the child starts its own.
 *
 * One run at a time uses the pool: a concurrent run (another thread of the process calling
 * the model, with its own arena) finds it busy and runs that phase on its own thread. The
 * split never changes a result: each output element is computed by one part, in the same
 * order whatever the range it falls in.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define KILN_MAX_THREADS 256
#define KILN_SPIN_NS 300000L  /* how long an idle worker spins before it sleeps */
#define KILN_IDLE_EXIT_S 1    /* how long a sleeping worker waits for work before it exits */

typedef void (*kiln_piece_fn)(void* ctx, long call, long phase, long lo, long hi);

struct kiln_slot {
  _Atomic unsigned long posted;    /* jobs given to this worker */
  _Atomic unsigned long finished;  /* jobs it has completed */
  int alive;                       /* guarded by sleep_lock */
  kiln_piece_fn fn;
  void* ctx;
  long call, phase, lo, hi;
} __attribute__((aligned(128)));

static struct kiln_slot slots[KILN_MAX_THREADS];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;   /* held by the run using the pool */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;  /* workers' sleep, start and exit */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int sleepers;  /* guarded by sleep_lock */
static _Atomic int default_threads;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;

static inline void kiln_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static long kiln_elapsed_ns(const struct timespec* since) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (t.tv_sec - since->tv_sec) * 1000000000L + (t.tv_nsec - since->tv_nsec);
}

static void* kiln_worker(void* arg) {
  struct kiln_slot* s = (struct kiln_slot*)arg;
  unsigned long seen = atomic_load(&s->finished);
  for (;;) {
    unsigned long job;
    struct timespec idle_since;
    clock_gettime(CLOCK_MONOTONIC, &idle_since);
    for (unsigned spins = 1;; ++spins) {
      job = atomic_load_explicit(&s->posted, memory_order_acquire);
      if (job != seen) break;
      if (spins % 64 || kiln_elapsed_ns(&idle_since) < KILN_SPIN_NS) {
        kiln_relax();
        continue;
      }
      struct timespec deadline;
      clock_gettime(CLOCK_REALTIME, &deadline);
      deadline.tv_sec += KILN_IDLE_EXIT_S;
      pthread_mutex_lock(&sleep_lock);
      ++sleepers;
      int timed_out = 0;
      while ((job = atomic_load(&s->posted)) == seen && !timed_out)
        timed_out = pthread_cond_timedwait(&wake, &sleep_lock, &deadline) == ETIMEDOUT;
      --sleepers;
      if (job == seen) {  /* a second without work: exit (the caller starts a new worker) */
        s->alive = 0;
        pthread_mutex_unlock(&sleep_lock);
        return NULL;
      }
      pthread_mutex_unlock(&sleep_lock);
      break;
    }
    seen = job;
    s->fn(s->ctx, s->call, s->phase, s->lo, s->hi);
    atomic_store_explicit(&s->finished, seen, memory_order_release);
  }
}

/* The child of a fork has none of the parent's workers: start from an empty pool. */
static void kiln_after_fork_child(void) {
  pthread_mutex_init(&pool_lock, NULL);
  pthread_mutex_init(&sleep_lock, NULL);
  pthread_cond_init(&wake, NULL);
  sleepers = 0;
  for (int i = 0; i < KILN_MAX_THREADS; ++i) {
    slots[i].alive = 0;
    atomic_store(&slots[i].finished, atomic_load(&slots[i].posted));
  }
}

static void kiln_register_fork_handler(void) { pthread_atfork(NULL, NULL, kiln_after_fork_child); }

/* Under sleep_lock: worker w running, or 0 if no thread could be started. */
static int kiln_ensure_worker(int w) {
  struct kiln_slot* s = &slots[w];
  if (s->alive) return 1;
  pthread_once(&fork_handler_once, kiln_register_fork_handler);
  pthread_attr_t attr;
  pthread_t t;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  s->alive = pthread_create(&t, &attr, kiln_worker, s) == 0;
  pthread_attr_destroy(&attr);
  return s->alive;
}

/* The usable cores: the CPUs this process may run on. */
static int kiln_usable_cores(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return 1;
}

int kiln_num_threads(void) {
  int n = atomic_load(&default_threads);
  if (n <= 0) {
    const char* env = getenv("KILN_NUM_THREADS");
    n = env && atoi(env) > 0 ? atoi(env) : kiln_usable_cores();
    atomic_store(&default_threads, n);
  }
  return n;
}

int kiln_set_num_threads(int n) {
  atomic_store(&default_threads, n > 0 ? n : 0);
  return kiln_num_threads();
}

/* Part `i` of `n` of [0, extent), its bounds on multiples of `grain`. */
static long kiln_bound(long extent, long i, long n, long grain) {
  if (i >= n) return extent;
  long b = (long)((__int128)extent * i / n);
  return b - b % grain;
}

/* Run phase `phase` of call `call` over [0, extent) on up to `threads` threads, in at most
 * `pieces` parts. */
void kiln_parallel(kiln_piece_fn fn, void* ctx, long call, long phase, long extent, long pieces, long grain,
                   int threads) {
  long n = pieces < threads ? pieces : threads;
  if (n > KILN_MAX_THREADS) n = KILN_MAX_THREADS;
  if (n > extent / grain) n = extent / grain;
  if (n <= 1 || pthread_mutex_trylock(&pool_lock) != 0) {
    fn(ctx, call, phase, 0, extent);
    return;
  }
  pthread_mutex_lock(&sleep_lock);
  long started = 1;
  for (; started < n; ++started) {
    struct kiln_slot* s = &slots[started];
    if (!kiln_ensure_worker((int)started)) break;
    s->fn = fn;
    s->ctx = ctx;
    s->call = call;
    s->phase = phase;
    s->lo = kiln_bound(extent, started, n, grain);
    s->hi = kiln_bound(extent, started + 1, n, grain);
    atomic_store_explicit(&s->posted, atomic_load(&s->posted) + 1, memory_order_release);
  }
  if (sleepers) pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&sleep_lock);
  /* Parts no worker could take (thread creation failed) run here, after the first. */
  fn(ctx, call, phase, 0, kiln_bound(extent, 1, n, grain));
  if (started < n) fn(ctx, call, phase, kiln_bound(extent, started, n, grain), extent);
  for (long w = 1; w < started; ++w) {
    struct kiln_slot* s = &slots[w];
    unsigned long want = atomic_load_explicit(&s->posted, memory_order_relaxed);
    while (atomic_load_explicit(&s->finished, memory_order_acquire) != want) kiln_relax();
  }
  pthread_mutex_unlock(&pool_lock);
}
