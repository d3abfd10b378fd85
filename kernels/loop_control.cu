// Control kernels of the device-resident engine loop (docs/device_loop.md, "graph").
//
// Compiled at run time with NVRTC (blink_appliance/engine/loop/control.py) and launched inside torch
// stream captures, so every launch becomes a kernel node of the loop's CUDA graph. Each kernel runs
// on one thread: they move a few words, and the loop must not hold SMs it does not need.
//
// Ring words (req_head, req_tail, shutdown) live in the shared-memory region registered with
// cudaHostRegister(..., cudaHostRegisterMapped); the front end (another process) writes req_head and
// shutdown, the schedule kernel writes req_tail. Loads of them are volatile: the compiler must not
// hoist them out of the poll loop, and each one must go over the bus again.

// NVRTC ships no declaration of the device-side graph API; the driver resolves this symbol.
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The loop's idle poll: returns as soon as there is work (a slot is active, or a record is published
// that schedule has not consumed) or shutdown is requested. While idle it sleeps with exponential
// backoff from min_sleep_ns to max_sleep_ns, so an idle loop costs a few bus reads per max_sleep_ns
// and a request arriving after a long idle period is seen within about max_sleep_ns.
__device__ __forceinline__ void idle_poll(const int* num_active,
                                          const unsigned long long* req_head,
                                          const unsigned long long* req_tail,
                                          const unsigned long long* shutdown,
                                          unsigned int min_sleep_ns,
                                          unsigned int max_sleep_ns) {
    const volatile int* active = num_active;
    const volatile unsigned long long* head = req_head;
    const volatile unsigned long long* tail = req_tail;
    const volatile unsigned long long* stop = shutdown;
    unsigned int sleep_ns = min_sleep_ns;
    while (*active == 0 && *head == *tail && *stop == 0) {
        __nanosleep(sleep_ns);
        sleep_ns = sleep_ns < max_sleep_ns / 2 ? sleep_ns * 2 : max_sleep_ns;
    }
}

// The end of an iteration: the WHILE condition, and when the body runs again the idle poll that
// would otherwise open the next iteration as a kernel of its own (one dependent launch fewer a step).
extern "C" __global__ void wait_and_set_while(unsigned long long handle,
                                              const int* keep_running,
                                              const int* num_active,
                                              const unsigned long long* req_head,
                                              const unsigned long long* req_tail,
                                              const unsigned long long* shutdown,
                                              unsigned int min_sleep_ns,
                                              unsigned int max_sleep_ns) {
    const bool keep = *keep_running != 0;
    if (keep) {
        idle_poll(num_active, req_head, req_tail, shutdown, min_sleep_ns, max_sleep_ns);
    }
    cudaGraphSetConditional(handle, keep ? 1u : 0u);
}

// WHILE condition: the body runs again while *keep_running != 0.
extern "C" __global__ void set_while(unsigned long long handle, const int* keep_running) {
    cudaGraphSetConditional(handle, *keep_running != 0 ? 1u : 0u);
}

// SWITCH value: branch *value runs; a value >= the number of branches (or negative) runs none.
extern "C" __global__ void set_switch(unsigned long long handle, const int* value) {
    cudaGraphSetConditional(handle, static_cast<unsigned int>(*value));
}

// The values of n SWITCH nodes that follow one another, set by one launch: handles[i] gets *values[i].
extern "C" __global__ void set_switches(const unsigned long long* handles, const int* const* values, int n) {
    for (int i = 0; i < n; ++i) {
        cudaGraphSetConditional(handles[i], static_cast<unsigned int>(*values[i]));
    }
}

// The device clock (ns) into *out: for the host/device clock offset and for latency stamps.
extern "C" __global__ void stamp_globaltimer(unsigned long long* out) {
    *out = globaltimer_ns();
}
