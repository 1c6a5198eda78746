/* AMX tile plumbing shared by the kernels that use tiles (cpu_amx.h's attention, cpu_linear_amx.c's
 * linears): the target attribute, the OS permission, and entering / leaving a tile configuration.
 * The AVX-512 build compiles tile code under AMX_TARGET; it runs only where the CPU has AMX-BF16
 * and Linux granted this process the tile state (rs_amx_ready; native.py asks it once). */
#ifndef RS_CPU_TILES_H
#define RS_CPU_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 once Linux granted this process the AMX tile state (asked once per library copy; torch's oneDNN
 * asks the same, and asking again is harmless). */
static inline int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Load `cfg`, keeping the caller's configuration in `saved`: torch's brgemm (cpublas) remembers per
 * thread which configuration it loaded and skips reloading it, so tile code must leave the
 * configuration as it found it (the tile data it may clobber). */
AMX_TARGET static inline void amx_enter(tile_config *saved, const tile_config *cfg) {
    _tile_storeconfig(saved); /* all zero where no configuration is loaded */
    _tile_loadconfig(cfg);
}

AMX_TARGET static inline void amx_end(const tile_config *saved) {
    if (saved->palette)
        _tile_loadconfig(saved);
    else
        _tile_release();
}
/* A thread's state for cpu_linear_amx.c's rs_tiles_group: the tile configuration loaded (`loaded` names
 * its row split, -1 none yet) and the image of the four 16 x 16 fp32 accumulators. */
typedef struct {
    tile_config cfg __attribute__((aligned(64)));
    int loaded;
    float c[4 * 256] __attribute__((aligned(64)));
} tile_state;

/* cpu_linear_amx.c's tile plumbing for linears: a configuration with C tiles 0-3, A 4 (and 5), B the rest, for
 * one row tile of rows0 (rows1 = 0) or two; and y rows [0, rows) of columns [n0, n0 + 16) = bf16(c + bias). */
AMX_TARGET void rs_tiles_configure(tile_config *cfg, int rows0, int rows1);
AMX_TARGET void rs_tiles_put_block(const float *c, int rows, const uint16_t *b, int64_t n0, uint16_t *y, int64_t N);
AMX_TARGET void rs_tiles_group(const uint16_t *x, int64_t M, int64_t r0, int64_t r1, const uint16_t *wg, int64_t n0,
                               int nblk, int64_t K, const uint16_t *b, uint16_t *y, int64_t N, tile_state *st);
#else
#define HAVE_AMX 0
static inline int amx_ready(void) { return 0; }
#endif

#endif
