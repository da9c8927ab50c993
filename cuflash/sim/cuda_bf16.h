// cuflash CUDA simulator: stand-in for the CUDA toolkit header of the same name.
// The CPU definitions of __nv_bfloat16 and its intrinsics come with the force-included runtime
// (cusim.h -> cusim_half.h); kernels keep their usual #include <cuda_bf16.h>.
#pragma once
#include "cusim.h"
