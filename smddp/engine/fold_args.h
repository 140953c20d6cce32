// The GPU step's fold kernel arguments (kernels.cu), passed by value at launch: the one layout the
// kernels, the engine that launches them and the stand-in driver that runs their native bodies share.
// Plain C, so that nvcc, the engine and the rigs all include it.
#pragma once

#include <stdint.h>

#define SMDDP_MAX_FOLD_INPUTS 16

struct FoldArgs {
  uint64_t dst;                         // device address of n elements
  uint64_t n;                           // elements
  uint64_t src[SMDDP_MAX_FOLD_INPUTS];  // the inputs' device addresses, in fold order (local-rank order)
  uint32_t k;                           // inputs (1..SMDDP_MAX_FOLD_INPUTS)
  uint32_t op;                          // wire ReduceOp: 1 sum, 2 average, 3 min, 4 max
  uint64_t divisor;                     // an average's divisor (0: none, a node's partial)
};
