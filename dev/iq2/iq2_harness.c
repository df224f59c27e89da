/* Quantize f32 matrices with llama.cpp's IQ2_XXS and IQ2_XS (ggml_quantize_chunk, given the
 * imatrix) and write their dequantized values, for dev/quant-vs-iq2.sh.
 * Usage: iq2_harness ROWS COLS W.f32 IMATRIX.f32 OUT_PREFIX
 * writes OUT_PREFIX.iq2_xxs.f32 and OUT_PREFIX.iq2_xs.f32 (raw little-endian f32, row-major)
 * and prints "type bits_per_weight" for each. */
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-cpu.h"

static float *read_f32(const char *path, size_t n) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    float *v = malloc(n * sizeof(float));
    if (fread(v, sizeof(float), n, f) != n) { fprintf(stderr, "%s: short read\n", path); exit(1); }
    fclose(f);
    return v;
}

int main(int argc, char **argv) {
    if (argc != 6) { fprintf(stderr, "usage: %s ROWS COLS W.f32 IMATRIX.f32 OUT_PREFIX\n", argv[0]); return 2; }
    long rows = atol(argv[1]), cols = atol(argv[2]);
    float *w = read_f32(argv[3], (size_t)rows * cols);
    float *im = read_f32(argv[4], (size_t)cols);
    ggml_cpu_init();
    enum ggml_type types[2] = {GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS};
    const char *names[2] = {"iq2_xxs", "iq2_xs"};
    for (int t = 0; t < 2; t++) {
        size_t rs = ggml_row_size(types[t], cols);
        void *q = malloc(rs * rows);
        ggml_quantize_init(types[t]);
        size_t n = ggml_quantize_chunk(types[t], w, q, 0, rows, cols, im);
        float *out = malloc((size_t)rows * cols * sizeof(float));
        const struct ggml_type_traits *tr = ggml_get_type_traits(types[t]);
        for (long r = 0; r < rows; r++)
            tr->to_float((const char *)q + r * rs, out + r * cols, cols);
        char path[4096];
        snprintf(path, sizeof path, "%s.%s.f32", argv[5], names[t]);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(out, sizeof(float), (size_t)rows * cols, f) != (size_t)rows * cols) { perror(path); return 1; }
        fclose(f);
        printf("%s %.6f\n", names[t], 8.0 * (double)n / ((double)rows * cols));
        free(q); free(out);
    }
    return 0;
}
