/* Run a Kiln bundle from C, without Python: each input read from a raw file (its bytes as
 * the model takes them, dense row-major), each output written to one.
 *
 *   cc -O2 docs/example_run.c -I BUNDLE BUNDLE/model.so -Wl,-rpath,BUNDLE -o run_model
 *   ./run_model BUNDLE input0.bin [input1.bin ...] output0.bin [output1.bin ...]
 *
 * A bundle built with symbolic dims (kiln build --dim seq=1..512) runs at the sizes given
 * first, one NAME=N per symbol: ./run_model BUNDLE seq=7 input0.bin ... output0.bin ...
 * An output whose size the model counts while it runs (NonZero's) is written as long as
 * the call made it.
 *
 * BUNDLE/kiln_model.h describes the model this program is compiled for (names, dtypes,
 * shapes and sizes of its inputs and outputs) and declares the library's entry points;
 * tests/test_c_api.py compiles this file against a bundle and checks it against onnxruntime.
 * It runs on the usable cores, or on KILN_NUM_THREADS threads when that is set. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln_model.h"

#define AT_LEAST_ONE(n) ((n) > 0 ? (n) : 1)

static int read_exactly(const char* path, void* buf, size_t n) {
  FILE* f = fopen(path, "rb");
  if (!f) return 0;
  size_t got = fread(buf, 1, n, f);
  int at_end = fgetc(f) == EOF;
  fclose(f);
  return got == n && at_end;
}

static int write_all(const char* path, const void* buf, size_t n) {
  FILE* f = fopen(path, "wb");
  if (!f) return 0;
  size_t put = fwrite(buf, 1, n, f);
  return fclose(f) == 0 && put == n;
}

#ifdef KILN_NUM_SYMBOLS
/* Each symbol's value from a NAME=N argument, within its bounds; 0 on a bad or missing one. */
static int read_symbols(char** args, long long* dims) {
  for (int k = 0; k < KILN_NUM_SYMBOLS; ++k) {
    size_t len = strlen(kiln_symbol_names[k]);
    char* end = NULL;
    if (strncmp(args[k], kiln_symbol_names[k], len) != 0 || args[k][len] != '=') {
      fprintf(stderr, "argument %d must be %s=N\n", k + 2, kiln_symbol_names[k]);
      return 0;
    }
    dims[k] = strtoll(args[k] + len + 1, &end, 10);
    if (*end || dims[k] < kiln_symbol_least[k] || dims[k] > kiln_symbol_greatest[k]) {
      fprintf(stderr, "%s: the bundle runs %s = %lld..%lld\n", args[k], kiln_symbol_names[k],
              kiln_symbol_least[k], kiln_symbol_greatest[k]);
      return 0;
    }
  }
  return 1;
}
#define SYMBOL_ARGS KILN_NUM_SYMBOLS
#else
#define SYMBOL_ARGS 0
#endif

int main(int argc, char** argv) {
  if (argc != 2 + SYMBOL_ARGS + KILN_NUM_INPUTS + KILN_NUM_OUTPUTS) {
    fprintf(stderr, "usage: %s BUNDLE %s%d input file(s) %d output file(s)\n", argv[0],
            SYMBOL_ARGS ? "NAME=N (one per symbol) " : "", KILN_NUM_INPUTS, KILN_NUM_OUTPUTS);
    return 2;
  }
  size_t in_bytes[AT_LEAST_ONE(KILN_NUM_INPUTS)], out_bytes[AT_LEAST_ONE(KILN_NUM_OUTPUTS)];
#if defined(KILN_NUM_DIMS)  /* (sizes the model counts while it runs: the call writes them after ours) */
  long long dims[KILN_NUM_DIMS];
  if (!read_symbols(argv + 2, dims)) return 2;
  for (int i = 0; i < KILN_NUM_INPUTS; ++i) in_bytes[i] = kiln_input_bytes_at(i, dims);
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) out_bytes[i] = kiln_output_bytes_at(i, dims);  /* (the greatest) */
#elif defined(KILN_NUM_SYMBOLS)
  long long dims[KILN_NUM_SYMBOLS];
  if (!read_symbols(argv + 2, dims)) return 2;
  for (int i = 0; i < KILN_NUM_INPUTS; ++i) in_bytes[i] = kiln_input_bytes_at(i, dims);
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) out_bytes[i] = kiln_output_bytes_at(i, dims);
#else
  for (int i = 0; i < KILN_NUM_INPUTS; ++i) in_bytes[i] = kiln_input_bytes[i];
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) out_bytes[i] = kiln_output_bytes[i];
#endif
  char** files = argv + 2 + SYMBOL_ARGS;
  /* The library must be the one this header describes. */
  if (kiln_abi_version() != KILN_ABI_VERSION || strcmp(kiln_signature(), KILN_SIGNATURE) != 0) {
    fprintf(stderr, "model.so was not built for this kiln_model.h (entry ABI %d, signature %s)\n",
            kiln_abi_version(), kiln_signature());
    return 1;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", argv[1], KILN_WEIGHTS_FILE);
  char* weights = kiln_load_weights(path);
  char* arena = kiln_alloc_arena();
  if (!weights || !arena) {
    fprintf(stderr, "cannot load %s (%u bytes expected) or allocate the arena\n", path, KILN_WEIGHTS_BYTES);
    return 1;
  }
  void* inputs[AT_LEAST_ONE(KILN_NUM_INPUTS)];
  void* outputs[AT_LEAST_ONE(KILN_NUM_OUTPUTS)];
  for (int i = 0; i < KILN_NUM_INPUTS; ++i) {
    inputs[i] = malloc(in_bytes[i] ? in_bytes[i] : 1);
    if (!inputs[i] || !read_exactly(files[i], inputs[i], in_bytes[i])) {
      fprintf(stderr, "input '%s': %s does not hold exactly %zu bytes of %s\n", kiln_input_names[i],
              files[i], in_bytes[i], kiln_input_dtypes[i]);
      return 1;
    }
  }
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) {
    outputs[i] = aligned_alloc(64, (out_bytes[i] + 64) / 64 * 64);  /* (kernels store whole vectors there) */
    if (!outputs[i]) return 1;
  }
  printf("running on %d thread(s)\n", kiln_num_threads());
#ifdef KILN_NUM_SYMBOLS
  int rc = kiln_run_dims(weights, arena, inputs, outputs, dims, 0);
#else
  int rc = kiln_run(weights, arena, inputs, outputs);
#endif
  if (rc != 0) {
    fprintf(stderr, "kiln_run returned %d\n", rc);
    return 1;
  }
#ifdef KILN_NUM_DIMS
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) out_bytes[i] = kiln_output_bytes_after(i, dims);
#endif
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) {
    const char* out = files[KILN_NUM_INPUTS + i];
    if (!write_all(out, outputs[i], out_bytes[i])) {
      fprintf(stderr, "cannot write %s\n", out);
      return 1;
    }
    printf("%s: %s, %zu bytes -> %s\n", kiln_output_names[i], kiln_output_dtypes[i], out_bytes[i], out);
  }
  for (int i = 0; i < KILN_NUM_INPUTS; ++i) free(inputs[i]);
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) free(outputs[i]);
  free(arena);
  free(weights);
  return 0;
}
