// cuflash CUDA simulator: stand-in for the CUDA toolkit header of the same name.
// The CPU definitions of __half and its intrinsics come with the force-included runtime
// (cusim.h -> cusim_half.h); kernels keep their usual #include <cuda_fp16.h>.
#pragma once
#include "cusim.h"
