/* Checks the division-free quotient of the CUDA quantize kernel (quantize_kernel.py,
 * _codes_fast) against IEEE division, on this machine's own FMA.
 *
 *   q = fl(x * y) with y = fl(1 / d), then STEPS times: q = fma(fma(-q, d, x), y, q)
 *
 * must equal fl(x / d). The result is invariant under scaling x or d by powers of two
 * (no underflow or overflow; the kernel's s2 range check keeps it so), so significands in
 * [1, 2) cover every case: all 2^23 fp32 significands of d against every significand x
 * with XBITS mantissa bits (7: bf16, 10: fp16), exhaustively; or, with XBITS 23 (fp32),
 * N random pairs.
 *
 * usage: markstein_check XBITS STEPS [N]; prints "cases=... mismatches=...". */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static float markstein(float x, float d, int steps) {
    float y = 1.0f / d, q = x * y;
    for (int s = 0; s < steps; s++) q = fmaf(fmaf(-q, d, x), y, q);
    return q;
}

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next23(void) {
    state ^= state << 13; state ^= state >> 7; state ^= state << 17;
    return (uint32_t)(state >> 20) & 0x7FFFFF;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s XBITS STEPS [N]\n", argv[0]); return 2; }
    int xbits = atoi(argv[1]), steps = atoi(argv[2]);
    long cases = 0, bad = 0;
    if (xbits < 23) {
        for (uint32_t dm = 0; dm < (1u << 23); dm++) {
            float d = from_bits(0x3F800000u | dm);
            for (uint32_t xm = 0; xm < (1u << xbits); xm++, cases++) {
                float x = from_bits(0x3F800000u | (xm << (23 - xbits)));
                if (markstein(x, d, steps) != x / d && bad++ < 3) printf("x=%a d=%a\n", x, d);
            }
        }
    } else {
        long n = argc > 3 ? atol(argv[3]) : 100000000L;
        for (; cases < n; cases++) {
            float d = from_bits(0x3F800000u | next23()), x = from_bits(0x3F800000u | next23());
            if (markstein(x, d, steps) != x / d && bad++ < 3) printf("x=%a d=%a\n", x, d);
        }
    }
    printf("xbits=%d steps=%d cases=%ld mismatches=%ld\n", xbits, steps, cases, bad);
    return bad != 0;
}
